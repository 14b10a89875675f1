"""Activation-sparsity metrics of MoE layers, streamed over a validation set (numpy, host side).

Input per layer and batch: ``active_BTE`` (bool, expert e active for token t: ``A[t, e] != 0``
for ReLU routers, the selected / shared experts for top-k MoEs), optional ``mask_BT`` (real
tokens), ``segment_ids_BT`` (documents), ``a_BTE`` (activation values) and ``tokens_BT``.
Runs (maximal stretches of real tokens of one document) bound every multi-token quantity, as
in :mod:`moejax.ops.chunk_sparsity`.

* TLS (token-level sparsity) = mean over real tokens of ``1 - |S_t| / E``, ``S_t`` = active set.
* CLS_L = mean over chunks ``c`` of ``1 - |union_{t in c} S_t| / E``; chunks are ``L``
  consecutive tokens of a run aligned at the run start; a shorter tail chunk is not counted
  (CLS_1 = TLS).
* reuse ratio = mean over neighbouring pairs ``(t, t+1)`` of one run with ``|S_t| > 0`` of
  ``|S_t ∩ S_{t+1}| / |S_t|`` (BlockFFN Section 4.1.2).
* activation magnitude = mean over real tokens of ``||A_t||_2``.
* allocation = per token id: frequency and mean active fraction ``|S_t| / E`` (Fig. 3).

Each ``*_counts`` function returns ``(numerator, denominator)`` so batches add up exactly;
:class:`SparsityAccumulator` keeps the sums per layer.
"""

from __future__ import annotations

import numbers
from collections import defaultdict

import numpy as np

from moejax.ops.losses import check_mask

__all__ = [
    "CHUNK_LENS",
    "chunk_groups",
    "tls_counts",
    "cls_counts",
    "reuse_counts",
    "magnitude_counts",
    "SparsityAccumulator",
]

CHUNK_LENS = (1, 2, 4, 8, 16, 32, 64)


def _real(mask_BT, shape):
    check_mask("mask_BT", mask_BT, shape, "a real-token mask")
    return np.ones(shape, bool) if mask_BT is None else np.asarray(mask_BT).astype(bool)


def _same_as_prev(segment_ids_BT, shape):
    check_mask("segment_ids_BT", segment_ids_BT, shape, "segment ids")
    same = np.ones(shape, bool)
    if segment_ids_BT is not None:
        s = np.asarray(segment_ids_BT)
        same[:, 1:] = s[:, 1:] == s[:, :-1]
    same[:, 0] = False
    return same


def chunk_groups(shape, chunk_len: int, mask_BT=None, segment_ids_BT=None):
    """Chunk id per token (``[B, T]`` int, -1 on padding) and the size of each chunk."""
    B, T = shape
    real = _real(mask_BT, shape)
    prev_real = np.zeros(shape, bool)
    prev_real[:, 1:] = real[:, :-1]
    start = real & ~(prev_real & _same_as_prev(segment_ids_BT, shape))
    t = np.broadcast_to(np.arange(T), shape)
    last = np.maximum.accumulate(np.where(start, t, -1), axis=1)
    cstart = real & ((t - last) % chunk_len == 0)
    gid = np.cumsum(cstart.reshape(-1)) - 1
    gid = np.where(real.reshape(-1), gid, -1).reshape(shape)
    n = int(cstart.sum())
    sizes = np.bincount(gid[gid >= 0], minlength=n) if n else np.zeros(0, int)
    return gid, sizes


def tls_counts(active_BTE, mask_BT=None):
    """``(sum over real tokens of inactive fraction, number of real tokens)``."""
    act = np.asarray(active_BTE).astype(bool)
    real = _real(mask_BT, act.shape[:2])
    frac_inactive = 1.0 - act.mean(-1)
    return float(frac_inactive[real].sum()), float(real.sum())


def cls_counts(active_BTE, chunk_len: int, mask_BT=None, segment_ids_BT=None):
    """``(sum over full chunks of the all-inactive fraction, number of full chunks)``."""
    act = np.asarray(active_BTE).astype(bool)
    B, T, E = act.shape
    gid, sizes = chunk_groups((B, T), chunk_len, mask_BT, segment_ids_BT)
    if sizes.size == 0:
        return 0.0, 0.0
    flat = gid.reshape(-1)
    sel = flat >= 0
    union = np.zeros((sizes.size, E), bool)
    np.logical_or.at(union, flat[sel], act.reshape(-1, E)[sel])
    full = sizes == chunk_len
    return float((1.0 - union[full].mean(-1)).sum()), float(full.sum())


def reuse_counts(active_BTE, mask_BT=None, segment_ids_BT=None):
    """``(sum of |S_t ∩ S_t+1| / |S_t| over valid pairs with |S_t| > 0, number of them)``."""
    act = np.asarray(active_BTE).astype(bool)
    B, T, E = act.shape
    real = _real(mask_BT, (B, T))
    valid = real[:, :-1] & real[:, 1:] & _same_as_prev(segment_ids_BT, (B, T))[:, 1:]
    n_cur = act[:, :-1].sum(-1)
    inter = (act[:, :-1] & act[:, 1:]).sum(-1)
    ok = valid & (n_cur > 0)
    return float((inter[ok] / n_cur[ok]).sum()), float(ok.sum())


