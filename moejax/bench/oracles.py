"""Oracles a benchmark checks a kernel's output against before it reports the kernel's time: a
wrong kernel is never timed (a kernel's first run on new hardware may compile and run, and be
wrong).

:func:`grouped_pass_sample`: sampled entries of one grouped-matmul product
(:mod:`moejax.kernels.grouped.ragged`'s ``fwd`` ``x w_g``, ``dlhs`` ``dy w_g^T``, ``drhs``
``x_g^T dy_g``) in float32, the slow obvious way: each sampled row times its own group's
weights, and each sampled weight-gradient entry as a segment sum over its group's rows. Only a
sample, so the oracle stays cheap at the benchmark's largest shapes (where
``jax.lax.ragged_dot`` on a GPU expands to a dense product that runs out of memory); each
sampled entry covers a whole contraction, so a wrong tile, group boundary or mask shows in the
entries it touches, and the samples cover every group.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["grouped_pass_sample"]


def _row_groups(group_sizes, rows):
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)


def grouped_pass_sample(which: str, a, b, group_sizes, key, samples: int = 64
                        ) -> tuple[Callable, jax.Array]:
    """``(take, want)``: ``take(out)`` picks the sampled entries of pass ``which``'s output
    from operands ``a``, ``b`` (``fwd``: ``x [M, K]``, ``w [G, K, N]``; ``dlhs``: ``dy [M,
    N]``, ``w``; ``drhs``: ``x``, ``dy``) and ``want`` holds their float32 values. The rows
    checked are one inside every non-empty group and ``samples`` more anywhere inside the
    groups (rows past them belong to no product); the weight
    gradient samples ``samples // 2`` of its ``K`` rows and of its ``N`` columns, in every
    group (its segment sums hold ``M x (samples // 2)^2`` float32 values). Operands are
    concrete arrays (the benchmark's, not traced ones)."""
    if which not in ("fwd", "dlhs", "drhs"):
        raise ValueError(f"which={which!r}; one of fwd, dlhs, drhs")
    f32 = lambda z: z.astype(jnp.float32)  # noqa: E731
    total = jnp.sum(group_sizes)
    if which == "drhs":
        G = group_sizes.shape[0]
        kk, kn = jax.random.split(key)
        half = max(1, samples // 2)
        ks = jax.random.choice(kk, a.shape[1], (min(half, a.shape[1]),), replace=False)
        ns = jax.random.choice(kn, b.shape[1], (min(half, b.shape[1]),), replace=False)
        rows = jnp.arange(a.shape[0])
        gid = jnp.where(rows < total, _row_groups(group_sizes, rows), G)  # G: no group
        outer = f32(a[:, ks])[:, :, None] * f32(b[:, ns])[:, None, :]
        want = jax.ops.segment_sum(outer, gid, num_segments=G + 1)[:G]
        return (lambda out: out[:, ks][:, :, ns]), want
    # one row inside every non-empty group, then ``samples`` rows anywhere inside the groups
    sizes = np.asarray(group_sizes)
    ends = np.cumsum(sizes)
    k_group, k_any = jax.random.split(key)
    u = np.asarray(jax.random.uniform(k_group, sizes.shape))
    per_group = (ends - sizes + np.floor(u * sizes)).astype(np.int64)[sizes > 0]
    anywhere = np.asarray(jax.random.randint(k_any, (samples,), 0, max(int(total), 1)))
    rows = np.unique(np.concatenate([per_group, anywhere if total else anywhere[:0]]))
    gid = _row_groups(group_sizes, jnp.asarray(rows, jnp.int32))

    def one(r, g):
        w = f32(b[g])
        return f32(a[r]) @ (w if which == "fwd" else w.T)

    want = jax.lax.map(lambda rg: one(*rg), (jnp.asarray(rows, jnp.int32), gid))
    return (lambda out: out[rows]), want
