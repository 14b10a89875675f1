"""Tokenizers: byte-level and BPE round-trips, special ids, deterministic BPE training."""

import numpy as np
import pytest

from moejax.data.stdlib_corpus import stdlib_files
from moejax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, BpeTokenizer, ByteTokenizer, train_bpe

TEXTS = ["hello world", "naïve café — ünïcödé ✓ 日本語", "def f(x):\n    return x  # tab\t", ""]


def _corpus(n=40):
    return [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files()[:n]]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 259 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    for t in TEXTS:
        ids = tok.encode(t)
        assert ids.dtype == np.int32 and len(ids) == len(t.encode("utf-8"))
        assert ids.min(initial=3) >= 3 and ids.max(initial=0) < 259
        assert tok.decode(ids) == t
    assert tok.decode([BOS_ID, *tok.encode("ab"), EOS_ID, PAD_ID]) == "ab"
    assert tok.decode([]) == ""
    with pytest.raises(ValueError, match="dtype float64"):  # was decoded as "ab"
        tok.decode(tok.encode("ab") + 0.7)
    with pytest.raises(ValueError, match="no texts"):  # was max()'s "iterable argument is empty"
        tok.encode_padded([])
    tokens, mask = tok.encode_padded(["abc", "d"], max_len=2)
    assert tokens.tolist() == [[100, 101], [103, 0]] and mask.tolist() == [[1, 1], [1, 0]]
    for bad in (0, -1, 2.5, True):  # -1 cut the last byte, 0 gave rows of padding alone
        with pytest.raises(ValueError, match="max_len"):
            tok.encode_padded(["abc"], max_len=bad)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return train_bpe(_corpus(), 600, path=path), path


def test_bpe_round_trip_and_specials(bpe):
    tok, path = bpe
    assert tok.vocab_size == 600
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (PAD_ID, BOS_ID, EOS_ID)
    for t in TEXTS + _corpus(3):
        ids = tok.encode(t)
        assert ids.dtype == np.int32 and tok.decode(ids) == t
        assert not np.isin(ids, [PAD_ID, BOS_ID, EOS_ID]).any()
    code = _corpus(1)[0]
    assert len(tok.encode(code)) < 0.6 * len(code.encode())  # it actually merges
    assert [list(x) for x in tok.encode_batch(TEXTS)] == [list(tok.encode(t)) for t in TEXTS]


def test_bpe_save_load_and_deterministic(bpe, tmp_path):
    tok, path = bpe
    loaded = BpeTokenizer.load(path)
    assert loaded.fingerprint == tok.fingerprint
    assert list(loaded.encode(TEXTS[1])) == list(tok.encode(TEXTS[1]))
    again = train_bpe(_corpus(), 600, path=tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert again.fingerprint == tok.fingerprint


def test_bpe_errors(tmp_path):
    with pytest.raises(ValueError, match="259"):
        train_bpe(["abc"], 100)
    with pytest.raises(FileNotFoundError, match="train_bpe"):
        BpeTokenizer.load(tmp_path / "missing.json")