def magnitude_counts(a_BTE, mask_BT=None):
    """``(sum over real tokens of ||A_t||_2, number of real tokens)``."""
    a = np.asarray(a_BTE, np.float64)
    real = _real(mask_BT, a.shape[:2])
    return float(np.linalg.norm(a, axis=-1)[real].sum()), float(real.sum())


def _ratio(nd):
    return nd[0] / nd[1] if nd[1] > 0 else float("nan")


def _nanmean(values) -> float:
    """The mean of the values that are not NaN; NaN (without numpy's empty-slice warning)
    when none is: a metric no layer could measure."""
    kept = [v for v in values if not np.isnan(v)]
    return float(np.mean(kept)) if kept else float("nan")


class SparsityAccumulator:
    """Streaming per-layer sums of every metric above.

    ``acc.update(layer, active_BTE, mask_BT=..., segment_ids_BT=..., a_BTE=..., tokens_BT=...)``
    per layer and batch, then ``acc.result()`` -> ``{"layers": {layer: {...}}, "mean": {...}}``
    with keys ``tls``, ``cls_{L}``, ``reuse``, ``magnitude`` (layer means are unweighted over
    layers), and ``acc.allocation()`` -> ``(token_ids, counts, mean_active_fraction)``.
    """

    def __init__(self, chunk_lens=CHUNK_LENS):
        self.chunk_lens = tuple(chunk_lens)
        bad = [L for L in self.chunk_lens
               if not isinstance(L, numbers.Integral) or isinstance(L, bool) or L < 1]
        if bad:
            raise ValueError(f"SparsityAccumulator: chunk_lens={self.chunk_lens}; give integer "
                             "chunk lengths >= 1 (CLS of a chunk of 0 tokens is 0/0)")
        self.sums = defaultdict(lambda: defaultdict(lambda: np.zeros(2)))
        self.tok_count: dict[int, float] = defaultdict(float)
        self.tok_frac: dict[int, float] = defaultdict(float)

    def update(self, layer, active_BTE, *, mask_BT=None, segment_ids_BT=None, a_BTE=None,
               tokens_BT=None) -> None:
        act = np.asarray(active_BTE).astype(bool)
        if act.ndim != 3 or not act.shape[-1]:
            raise ValueError(f"active_BTE of shape {act.shape}; give [batch, tokens, experts] "
                             "with at least one expert")
        check_mask("SparsityAccumulator.update", a_BTE, act.shape,
                   "activation values (a_BTE)")  # [B, E, T] or [B, T, E'] measured other norms
        check_mask("SparsityAccumulator.update", tokens_BT, act.shape[:2], "token ids")
        if tokens_BT is not None and not np.issubdtype(np.asarray(tokens_BT).dtype, np.integer):
            raise ValueError(f"tokens_BT of dtype {np.asarray(tokens_BT).dtype}; give integer "
                             "token ids (a float would be truncated to another token)")
        s = self.sums[layer]
        s["tls"] += tls_counts(act, mask_BT)
        for L in self.chunk_lens:
            s[f"cls_{L}"] += cls_counts(act, L, mask_BT, segment_ids_BT)
        s["reuse"] += reuse_counts(act, mask_BT, segment_ids_BT)
        if a_BTE is not None:
            s["magnitude"] += magnitude_counts(a_BTE, mask_BT)
        if tokens_BT is not None:
            real = _real(mask_BT, act.shape[:2])
            tok = np.asarray(tokens_BT)[real]
            frac = act.mean(-1)[real]
            ids, inv = np.unique(tok, return_inverse=True)
            cnt = np.bincount(inv, minlength=ids.size)
            fs = np.bincount(inv, weights=frac, minlength=ids.size)
            for i, c, f in zip(ids.tolist(), cnt.tolist(), fs.tolist()):
                self.tok_count[i] += c
                self.tok_frac[i] += f

    def result(self) -> dict:
        layers = {i: {k: _ratio(v) for k, v in s.items()} for i, s in self.sums.items()}
        keys = sorted({k for d in layers.values() for k in d})
        mean = {k: _nanmean([d[k] for d in layers.values() if k in d]) for k in keys}
        return {"layers": layers, "mean": mean}

    def allocation(self):
        """Per token id (averaged over the updates of all layers): ids, counts, mean active
        fraction. Counts are per layer update, so divide by the number of layers for tokens."""
        ids = np.array(sorted(self.tok_count), np.int64)
        counts = np.array([self.tok_count[i] for i in ids])
        frac = np.array([self.tok_frac[i] for i in ids]) / np.maximum(counts, 1)
        return ids, counts, frac
