"""Tokenizers: byte-level (tiny models) and byte-level BPE trained offline with ``tokenizers``.

Both share one interface (``encode``, ``encode_batch``, ``decode``, ``vocab_size``) and the same
special ids: ``pad = 0``, ``bos = 1``, ``eos = 2``. ``encode`` never adds specials; packing adds
``bos``/``eos`` around documents.

* :class:`ByteTokenizer`: id = byte + 3, vocabulary 259. Lossless for any UTF-8 text.
* :class:`BpeTokenizer`: byte-level BPE (GPT-2 style pre-tokenisation, so any text round-trips),
  trained by :func:`train_bpe` on an iterable of texts to a given vocabulary size and saved as a
  single ``tokenizer.json``. Training is deterministic for a fixed corpus order (checked by the
  tests: the same corpus gives a byte-identical ``tokenizer.json``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from moejax.config import check_count
from moejax.data.batches import pad_token_rows
from moejax.extras import require
from moejax.files import atomic_write_text

__all__ = [
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "SPECIAL_TOKENS",
    "ByteTokenizer",
    "BpeTokenizer",
    "train_bpe",
]

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]


class ByteTokenizer:
    """UTF-8 bytes shifted by 3 (ids 0..2 are pad/bos/eos); vocabulary size 259."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
    offset = 3
    vocab_size = 256 + offset

    @property
    def fingerprint(self) -> str:
        """Identifies the tokenizer in caches and checkpoints."""
        return "bytes-v1"

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32) of ``text``, without specials."""
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return raw.astype(np.int32) + self.offset

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_padded(self, texts: Sequence[str], max_len: int | None = None):
        """``(tokens_BT int32, mask_BT bool)`` right-padded with ``pad_id`` to the longest
        text (or truncated to ``max_len``); the same contract as the HF tokenizer's."""

        if not len(texts):
            raise ValueError("encode_padded: no texts; give at least one")
        if max_len is not None:
            check_count("encode_padded: max_len", max_len, 1)
        ids = [x[:max_len] if max_len is not None else x for x in self.encode_batch(texts)]
        tokens, mask = pad_token_rows(ids, max(1, max(len(x) for x in ids)),
                                      pad_id=self.pad_id)
        return tokens, mask > 0

    def decode(self, ids) -> str:
        """Text of ``ids``; special ids are dropped, invalid UTF-8 is replaced; an id outside
        the vocabulary ``[0, 259)`` or a float id raises ``ValueError``."""
        ids = np.asarray(ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"ByteTokenizer.decode: ids of dtype {ids.dtype}; give integer "
                             "token ids (a float would be truncated to another token)")
        ids = ids.astype(np.int64)
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"ByteTokenizer.decode: id {int(bad[0])} is outside the "
                             f"vocabulary [0, {self.vocab_size}) ({bad.size} such ids); were "
                             "these ids produced by another tokenizer or a model with a "
                             "larger vocab_size?")
        ids = ids[ids >= self.offset] - self.offset
        return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")


class BpeTokenizer:
    """A trained byte-level BPE ``tokenizers.Tokenizer`` with the moejax special ids."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

    def __init__(self, tokenizer):
        for i, tok in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(tok) != i:
                raise ValueError(
                    f"tokenizer has {tok!r} at id {tokenizer.token_to_id(tok)}, expected {i}; "
                    "train it with moejax.data.tokenizers.train_bpe"
                )
        self._tok = tokenizer

    @classmethod
    def load(cls, path: str | os.PathLike) -> BpeTokenizer:
        """Load a ``tokenizer.json`` written by :meth:`save`."""
        # tokenizers (the io extra) on use: the byte tokenizer does not need it
        Tokenizer = require("tokenizers", "moejax.data.tokenizer (BPE)").Tokenizer  # noqa: N806

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"tokenizer file {path} not found; train it with "
                "moejax.data.tokenizers.train_bpe(texts, vocab_size, path=...)"
            )
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"tokenizer file {path} cannot be read ({e}); fix: delete it and "
                             "train it again (moejax.data.loader.bpe_for does so itself)"
                             ) from None
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def fingerprint(self) -> str:
        """sha256 prefix of the serialised tokenizer: identifies it in caches and checkpoints."""
        return "bpe-" + hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return self._tok.to_str()

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` atomically (temp file in the same directory, then rename)."""
        return atomic_write_text(path, self.to_json())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    path: str | os.PathLike | None = None,
    min_frequency: int = 2,
) -> BpeTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``texts`` (in the given order).

    The vocabulary always holds the 3 specials and the 256 byte symbols, so ``vocab_size`` must be
    at least 259. If ``path`` is given the tokenizer is saved there as ``tokenizer.json``.
    """
    tk = require("tokenizers", "moejax.data.tokenizer (BPE training)")
    Tokenizer, decoders, models, pre_tokenizers, trainers = (  # noqa: N806
        tk.Tokenizer, tk.decoders, tk.models, tk.pre_tokenizers, tk.trainers)

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below the 259 specials + byte symbols")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = BpeTokenizer(tok)
    if path is not None:
        out.save(path)
    return out
