"""Router auxiliary losses and statistics (pure, padding-mask-aware functions).

Shapes: ``ids_NK`` selected expert ids, ``gates_NE`` / ``probs_NE`` per-expert gate values,
``logits_NE`` router logits, ``mask_N`` optional bool mask of real (non-padding) tokens.
Padding tokens contribute nothing to any quantity here.

* :func:`cv2_balance_loss` -- Shazeer et al. 2017 / Llama-MoE: ``CV(m)^2 + CV(P)^2``.
* :func:`switch_balance_loss` -- Switch Transformer: ``E * sum_i f_i P_i``.
* :func:`router_z_loss` -- ST-MoE: ``mean_n logsumexp(logits_n)^2``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "expert_counts",
    "cv_squared",
    "cv2_balance_loss",
    "switch_balance_loss",
    "router_z_loss",
    "gate_mass_selected",
]


def _mask_f32(mask_N, n: int):
    if mask_N is None:
        return jnp.ones((n,), jnp.float32)
    if jnp.size(mask_N) != n:  # one of size 1 would broadcast over every token, silently
        raise ValueError(f"a token mask of shape {tuple(jnp.shape(mask_N))} for {n} routed "
                         "tokens; give one entry per token (any shape of that size)")
    return mask_N.reshape(-1).astype(jnp.float32)


def expert_counts(ids_NK, n_experts: int, mask_N=None):
    """``[E]`` float32: number of real-token (token, slot) assignments routed to each
    expert (a token counts once for each of its k slots)."""
    n, k = ids_NK.shape
    m_N = _mask_f32(mask_N, n)
    w_A = jnp.repeat(m_N, k)
    return jnp.zeros((n_experts,), jnp.float32).at[ids_NK.reshape(-1)].add(w_A)


def cv_squared(v_E, *, ddof: int = 1, eps: float = 1e-10):
    """Squared coefficient of variation ``var(v) / (mean(v)^2 + eps)``.

    ``ddof=1`` (unbiased variance, divide by ``E - 1``) matches the reference code of
    Shazeer 2017 / Llama-MoE (``torch.var`` default); ``ddof=0`` gives the population
    variance. Returns 0 for a single element (as the reference does)."""
    v = v_E.astype(jnp.float32)
    e = v.shape[0]
    if e - ddof <= 0:
        return jnp.zeros((), jnp.float32)
    mean = jnp.mean(v)
    var = jnp.sum((v - mean) ** 2) / (e - ddof)
    return var / (mean**2 + eps)


def cv2_balance_loss(ids_NK, gates_NE, mask_N=None, *, ddof: int = 1, eps: float = 1e-10):
    """CV load-balance loss ``CV(m)^2 + CV(P)^2`` (Shazeer 2017; Llama-MoE, coef 0.01).

    ``m_i`` = number of real-token assignments to expert ``i`` (not differentiable);
    ``P_i = sum_n mask_n * gates_NE[n, i]`` = summed gate value of expert ``i`` (the
    "importance"). Following the reference code, ``gates_NE`` should be the gate matrix
    the layer actually uses (combine weights at the selected experts, 0 elsewhere); the
    gradient flows through ``P``. ``ddof`` / ``eps`` as in :func:`cv_squared`."""
    n, e = gates_NE.shape
    m_E = expert_counts(ids_NK, e, mask_N)
    p_E = jnp.sum(gates_NE.astype(jnp.float32) * _mask_f32(mask_N, n)[:, None], axis=0)
    return cv_squared(m_E, ddof=ddof, eps=eps) + cv_squared(p_E, ddof=ddof, eps=eps)


def switch_balance_loss(ids_NK, probs_NE, mask_N=None):
    """Switch Transformer balance loss ``E * sum_i f_i P_i``.

    ``f_i`` = fraction of real-token (token, slot) assignments routed to expert ``i``
    (sums to 1 over experts for any k); ``P_i`` = mean over real tokens of the full router
    probability ``probs_NE[:, i]``. Equals 1 for perfectly uniform routing."""
    n, e = probs_NE.shape
    m_N = _mask_f32(mask_N, n)
    counts_E = expert_counts(ids_NK, e, mask_N)
    f_E = counts_E / jnp.maximum(jnp.sum(counts_E), 1.0)
    p_E = jnp.sum(probs_NE.astype(jnp.float32) * m_N[:, None], axis=0) / jnp.maximum(
        jnp.sum(m_N), 1.0
    )
    return e * jnp.sum(f_E * p_E)


def router_z_loss(logits_NE, mask_N=None):
    """Router z-loss (ST-MoE): mean over real tokens of ``logsumexp(logits_n)^2``."""
    n = logits_NE.shape[0]
    m_N = _mask_f32(mask_N, n)
    lse_N = jax.nn.logsumexp(logits_NE.astype(jnp.float32), axis=-1)
    return jnp.sum(m_N * lse_N**2) / jnp.maximum(jnp.sum(m_N), 1.0)


def gate_mass_selected(ids_NK, probs_NE, mask_N=None):
    """Mean over real tokens of ``sum_k probs_NE[n, ids_NK[n, k]]``: how much of the full
    softmax probability the selected experts hold."""
    n = probs_NE.shape[0]
    m_N = _mask_f32(mask_N, n)
    sel_N = jnp.sum(jnp.take_along_axis(probs_NE.astype(jnp.float32), ids_NK, axis=-1), -1)
    return jnp.sum(m_N * sel_N) / jnp.maximum(jnp.sum(m_N), 1.0)
