"""GGUF reading and the Llama importer on a tiny synthetic file (no weight package needed).

A random moejax decoder (HF "half" RoPE layout) is written as GGUF the way llama.cpp's
converter does it (q/k rows permuted to the interleaved order, matrices as [out, in]); the
importer must give back the same parameters and the same logits. Also: malformed and
truncated GGUF files raise WeightFileError naming the file and the problem.
"""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="pip install gguf")
pytest.importorskip("tokenizers", reason="pip install tokenizers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402

from moejax.io import WeightFileError  # noqa: E402
from moejax.io._common import flat_params  # noqa: E402
from moejax.io.gguf import read_gguf  # noqa: E402
from moejax.io.hf_tokenizer import tokenizer_from_gguf  # noqa: E402
from moejax.io.smollm2 import load_gguf_decoder  # noqa: E402
from moejax.nn.decoder import DecoderLM, dense_decoder_config  # noqa: E402

H, G, K, D, F, L = 4, 2, 8, 32, 48, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _llamacpp_permute(w_out_in, n_head):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rows -> interleaved rows)."""
    return (w_out_in.reshape(n_head, 2, w_out_in.shape[0] // n_head // 2, *w_out_in.shape[1:])
            .swapaxes(1, 2).reshape(w_out_in.shape))


def _vocab():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "hell o"]
    tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in merges]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def _write_tiny_gguf(path, model, cfg, tokens, merges, types, extra=lambda w: None):
    w = gguf.GGUFWriter(str(path), "llama")
    extra(w)  # more metadata or tensors
    w.add_block_count(L)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(K)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(TEMPLATE)
    p = {k: np.asarray(v, np.float32) for k, v in flat_params(model).items()}
    w.add_tensor("token_embd.weight", p["embed"])
    w.add_tensor("output_norm.weight", p["final_norm/scale"])
    for i in range(L):
        b, o = f"blk.{i}.", f"blocks/{i}/"
        w.add_tensor(b + "attn_norm.weight", p[o + "attn_norm/scale"])
        w.add_tensor(b + "ffn_norm.weight", p[o + "ffn_norm/scale"])
        w.add_tensor(b + "attn_q.weight", _llamacpp_permute(p[o + "attn/w_q"].T.copy(), H))
        w.add_tensor(b + "attn_k.weight", _llamacpp_permute(p[o + "attn/w_k"].T.copy(), G))
        w.add_tensor(b + "attn_v.weight", p[o + "attn/w_v"].T.copy())
        w.add_tensor(b + "attn_output.weight", p[o + "attn/w_o"].T.copy())
        for n in ("gate", "up", "down"):
            w.add_tensor(b + f"ffn_{n}.weight", p[o + f"ffn/w_{n}"].T.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokens, merges, types = _vocab()
    cfg = dense_decoder_config(vocab_size=len(tokens), d_model=D, n_layers=L, n_heads=H,
                               n_kv_heads=G, head_dim=K, d_hidden=F, max_seq_len=64,
                               rope_base=10000.0, rope_style="half")
    model = DecoderLM(cfg, rngs=nnx.Rngs(3))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    params = _write_tiny_gguf(path, model, cfg, tokens, merges, types)
    return path, model, cfg, params


def test_importer_undoes_llamacpp_permutation(tiny):
    path, ref, cfg, params = tiny
    model, tok = load_gguf_decoder(path)
    assert model.cfg.rope_style == "half" and model.cfg.kv_heads == G
    assert model.cfg.dim_per_head == K and model.cfg.tie_embeddings
    got = flat_params(model)
    assert set(got) == set(params)
    for k, v in params.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)
    x = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    np.testing.assert_allclose(np.asarray(model(x)[0]), np.asarray(ref(x)[0]), atol=1e-5)


def test_rope_scaling_is_refused_and_unit_frequency_factors_are_read(tiny, tmp_path):
    # Llama 3 files carry RoPE frequency factors (rope_freqs.weight) and others a scaling type;
    # the decoder computes unscaled RoPE, so either would load and compute other positions
    _, ref, cfg, _ = tiny
    tokens, merges, types = _vocab()

    def write(name, extra):
        _write_tiny_gguf(tmp_path / name, ref, cfg, tokens, merges, types, extra)
        return tmp_path / name

    ones = write("ones.gguf", lambda w: w.add_tensor("rope_freqs.weight",
                                                     np.ones(K // 2, np.float32)))
    x = jnp.asarray(np.arange(11)[None] % cfg.vocab_size, jnp.int32)
    np.testing.assert_allclose(np.asarray(load_gguf_decoder(ones)[0](x)[0]),
                               np.asarray(ref(x)[0]), atol=1e-5)
    llama3 = write("llama3.gguf", lambda w: w.add_tensor(
        "rope_freqs.weight", np.array([1.0, 1.0, 2.5, 8.0], np.float32)))
    with pytest.raises(WeightFileError, match=r"llama3\.gguf: rope_freqs\.weight .* from 1 to 8"):
        load_gguf_decoder(llama3)

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    with pytest.raises(WeightFileError, match="rope.scaling.type='linear' with factor 4.0"):
        load_gguf_decoder(write("linear.gguf", linear))


def test_tokenizer_rebuilt_from_metadata(tiny):
    _, tok = load_gguf_decoder(tiny[0])
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode("hello hello")
    hello = tok.token_to_id("hello")
    assert hello is not None and list(ids).count(hello) == 2  # merges applied
    assert tok.decode(ids) == "hello hello"
    assert tok.decode(tok.encode("Ünïcode 123!")) == "Ünïcode 123!"  # byte-level round trip
    assert list(tok.encode("<|im_start|>hi")[:1]) == [1]  # specials recognised
    assert list(tok.encode("7")) == [tok.token_to_id("7")]
    assert len(tok.encode("123")) == 3  # "smollm" pre-tokenizer: digits split individually
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_pre_tokenizer_not_rebuilt_here_is_refused(tiny):
    # "llama-bpe", "qwen2" ... split text by other regexes than GPT-2's: a rebuilt tokenizer
    # would give other ids than the model was trained on

    meta = read_gguf(tiny[0], names=["token_embd.weight"]).metadata
    def pieces(meta):
        return [p for p, _ in tokenizer_from_gguf(meta).tokenizer.pre_tokenizer
                .pre_tokenize_str("x 123")]

    assert pieces(meta) == ["x", "Ġ", "1", "2", "3"]  # "smollm": digits one by one
    assert pieces({**meta, "tokenizer.ggml.pre": "gpt-2"}) == ["x", "Ġ123"]
    assert pieces({k: v for k, v in meta.items() if k != "tokenizer.ggml.pre"}) == ["x", "Ġ123"]
    for pre in ("llama-bpe", "qwen2"):
        with pytest.raises(WeightFileError, match=f"tokenizer.ggml.pre='{pre}'"):
            tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": pre})


def test_not_gguf_file(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(WeightFileError, match=r"weights\.gguf: not a GGUF file"):
        read_gguf(bad)
    with pytest.raises(WeightFileError, match="does not exist"):
        read_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.999])
def test_truncated_gguf(tiny, tmp_path, keep):
    data = tiny[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(WeightFileError, match=r"cut\.gguf: .*truncated") as e:
        load_gguf_decoder(cut)
    assert "pip install" in str(e.value)  # says how to fix


def _rewrite(src, dst, *, skip: str = "", block_count: int | None = None):
    """Copy the tiny GGUF's metadata and tensors to ``dst``, leaving out tensor ``skip`` or
    changing ``llama.block_count``."""
    tokens, merges, types = _vocab()
    w = gguf.GGUFWriter(str(dst), "llama")
    f = read_gguf(src)
    for k in ("llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
              "llama.attention.head_count", "llama.attention.head_count_kv"):
        v = block_count if k == "llama.block_count" and block_count is not None else None
        w.add_uint32(k, int(f.metadata[k]) if v is None else v)
    for name, arr in f.tensors.items():
        if name != skip:
            w.add_tensor(name, arr)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_missing_tensor_named(tiny, tmp_path):
    _rewrite(tiny[0], tmp_path / "partial.gguf", skip="blk.1.ffn_up.weight")
    with pytest.raises(WeightFileError, match=r"partial\.gguf: tensor 'blk\.1\.ffn_up\.weight' "
                                              "is missing"):
        load_gguf_decoder(tmp_path / "partial.gguf")


def _set_tensor_offset(data: bytes, name: str, offset: int) -> bytes:
    """Rewrite the data offset of tensor ``name`` in a GGUF header (v3 layout: name string,
    n_dims uint32, dims uint64 x n_dims, type uint32, offset uint64)."""
    key = len(name).to_bytes(8, "little") + name.encode()
    at = data.index(key) + len(key)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * n_dims + 4
    return data[:at] + offset.to_bytes(8, "little") + data[at + 8:]


def test_overlapping_tensor_offsets_rejected(tiny, tmp_path):
    f = read_gguf(tiny[0], dequantize=False)
    raw = tiny[0].read_bytes()
    # blk.0.ffn_norm has the same size as blk.0.attn_norm: point it at attn_norm's bytes
    reader = gguf.GGUFReader(str(tiny[0]), "r")
    offsets = {t.name: int(t.data_offset) - int(reader.data_offset) for t in reader.tensors}
    assert f.tensors["blk.0.ffn_norm.weight"].nbytes == f.tensors["blk.0.attn_norm.weight"].nbytes
    bad = tmp_path / "overlap.gguf"
    bad.write_bytes(_set_tensor_offset(raw, "blk.0.ffn_norm.weight",
                                       offsets["blk.0.attn_norm.weight"]))
    with pytest.raises(WeightFileError, match=r"overlap\.gguf: tensors .*attn_norm.* overlap"):
        load_gguf_decoder(bad)


def test_extra_layers_rejected(tiny, tmp_path):
    _rewrite(tiny[0], tmp_path / "extra.gguf", block_count=L - 1)  # the file holds L layers
    with pytest.raises(WeightFileError, match=r"extra\.gguf: unexpected tensors "
                                              r"\['blk\.1\..*block_count=1"):
        load_gguf_decoder(tmp_path / "extra.gguf")


def test_non_finite_values_and_names_not_in_the_file_are_refused(tmp_path):
    """A tensor that dequantises to NaN or inf is refused naming it; ``names`` the file does not
    hold are named; the finite tensors read as written."""
    path = tmp_path / "nan.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("good", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("bad", np.array([1.0, np.nan, np.inf, 2.0], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    np.testing.assert_array_equal(read_gguf(path, names=["good"]).tensors["good"],
                                  np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(WeightFileError, match=r"nan\.gguf: tensor 'bad' contains NaN/inf"):
        read_gguf(path)
    with pytest.raises(WeightFileError, match=r"nan\.gguf: tensors missing: \['nope'\]"):
        read_gguf(path, names=["good", "nope"])
