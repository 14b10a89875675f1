"""The lean decode step's parts shared by its attention and FFN modules
(:mod:`moejax.nn.lean_decode`): the products' weight layouts and their matrix-vector product,
exact bfloat16 pieces of float32 weights, the norm's scale folded into weights, the residual
stream made once with its sum of squares, a block output not yet summed, and the choice between
a step's GPU kernel and XLA's."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.kernels.tiling import target_device
from moejax.nn import axes as ax
from moejax.nn.norms import RMSNorm

__all__ = ["LAYOUTS", "FUSED", "Residual", "on_gpu", "laid", "matvec", "pieces", "folded",
           "bias_of", "stream"]

LAYOUTS = ("kn", "nk")  # a product's weight as [K, N] (the modules') or transposed, [N, K]
# a decode step's attention and FFN inputs as XLA's kernels, as one kernel each on a GPU (XLA's
# elsewhere), or as those kernels in Pallas's interpreter on any platform (tests)
FUSED = (False, True, "interpret")


class Residual(NamedTuple):
    """A block's output ``x + y`` not yet summed: the next block's fused kernel makes the add
    (:func:`moejax.kernels.decode_qkv.fused_qkv`'s ``y_BD``), in ``x``'s dtype, rounding once
    (``y`` may be wider: a chunk-union expert part's float32 sum)."""
    x: jax.Array
    y: jax.Array

    def summed(self) -> jax.Array:
        """``x + y`` in ``x``'s dtype, rounded once."""
        if self.y.dtype == self.x.dtype:
            return self.x + self.y
        return (self.x.astype(jnp.float32) + self.y.astype(jnp.float32)).astype(self.x.dtype)


def on_gpu(fused, kernel, xla, *args):
    """``kernel(*args)`` where the program is built for a GPU (``fused=True``) or always
    (``"interpret"``: the kernels in Pallas's interpreter), else ``xla(*args)``."""
    if fused == "interpret":
        return kernel(*args)
    if target_device()[0] != "cuda":
        return xla(*args)
    return jax.lax.platform_dependent(*args, default=xla, cuda=kernel)


def laid(w_KN, layout: str, *axes: str) -> nnx.Param:
    """A product's weight ``[K, N]`` (an array, or a module's parameter, which ``"kn"``
    keeps as it is) as a parameter in ``layout`` (``"nk"``: a transposed copy, ``[N, K]``),
    with its logical axes in the same order."""
    if layout == "kn":
        return w_KN if isinstance(w_KN, nnx.Param) else ax.param(w_KN, *axes)
    return ax.param(jnp.asarray(w_KN[...].T), *reversed(axes))


def matvec(x: jax.Array, w: jax.Array, layout: str, out_dtype=None) -> jax.Array:
    """``x @ W`` for ``W`` laid out as ``layout`` (:func:`laid`): ``x [..., K]``; the product
    in ``out_dtype`` where given (accumulated in it), else in the operands' dtype."""
    dims = (((x.ndim - 1,), (0 if layout == "kn" else 1,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=out_dtype)


def pieces(w, dtype) -> tuple[jax.Array, ...]:
    """float32 ``w`` as a sum of ``dtype`` arrays, exactly: itself in float32; three bfloat16
    pieces (8 significant bits each, float32's exponent range), each the rounding of what the
    ones before it leave. A product with them, accumulated in float32, is the float32
    product up to the order of its sums."""
    if jnp.dtype(dtype) == jnp.float32:
        return (w,)
    out = []
    for _ in range(3):
        out.append(w.astype(dtype))
        w = w - out[-1].astype(jnp.float32)
    return tuple(out)


def folded(norm: RMSNorm, *ws) -> jax.Array:
    """``diag(norm.scale) [w_1 | w_2 | ...]`` in the weights' dtype (folded in float32)."""
    w = jnp.concatenate([x[...] for x in ws], axis=1)
    return (norm.scale[...].astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(w.dtype)


def bias_of(module, names, axis: str) -> nnx.Param | None:
    present = [getattr(module, "b_" + n) for n in names if hasattr(module, "b_" + n)]
    return ax.param(jnp.concatenate([b[...] for b in present]), axis) if present else None


def stream(x_BTD, eps: float):
    """``(x, inv_rms(x))`` with ``x`` and its sum of squares made together and kept (one
    reduction, which also writes ``x``): the products read the written stream, rather than
    recomputing its sums inside each product's fusion over the whole weight. The sum, not the
    factor, is kept, so the ``rsqrt`` joins the kernels that use it."""
    ss = jnp.sum(jnp.square(x_BTD.astype(jnp.float32)), axis=-1, keepdims=True)
    x_BTD, ss = jax.lax.optimization_barrier((x_BTD, ss))
    return x_BTD, jax.lax.rsqrt(ss / x_BTD.shape[-1] + eps)
