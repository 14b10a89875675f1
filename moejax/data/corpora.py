"""The text corpora the language-model studies read, by name, as one flat array per split.

* ``corpus_bytes(name, split, max_bytes=None)``: UTF-8 bytes (uint8), documents separated by a
  NUL byte, for a vocabulary of the 256 raw bytes;
* ``corpus_tokens(name, split, tokenizer=None)``: int32 ids; without a tokenizer
  :class:`~moejax.data.tokenizer.ByteTokenizer` ids with ``eos`` between documents (vocabulary
  259), otherwise ``tokenizer.encode`` of the whole text (e.g. SmolLM2's BPE).

Names (``CORPORA``): ``stdlib_code`` (the CPython standard library source), the TFDS text
datasets ``prose/pydoc`` (Python documentation sources) and ``prose/kjv`` (King James Bible),
and ``chitchat`` (the chit-chat dialogues: each example's context, a newline, its response).
Splits are per document (stable hashes, :data:`moejax.data.raw_files.LM_SPLITS`: train,
validation and test). ``corpus_bytes("stdlib_code", ...)`` reads the installed ``.py`` files
directly (:func:`~moejax.data.stdlib_corpus.load_stdlib_bytes`, no TFDS build needed), while
its token stream comes from the TFDS builder like every other corpus's; both put each file in
the same split. Missing data raises
``MissingDataError`` naming the install command. Windows over these arrays are
:class:`moejax.data.lm_batches.WindowBatches`, a batch source as defined in
:mod:`moejax.data.source`.
"""

from __future__ import annotations

import functools

import numpy as np

from moejax.data import datasets
from moejax.data.lm_batches import WindowBatches
from moejax.data.stdlib_corpus import check_max_bytes, load_stdlib_bytes
from moejax.data.tokenizer import ByteTokenizer

__all__ = ["CORPORA", "corpus_bytes", "corpus_tokens", "corpus_texts", "corpus_windows",
           "document_tokens"]

CORPORA = ("stdlib_code", "prose/pydoc", "prose/kjv", "chitchat")


def _check(name: str) -> None:
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; available: {', '.join(CORPORA)}")


@functools.lru_cache(maxsize=8)
def corpus_texts(name: str, split: str) -> tuple[str, ...]:
    """The documents of a corpus from its TFDS builder."""
    _check(name)
    if name == "chitchat":
        return tuple(datasets.decode_text(ex["context"]) + "\n"
                     + datasets.decode_text(ex["response"])
                     for ex in datasets.load_split(name, split))
    return tuple(datasets.decode_text(ex["text"]) for ex in datasets.load_split(name, split))


def corpus_bytes(name: str, split: str, max_bytes: int | None = None) -> np.ndarray:
    """UTF-8 bytes of ``name``/``split`` (NUL between documents), cut to ``max_bytes``
    (``None``: all)."""
    _check(name)
    check_max_bytes(max_bytes)
    if name == "stdlib_code":
        return load_stdlib_bytes(split, max_bytes=max_bytes)
    data = b"".join(t.encode("utf-8") + b"\0" for t in corpus_texts(name, split))
    return np.frombuffer(data if max_bytes is None else data[:max_bytes], np.uint8)


@functools.lru_cache(maxsize=8)
def _byte_token_stream(name: str, split: str) -> np.ndarray:
    tok = ByteTokenizer()
    docs = corpus_texts(name, split)
    eos = np.asarray([tok.eos_id], np.int32)
    out = np.concatenate([p for d in docs for p in (tok.encode(d), eos)]).astype(np.int32)
    out.flags.writeable = False  # cached and shared
    return out


def document_tokens(name: str, split: str, tokenizer) -> tuple[np.ndarray, int]:
    """``(ids, n_bytes)``: the documents of the byte stream (:func:`corpus_texts`) in
    ``tokenizer``'s ids, each followed by its ``eos_id`` where it has one, and the bytes they
    cover (UTF-8, plus one per document end). A loss summed over ``ids`` and divided by
    ``n_bytes`` compares models of different tokenizers on one text; with
    :class:`~moejax.data.tokenizer.ByteTokenizer` the ids are the byte stream itself and
    ``n_bytes == len(ids)``."""
    docs = corpus_texts(name, split)
    eos = [] if getattr(tokenizer, "eos_id", None) is None else [tokenizer.eos_id]
    ids = np.concatenate([np.concatenate([np.asarray(t, np.int32), np.asarray(eos, np.int32)])
                          for t in tokenizer.encode_batch(list(docs))] or [np.zeros(0, np.int32)])
    return ids.astype(np.int32), sum(len(d.encode("utf-8")) + 1 for d in docs)


def corpus_tokens(name: str, split: str, tokenizer=None, max_bytes: int | None = None):
    """Token ids of ``name``/``split`` (see the module docstring)."""
    _check(name)
    if tokenizer is None and max_bytes is None:
        return _byte_token_stream(name, split)
    raw = corpus_bytes(name, split, max_bytes)
    text = bytes(raw).replace(b"\0", b"\n\n").decode("utf-8", "replace")
    tok = tokenizer or ByteTokenizer()
    return np.asarray(tok.encode(text), np.int32)


def corpus_windows(name: str, split: str, *, batch_size: int, seq_len: int, seed: int,
                   tokenizer=None, max_bytes: int | None = None):
    """:class:`~moejax.data.lm_batches.WindowBatches` over :func:`corpus_tokens` (random
    windows of ``seq_len + 1`` tokens, deterministic per batch position)."""
    return WindowBatches(corpus_tokens(name, split, tokenizer, max_bytes),
                         batch_size=batch_size, seq_len=seq_len, seed=seed)
