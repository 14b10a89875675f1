"""DeRS compression (moejax.ders_compress): decompose, compress, checkpoint, synthesis."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.delta.dare import dare_keep_mask
from moejax.delta.storage import pack_bits
from moejax.ders_compress import (
    bases_from_dense,
    build_synth_model,
    compress,
    compression_report,
    decompose,
    decompress,
    decompress_deltas,
    expert_cosines,
    load_compressed,
    recompose,
    save_compressed,
    unpack_codes,
)
from moejax.ders_compress.compress import QuantSpec, delta_tree
from moejax.ders_compress.synth import DeRSBuffer
from moejax.nn.decoder import DecoderLM, dense_decoder_config
from moejax.upcycle import UPCYCLE_MOE, UpcycleConfig, output_scale, upcycle_model

D, F, N = 16, 32, 4


def _pure(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _with_params(model, pure):
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "extended"])
def trained(request):
    """A vanilla upcycled MoE whose experts (and universal FFN) moved away from the base."""
    extended = request.param
    cfg = dense_decoder_config(vocab_size=64, d_model=D, n_layers=2, n_heads=2, d_hidden=F,
                               max_seq_len=32)
    dense = DecoderLM(cfg, rngs=nnx.Rngs(0))
    rule = UpcycleConfig(blocks="all", moe=UPCYCLE_MOE.replace(
        top_k=2 if not extended else 1, dispatch="dense", universal_ffn=extended))
    moe = upcycle_model(dense, rule, jax.random.key(1))
    pure = _pure(moe)
    key = jax.random.key(2)
    for i in (0, 1):
        ffn = pure["blocks"][i]["ffn"]
        for part in ("experts", "universal") if extended else ("experts",):
            for w, a in ffn[part].items():
                key, k = jax.random.split(key)
                ffn[part][w] = a + 0.05 * jax.random.normal(k, a.shape) * jnp.std(a)
    moe = _with_params(moe, pure)
    base = bases_from_dense(_pure(dense), (0, 1), output_scale(rule))
    return dict(moe=moe, pure=jax.tree.map(np.asarray, _pure(moe)), base=base,
                extended=extended)


def _close(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)
    assert jax.tree.structure(a) == jax.tree.structure(b)


def test_decompose_recompose_round_trip(trained):
    dec = decompose(trained["pure"], trained["base"], extended=trained["extended"])
    n = N + int(trained["extended"])
    for i in (0, 1):
        ffn = trained["pure"]["blocks"][i]["ffn"]
        assert dec.deltas[i]["w_up"].shape == (n, D, F)
        assert "experts" not in dec.rest["blocks"][i]["ffn"]
        np.testing.assert_allclose(dec.deltas[i]["w_up"][:N],
                                   ffn["experts"]["w_up"] - trained["base"][i]["w_up"][None],
                                   rtol=1e-6, atol=1e-7)
    _close(recompose(dec), trained["pure"], rtol=1e-6, atol=1e-6)
    _close(decompress(compress(dec, "none")), trained["pure"], rtol=1e-6, atol=1e-6)


def test_sparse_compression_is_dare_and_counts_are_exact(trained):
    dec = decompose(trained["pure"], trained["base"], extended=trained["extended"])
    p = 0.6
    c = compress(dec, "sparse", drop_rate=p, key=jax.random.key(3))
    got = decompress_deltas(c)
    keep = dare_keep_mask(jax.random.key(3), delta_tree(dec.deltas), p)
    nnz = 0
    for i in (0, 1):
        for w in ("w_gate", "w_up", "w_down"):
            m = np.stack([np.asarray(keep[str(i)][w][f"e{j}"])
                          for j in range(dec.deltas[i][w].shape[0])])
            want = np.where(m, dec.deltas[i][w] / (1 - p), 0.0)
            np.testing.assert_allclose(got[i][w], want, rtol=1e-6, atol=1e-8)
            nnz += int(m.sum())
    r = compression_report(c)
    n = N + int(trained["extended"])
    base = 2 * 3 * D * F
    assert r["base"] == base and r["delta_values"] == nnz == r["delta_index"]
    assert r["expert_params"] == base + nnz and r["vanilla_expert_params"] == n * base
    assert r["expert_params_with_index"] == base + 2 * nnz  # a value and an index per kept
    assert r["delta_bytes"] == nnz * (4 + 2)  # float32 values + uint16 index (D*F = 512)
    assert 0.3 < nnz / (n * base) < 0.5  # ~ (1 - p)


def test_compression_metadata_says_what_ran_and_a_mismatched_setting_is_refused(trained):
    """A drop rate given with quantisation (or no compression) is refused, not recorded as if
    it had run; the stored metadata names the bits only where codes were stored."""
    dec = decompose(trained["pure"], trained["base"], extended=trained["extended"])
    for method in ("quant", "none"):
        with pytest.raises(ValueError, match=f"drop_rate=0.9 applies to method='sparse', not "
                                             f"'{method}'"):
            compress(dec, method, drop_rate=0.9, bits=4)
    sparse = compress(dec, "sparse", drop_rate=0.5, key=jax.random.key(1)).meta
    quant = compress(dec, "quant", bits=4).meta
    assert (sparse["drop_rate"], sparse["bits"]) == (0.5, 32)  # float32 values kept
    assert (quant["drop_rate"], quant["bits"]) == (0.0, 4)


@pytest.mark.parametrize("bits", [1, 3, 16])
def test_quantised_deltas_error_bound_and_bytes(trained, bits):
    dec = decompose(trained["pure"], trained["base"], extended=trained["extended"])
    c = compress(dec, "quant", bits=bits)
    got = decompress_deltas(c)
    r = compression_report(c)
    n = N + int(trained["extended"])
    for i in (0, 1):
        for w in ("w_gate", "w_up", "w_down"):
            d = dec.deltas[i][w]
            if bits == 16:
                np.testing.assert_array_equal(got[i][w], d.astype(np.float16).astype(np.float32))
                continue
            # default quantiser: midrise, groups of 64 input rows (here: the whole column,
            # d_in <= 32), 2^k cells of [-A, A]; 1 bit = sign x mean |delta| of the group
            amax = np.abs(d).max(axis=1, keepdims=True)  # per expert, per output column
            step = 2 * amax / 2 ** bits
            if bits == 1:
                mean_abs = np.abs(d).mean(axis=1, keepdims=True)
                np.testing.assert_allclose(np.abs(got[i][w]), np.broadcast_to(mean_abs, d.shape),
                                           rtol=1e-5)
                assert np.all(np.sign(got[i][w]) == np.where(d >= 0, 1, -1))
                assert np.linalg.norm(got[i][w] - d) < np.linalg.norm(d)
            else:
                assert np.all(np.abs(got[i][w] - d) <= step / 2 * (1 + 1e-5) + 1e-9)
    per = [(D, F), (D, F), (F, D)]
    if bits == 16:
        want = 2 * n * sum(a * b for a, b in per) * 2
    else:
        want = 2 * n * sum(math.ceil(a * b * bits / 8) + 4 * b for a, b in per)
    assert r["delta_bytes"] == want


def test_unpack_codes_matches_storage_packing():
    rng = np.random.default_rng(0)
    for bits in (1, 2, 3, 5, 8):
        codes = rng.integers(0, 2 ** bits, size=37)
        got = unpack_codes(jnp.asarray(pack_bits(codes, bits)), bits, 37)
        np.testing.assert_array_equal(np.asarray(got), codes)


@pytest.mark.parametrize("method,kw", [("sparse", dict(drop_rate=0.7)), ("quant", dict(bits=3)),
                                       ("quant", dict(bits=3, quant=QuantSpec(group_size=8))),
                                       ("quant", dict(bits=16))])
def test_checkpoint_round_trip_and_synthesis_matches_decompressed(trained, method, kw, tmp_path):
    dec = decompose(trained["pure"], trained["base"], extended=trained["extended"])
    c = compress(dec, method, key=jax.random.key(4), **kw)
    moe_cfg = trained["moe"].cfg
    path = save_compressed(tmp_path / "ckpt", c, moe_cfg)
    c2, cfg2 = load_compressed(path)
    assert cfg2 == moe_cfg and c2.meta == c.meta
    assert sorted(c2.stored.arrays) == sorted(c.stored.arrays)
    for k in c.stored.arrays:
        np.testing.assert_array_equal(c2.stored.arrays[k], c.stored.arrays[k])
        assert c2.stored.arrays[k].dtype == c.stored.arrays[k].dtype
    full = decompress(c2)
    _close(full, decompress(c), rtol=0, atol=0)
    oracle = _with_params(trained["moe"], full)  # every expert materialised (dense dispatch)
    synth = build_synth_model(DecoderLM, cfg2, c2)
    # the synthesis model never holds the N dense experts: no float [n, D, F] variable
    shapes = [x.shape for x in jax.tree.leaves(nnx.state(synth))]
    n = N + int(trained["extended"])
    assert (n, D, F) not in shapes or method == "quant" and kw["bits"] == 16
    assert jax.tree.leaves(nnx.state(synth, DeRSBuffer))
    slot = synth.blocks[0].ffn
    if kw.get("bits") == 16:  # the float16 deltas stay float16 in the buffers
        assert slot.d_up[...].dtype == jnp.float16
    if "quant" in kw:  # one scale per group of 8 input rows: 16 / 8 and 32 / 8 groups
        assert slot.step_up[...].shape[1:] == (2, F) and slot.step_down[...].shape[1:] == (4, D)
    x = jax.random.randint(jax.random.key(5), (2, 9), 0, 64)
    np.testing.assert_allclose(np.asarray(synth(x)[0]), np.asarray(oracle(x)[0]),
                               rtol=2e-4, atol=2e-4)
    # no value in the synthesis forward holds all N experts' float32 weights at once
    stacked = (f"f32[{N},{D},{F}]", f"f32[{N},{F},{D}]", f"f32[{N},{D * F}]")

    def trace(model):
        g, st = nnx.split(model)
        return str(jax.make_jaxpr(lambda st, x: nnx.merge(g, st)(x)[0])(st, x))

    assert any(t in trace(oracle) for t in stacked)  # the check can fire
    assert not any(t in trace(synth) for t in stacked)
    assert "cond[" in trace(synth)  # an expert no token chose is not synthesised


def test_expert_cosines_against_numpy(trained):
    cos = expert_cosines(trained["pure"], trained["base"], extended=trained["extended"])
    i = 1
    ffn = trained["pure"]["blocks"][i]["ffn"]
    ws = ("w_gate", "w_up", "w_down")
    flat = [np.concatenate([ffn["experts"][w][e].ravel() for w in ws]).astype(np.float64)
            for e in range(N)]
    b = np.concatenate([trained["base"][i][w].ravel() for w in ws]).astype(np.float64)
    c01 = flat[0] @ flat[1] / np.linalg.norm(flat[0]) / np.linalg.norm(flat[1])
    np.testing.assert_allclose(cos[i]["pairwise"][0, 1], c01, rtol=1e-9)
    np.testing.assert_allclose(cos[i]["to_base"][2],
                               flat[2] @ b / np.linalg.norm(flat[2]) / np.linalg.norm(b), rtol=1e-9)
    assert np.allclose(np.diag(cos[i]["pairwise"]), 1.0)
    assert 0.99 < cos[i]["to_base"].min() < 1.0  # 5% noise: close but not equal


def test_the_dense_bases_are_the_upcycled_experts_starting_weights():
    """With outputs scaled (a universal FFN beside the experts: w_down / 2), a freshly
    upcycled MoE decomposes into zero deltas against bases_from_dense with that scale."""
    cfg = dense_decoder_config(vocab_size=64, d_model=D, n_layers=2, n_heads=2, d_hidden=F,
                               max_seq_len=32)
    dense = DecoderLM(cfg, rngs=nnx.Rngs(0))
    rule = UpcycleConfig(blocks="all", scale_outputs=True, moe=UPCYCLE_MOE.replace(
        dispatch="dense", universal_ffn=True))
    assert output_scale(rule) == 0.5
    moe = jax.tree.map(np.asarray, _pure(upcycle_model(dense, rule, jax.random.key(1))))
    dec = decompose(moe, bases_from_dense(_pure(dense), (0, 1), output_scale(rule)),
                    extended=True)
    for i in (0, 1):
        for w, d in dec.deltas[i].items():
            np.testing.assert_array_equal(d, np.zeros_like(d), err_msg=f"layer {i} {w}")


def test_the_mean_base_leaves_deltas_that_sum_to_zero(trained):
    dec = decompose(trained["pure"], "mean", extended=trained["extended"])
    for i in (0, 1):
        for d in dec.deltas[i].values():
            np.testing.assert_allclose(d.sum(0), 0.0, atol=1e-6)
            assert np.abs(d).max() > 1e-4
    _close(recompose(dec), trained["pure"], rtol=1e-6, atol=1e-6)


def test_compression_report_counts_bytes_in_the_models_dtype(trained):
    half = jax.tree.map(lambda a: np.asarray(a, np.float16), trained["pure"])
    base16 = jax.tree.map(lambda a: np.asarray(a, np.float16), trained["base"])
    dec = decompose(half, base16, extended=trained["extended"])
    r = compression_report(compress(dec, "quant", bits=3))
    n = N + int(trained["extended"])
    base = 2 * 3 * D * F
    rest = sum(np.size(a) for a in jax.tree.leaves(dec.rest))
    assert r["base"] == base and r["rest_params"] == rest
    assert r["vanilla_expert_bytes"] == n * base * 2  # float16: 2 bytes a parameter
    assert r["expert_bytes"] == base * 2 + r["delta_bytes"]
    assert r["rest_bytes"] == rest * 2
    assert r["total_bytes"] == rest * 2 + base * 2 + r["delta_bytes"]
