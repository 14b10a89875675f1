"""Loaders from the array_record datasets (small slices): LM, classification, images, chat, BPE."""

import numpy as np
import pytest

from moejax.data import datasets, loader
from moejax.data.builders_text import LM_SPLITS
from moejax.data.corpora import corpus_bytes, corpus_texts, corpus_tokens
from moejax.data.raw_files import split_of
from moejax.data.stdlib_corpus import stdlib_files, stdlib_root
from moejax.data.token_cache import _load, tokenized_docs
from moejax.data.tokenizer import BpeTokenizer, ByteTokenizer

N = 6


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


def test_byte_lm_batches_reproduce_the_documents(data_dir):
    tok = ByteTokenizer()
    kw = dict(data_dir=data_dir, max_examples_per_split=N)
    src = loader.lm_batches("stdlib_code", "validation", tok, seq_len=64, batch_size=4, **kw)
    texts = loader.read_texts("stdlib_code", "validation", **kw)
    assert len(texts) == N
    # unshuffled (validation): rows in order; concatenating rows gives back the documents
    rows = np.concatenate([src.batch(p)["inputs"] for p in range(src.rows.num_rows // 4)])
    stream = rows.reshape(-1)
    decoded = tok.decode(stream)
    assert decoded.startswith(texts[0][:200])
    b = src.batch(0)
    assert b["inputs"].shape == (4, 64) and b["mask"].dtype == np.float32
    np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
    train = loader.lm_batches("stdlib_code", "train", tok, seq_len=64, batch_size=4, seed=1, **kw)
    again = loader.lm_batches("stdlib_code", "train", tok, seq_len=64, batch_size=4, seed=1, **kw)
    np.testing.assert_array_equal(train.batch(9)["inputs"], again.batch(9)["inputs"])
    assert train.fingerprint == again.fingerprint != src.fingerprint


def test_bpe_for_is_cached_and_used_for_lm(data_dir):
    kw = dict(data_dir=data_dir, max_examples_per_split=N)
    tok = loader.bpe_for("prose/pydoc", 300, **kw)
    cached = list(data_dir.rglob("prose-pydoc-bpe300/tokenizer.json"))
    assert len(cached) == 1
    assert loader.bpe_for("prose/pydoc", 300, **kw).fingerprint == tok.fingerprint
    src = loader.lm_batches("prose/pydoc", "test", tok, seq_len=32, batch_size=2, **kw)
    assert src.batch(0)["inputs"].max() < 300


def test_a_damaged_cached_bpe_is_set_aside_and_trained_again(data_dir, caplog):
    kw = dict(data_dir=data_dir, max_examples_per_split=N)
    tok = loader.bpe_for("prose/kjv", 280, **kw)
    (path,) = data_dir.rglob("prose-kjv-bpe280/tokenizer.json")
    good = path.read_text()
    path.write_text(good[: len(good) // 2])  # a torn copy
    with pytest.raises(ValueError, match=f"tokenizer file {path} cannot be read"):
        BpeTokenizer.load(path)
    again = loader.bpe_for("prose/kjv", 280, **kw)
    assert again.fingerprint == tok.fingerprint and path.read_text() == good
    (aside,) = path.parent.glob("tokenizer.json.corrupt-*")
    assert aside.read_text() == good[: len(good) // 2]
    assert "moved to" in caplog.text


def test_wordnet_classification(data_dir):
    tok = ByteTokenizer()
    kw = dict(data_dir=data_dir, max_examples_per_split=N)
    for task, k in (("pos", 4), ("lexname", 45)):
        src = loader.classification_batches("train", tok, task=task, seq_len=32, batch_size=3, **kw)
        assert len(src) == N and src.num_classes == k
        b = src.batch(1)
        assert b["inputs"].shape == (3, 32) and (b["inputs"][:, 0] == tok.bos_id).all()
        assert ((0 <= b["labels"]) & (b["labels"] < k)).all()
        assert (b["mask"].sum(1) > 1).all()
    glosses = [
        datasets.decode_text(e["gloss"])
        for e in datasets.load_split("wordnet_glosses", "test", **kw)
    ]
    src = loader.classification_batches("test", tok, task="pos", seq_len=32, batch_size=2, **kw)
    assert tok.decode(src.batch(0)["inputs"][0]) == glosses[0].encode()[:31].decode(
        "utf-8", "replace"
    )


def test_image_batches(data_dir):
    src = loader.image_batches(
        "digits", "train", batch_size=4, data_dir=data_dir, max_examples_per_split=N
    )
    b = src.batch(0)
    assert b["inputs"].shape == (4, 8, 8) and b["inputs"].dtype == np.float32
    assert 0.0 <= b["inputs"].min() and b["inputs"].max() <= 1.0 and b["labels"].dtype == np.int32
    with pytest.raises(ValueError, match="image datasets"):
        loader.image_batches("chitchat", "train", batch_size=2)


def test_chat_batches(data_dir):
    tok = ByteTokenizer()
    kw = dict(data_dir=data_dir, max_examples_per_split=N)
    src = loader.chat_batches("validation", tok, seq_len=128, batch_size=2, **kw)
    ex = datasets.load_split("chitchat", "validation", **kw)[0]
    b = src.batch(0)
    row, mask = b["targets"][0], b["mask"][0]
    response = datasets.decode_text(ex["response"]).encode()[:124].decode("utf-8", "replace")
    assert tok.decode(row[mask > 0]) == response
    assert row[mask > 0][-1] == tok.eos_id or len(ex["response"]) >= 124
    ctx = loader.chat_batches(
        "validation", tok, seq_len=128, batch_size=2, prompt_field="context", **kw
    )
    assert ctx.fingerprint != src.fingerprint


def test_bpe_token_cache_round_trip(data_dir):
    kw = dict(data_dir=data_dir, max_examples_per_split=N)
    tok = loader.bpe_for("prose/kjv", 300, **kw)
    first = tokenized_docs("prose/kjv", "train", tok, "text", **kw)
    files = list(data_dir.rglob("tokens/prose-kjv-*-train-text-bpe-*.npz"))
    assert len(files) == 1 and not list(data_dir.rglob("tokens/.*.tmp"))
    again = tokenized_docs("prose/kjv", "train", tok, "text", **kw)
    assert [d.tolist() for d in again] == [d.tolist() for d in first]
    texts = loader.read_texts("prose/kjv", "train", **kw)
    assert [tok.decode(d) for d in again] == texts
    tokenized_docs("prose/kjv", "train", ByteTokenizer(), "text", **kw)  # bytes: never cached
    assert len(list(data_dir.rglob("tokens/prose-kjv-*.npz"))) == 1
    # a corrupt cache (bit flip, truncation) is detected and rebuilt, never used
    raw = files[0].read_bytes()
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x01
    for damaged in (bytes(flipped), raw[: len(raw) // 2]):
        files[0].write_bytes(damaged)
        rebuilt = tokenized_docs("prose/kjv", "train", tok, "text", **kw)
        assert [d.tolist() for d in rebuilt] == [d.tolist() for d in first]
        assert _load(files[0]) is not None  # rewritten whole: it verifies again


def test_chitchat_corpus_is_each_context_then_its_response():
    examples = datasets.load_split("chitchat", "validation")
    texts = corpus_texts("chitchat", "validation")
    assert len(texts) == len(examples)
    for i in (0, 7, len(examples) - 1):
        ex = examples[i]
        assert texts[i] == (datasets.decode_text(ex["context"]) + "\n"
                            + datasets.decode_text(ex["response"]))
    tok = ByteTokenizer()
    stream = corpus_tokens("chitchat", "validation")  # documents joined by eos
    assert int((stream == tok.eos_id).sum()) == len(texts)
    assert tok.decode(stream[: len(texts[0].encode())]) == texts[0]


def test_a_byte_budget_is_a_count_of_leading_bytes_in_every_corpus():
    # 0 read the whole of a TFDS corpus but nothing of the standard library's, and a negative
    # budget cut the end off: every corpus takes the same budget now, or refuses it

    for name in ("chitchat", "stdlib_code"):
        whole = corpus_bytes(name, "validation")
        np.testing.assert_array_equal(corpus_bytes(name, "validation", 100), whole[:100])
        for bad in (0, -5, 2.5, True):
            with pytest.raises(ValueError, match="max_bytes"):
                corpus_bytes(name, "validation", bad)


def test_the_standard_librarys_bytes_and_its_tfds_stream_split_the_same_files():
    # a model trained on the TFDS stream's train split and scored on the bytes read directly
    # (or the other way round) must never be scored on files it trained on: both paths put
    # each file in the split the builder's hash gives it

    root = stdlib_root()
    files = {s: [p for p in stdlib_files(root) if split_of(str(p.relative_to(root)), LM_SPLITS)
                 == s] for s in LM_SPLITS}
    for split in ("validation", "test"):
        assert files[split], split
        expect = b"".join(p.read_bytes() + b"\0" for p in files[split])
        assert bytes(corpus_bytes("stdlib_code", split)) == expect, split
    assert len(corpus_bytes("stdlib_code", "train", 10_000)) == 10_000
    with pytest.raises(ValueError, match="'train', 'validation', 'test'"):
        corpus_bytes("stdlib_code", "dev")
