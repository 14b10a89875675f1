"""Random-access language-model batches from a flat token array.

``WindowBatches(tokens, batch_size, seq_len, seed)``: batch ``i`` holds ``batch_size`` windows of
``seq_len + 1`` tokens at offsets drawn from ``PRNG(seed, i)``; returns ``inputs``/``targets``
(shifted by one) and an all-ones ``mask``. Deterministic per position, so resume is exact.
"""

from __future__ import annotations

import functools

import numpy as np

from moejax.data.source import check_source_settings, stream_fingerprint

__all__ = ["WindowBatches"]


class WindowBatches:
    def __init__(self, tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int = 0):
        tokens = np.asarray(tokens)
        check_source_settings(batch_size=batch_size, seed=seed, seq_len=seq_len)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens of shape {tokens.shape} and dtype {tokens.dtype}; give a "
                             "1-D array of integer token ids (a float would be truncated)")
        if tokens.shape[0] < seq_len + 2:
            raise ValueError(
                f"corpus of {tokens.shape[0]} tokens cannot give windows of seq_len + 1 = "
                f"{seq_len + 1} tokens at random offsets: that takes at least seq_len + 2 = "
                f"{seq_len + 2}; give a longer corpus or a shorter seq_len"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed

    @functools.cached_property
    def fingerprint(self) -> str:
        """The stream's identity, stored with each checkpoint (a resumed run must match it)."""
        return stream_fingerprint("WindowBatches", {"tokens": self.tokens},
                                  batch=self.batch_size, seq_len=self.seq_len, seed=self.seed)

    def batch(self, position: int) -> dict[str, np.ndarray]:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        rng = np.random.default_rng([self.seed, position])
        hi = self.tokens.shape[0] - self.seq_len - 1
        starts = rng.integers(0, hi, size=self.batch_size)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        win = self.tokens[idx].astype(np.int32)
        return {
            "inputs": win[:, :-1],
            "targets": win[:, 1:],
            "mask": np.ones((self.batch_size, self.seq_len), np.float32),
        }
