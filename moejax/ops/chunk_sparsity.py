"""BlockFFN sparsity objectives (pure functions on router tensors; no model code).

Router tensors of a ReLU-routed MoE layer (``E`` experts, ``[B, T, E]`` layout):
``A0 = x W_router`` (pre-activation), ``A1 = ReLU(A0)`` (activation pattern),
``A = RMSNorm(A1)`` (combine weights).

Boundaries. ``mask_BT`` (bool, real tokens) and ``segment_ids_BT`` (int, document id of each
token, e.g. from :mod:`moejax.data.packing`) split every row into *runs*: maximal stretches of
consecutive real tokens of one document. Nothing couples tokens of two different runs.

* :func:`activation_locality_loss` (BlockFFN paper, Sec. 3.2, Eq. 4)::

      L_al = mean_{(t, t+1) valid, e} BCE(sigmoid(alpha A0[t, e]), target=sigmoid(alpha A0[t+1, e]))
      BCE(p, q) = -(q log p + (1 - q) log(1 - p))

  over neighbouring pairs inside one run (LeftShift along the sequence). Logs use
  ``log_sigmoid`` so large ``alpha`` (official 100) is safe. Both sides carry gradient.

* :func:`chunk_sparsification_loss` (BlockFFN paper, Sec. 3.2, Eq. 5)::

      p[t, e] = A1[t, e] / sum_e' A1[t, e']            (0 for a token with no active expert)
      P_act[c, e] = 1 - exp(sum_{t in c} ln(1 - p[t, e]))
      L_cs = mean_{c, e} P_act[c, e]

  chunks ``c`` are ``chunk_len`` consecutive tokens of one run, aligned at the run start (a
  run's last chunk may be shorter); ``ln(1 - p)`` uses ``log1p(-min(p, 1 - eps))``.

* :func:`l1_activation_loss`: ``mean_t sum_e |A[t, e]|`` (ReMoE / "AL+L1" ablation).
* :func:`router_entropy_loss`: ``mean_t -sum_e p[t, e] ln p[t, e]`` over tokens with at least
  one active expert (``p`` as above; "AL+Ent" ablation).

All losses are float32 scalars; means are over real tokens only (0 when there are none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.ops.losses import check_mask

__all__ = [
    "run_starts",
    "chunk_starts",
    "pair_valid",
    "activation_locality_loss",
    "normalize_over_experts",
    "chunk_sparsification_loss",
    "l1_activation_loss",
    "load_balanced_l1_loss",
    "router_entropy_loss",
]


def _real(mask_BT, shape):
    check_mask("mask_BT", mask_BT, shape, "a real-token mask")
    return jnp.ones(shape, bool) if mask_BT is None else mask_BT.astype(bool)


def _same_as_prev(segment_ids_BT, shape):
    """``[B, T]`` bool: token t has the same segment id as token t-1 (False at t=0)."""
    check_mask("segment_ids_BT", segment_ids_BT, shape, "segment ids")
    if segment_ids_BT is None:
        same = jnp.ones(shape, bool)
    else:
        s = segment_ids_BT
        same = jnp.concatenate([s[:, :1], s[:, :-1]], 1) == s
    return same.at[:, 0].set(False)


def run_starts(mask_BT, segment_ids_BT, shape) -> jax.Array:
    """``[B, T]`` bool: the token starts a run (real, and the previous token is padding, of
    another document, or absent)."""
    real = _real(mask_BT, shape)
    prev_real = jnp.concatenate([jnp.zeros_like(real[:, :1]), real[:, :-1]], 1)
    return real & ~(prev_real & _same_as_prev(segment_ids_BT, shape))


def chunk_starts(mask_BT, segment_ids_BT, shape, chunk_len: int) -> jax.Array:
    """``[B, T]`` bool: the token starts a chunk (every ``chunk_len``-th token of a run)."""
    if chunk_len < 1:
        raise ValueError(f"chunk_len={chunk_len} must be >= 1")
    B, T = shape
    t_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    start = run_starts(mask_BT, segment_ids_BT, shape)
    last_start = jax.lax.cummax(jnp.where(start, t_BT, -1), axis=1)
    pos_in_run = t_BT - last_start
    return _real(mask_BT, shape) & (pos_in_run % chunk_len == 0)


def pair_valid(mask_BT, segment_ids_BT, shape) -> jax.Array:
    """``[B, T-1]`` bool: tokens t and t+1 are both real and in the same document."""
    real = _real(mask_BT, shape)
    same_next = _same_as_prev(segment_ids_BT, shape)[:, 1:]
    return real[:, :-1] & real[:, 1:] & same_next


def activation_locality_loss(a0_BTE, *, alpha: float = 100.0, mask_BT=None,
                             segment_ids_BT=None) -> jax.Array:
    """BlockFFN Eq. 4 (see module docstring). ``a0_BTE``: pre-ReLU router scores."""
    B, T, E = a0_BTE.shape
    z = alpha * a0_BTE.astype(jnp.float32)
    q = jax.nn.sigmoid(z[:, 1:])  # target: next token's soft pattern
    bce = -(q * jax.nn.log_sigmoid(z[:, :-1]) + (1.0 - q) * jax.nn.log_sigmoid(-z[:, :-1]))
    w = pair_valid(mask_BT, segment_ids_BT, (B, T)).astype(jnp.float32)
    n = jnp.sum(w) * E
    return jnp.sum(bce * w[..., None]) / jnp.maximum(n, 1.0)


def normalize_over_experts(a1_BTE) -> jax.Array:
    """``p = A1 / sum_e A1`` (float32); an all-zero token maps to all zeros (safe divide)."""
    a = a1_BTE.astype(jnp.float32)
    s = jnp.sum(a, -1, keepdims=True)
    return a / jnp.where(s > 0, s, 1.0)


def chunk_sparsification_loss(a1_BTE, *, chunk_len: int = 64, mask_BT=None,
                              segment_ids_BT=None, eps: float = 1e-6) -> jax.Array:
    """BlockFFN Eq. 5 (see module docstring). ``a1_BTE``: ReLU router activations (>= 0)."""
    B, T, E = a1_BTE.shape
    real = _real(mask_BT, (B, T))
    p = normalize_over_experts(a1_BTE) * real[..., None]
    log_keep = jnp.log1p(-jnp.minimum(p, 1.0 - eps))  # ln(1 - p) <= 0, finite
    starts = chunk_starts(mask_BT, segment_ids_BT, (B, T), chunk_len).reshape(-1)
    group_N = jnp.maximum(jnp.cumsum(starts.astype(jnp.int32)) - 1, 0)
    n_groups = B * T
    s_GE = jax.ops.segment_sum(log_keep.reshape(B * T, E), group_N, num_segments=n_groups)
    p_act_GE = 1.0 - jnp.exp(s_GE)
    valid_G = jnp.arange(n_groups) < jnp.sum(starts)
    total = jnp.sum(jnp.where(valid_G[:, None], p_act_GE, 0.0))
    return total / jnp.maximum(jnp.sum(valid_G) * E, 1.0)


def _token_mean(v_BT, mask_BT):
    w = _real(mask_BT, v_BT.shape).astype(jnp.float32)
    return jnp.sum(v_BT * w) / jnp.maximum(jnp.sum(w), 1.0)


def l1_activation_loss(a_BTE, *, mask_BT=None) -> jax.Array:
    """``mean_t sum_e |A[t, e]|`` over real tokens."""
    return _token_mean(jnp.sum(jnp.abs(a_BTE.astype(jnp.float32)), -1), mask_BT)


def load_balanced_l1_loss(a_BTE, *, k: float, mask_BT=None) -> jax.Array:
    """ReMoE's load-balanced L1 (the switch balance formula on ReLU outputs):
    ``E sum_e P_e f_e`` with ``P_e = mean_t A[t, e]`` and ``f_e = sg(#{t: A[t, e] > 0}) /
    (T k)``, over the ``T`` real tokens; ``k`` = the target number of active experts per
    token (``E (1 - target sparsity)``). Each expert's L1 is weighted by how often it fires,
    so busy experts are pushed hardest; with every expert equally busy at ``k`` per token it
    equals the plain L1 ``mean_t sum_e A[t, e]``."""
    if k <= 0:
        raise ValueError(f"k={k} must be > 0 (target active experts per token)")
    a = jnp.abs(a_BTE.astype(jnp.float32))
    E = a.shape[-1]
    w_BT = _real(mask_BT, a.shape[:-1]).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w_BT), 1.0)
    p_E = jnp.einsum("bte,bt->e", a, w_BT) / n
    f_E = jax.lax.stop_gradient(jnp.einsum("bte,bt->e", (a > 0).astype(jnp.float32), w_BT)
                                / (n * k))
    return E * jnp.sum(p_E * f_E)


def router_entropy_loss(a1_BTE, *, mask_BT=None) -> jax.Array:
    """``mean_t H(p_t)``, ``p_t = A1_t / sum A1_t``, over real tokens with an active expert."""
    p = normalize_over_experts(a1_BTE)
    plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
    h_BT = -jnp.sum(plogp, -1)
    any_active = jnp.any(a1_BTE > 0, -1)
    m = any_active if mask_BT is None else any_active & mask_BT.astype(bool)
    return _token_mean(h_BT, m)
