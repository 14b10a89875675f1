"""AdamR (paper Algorithm 1): Adam with decay anchored at the pre-trained parameters.

    m_t = b1 m_{t-1} + (1-b1) g_t,        v_t = b2 v_{t-1} + (1-b2) g_t^2
    m^_t = m_t/(1-b1^t),   v^_t = v_t/(1-b2^t),   vbar_t = mean(v^_t)   (ONE scalar, all params)
    theta_t = theta_{t-1} - lr_t [ m^_t/(sqrt(v^_t)+eps)
                                   + lambda R(theta_{t-1} - theta_P)/(sqrt(vbar_t)+eps) ]

with ``R(d) = d`` (AdamR-L2, for random DPP) or ``R(d) = sign(d)`` (AdamR-L1, for
importance DPP). It replaces AdamW's weight decay. ``theta_P`` (the anchor) defaults
to the parameters given to ``init`` -- i.e. the pre-trained weights when fine-tuning
starts -- or is passed explicitly.

Composition: ``adamr = chain(scale_by_adamr(...), scale_by_learning_rate(lr))`` so
``lr`` may be an optax schedule; clip with ``optax.chain(optax.clip_by_global_norm(1.),
adamr(...))``; restrict with ``optax.masked(adamr(...), mask)`` (then ``vbar`` is the
mean over the masked-in parameters only) or keep Adam everywhere and restrict the
anchored decay with ``mask``. The keywords are optax's (``optax.adamw``): ``weight_decay``
is ``lambda`` and ``mask`` where the decay applies; the former names ``weight`` and
``decay_mask`` still work and warn (``DeprecationWarning``).
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moejax.config import is_real

__all__ = ["ScaleByAdamRState", "scale_by_adamr", "adamr"]

PyTree = Any
_UNSET = object()


def _renamed(value, old_value, new: str, old: str):
    """``value``, or ``old_value`` given under the former keyword ``old`` (with a
    ``DeprecationWarning``); both given is an error."""
    if old_value is _UNSET:
        return value
    if value is not _UNSET:
        raise TypeError(f"adamr: give {new}= (optax's name) or the former {old}=, not both")
    warnings.warn(f"adamr: {old}= is now {new}= (optax's name); {old}= goes in the next "
                  "release", DeprecationWarning, stacklevel=3)
    return old_value


class ScaleByAdamRState(NamedTuple):
    """Wrapped ``optax.scale_by_adam`` state and the anchor ``theta_P``."""

    adam: optax.ScaleByAdamState
    anchor: PyTree


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _full_mask(mask, params) -> PyTree:
    """A bool per leaf of ``params`` from an optax-style mask: ``None`` (all True), a callable
    ``params -> mask`` or a bool tree that is a prefix of ``params`` (a bool covers a subtree)."""
    if mask is None:
        return jax.tree_util.tree_map(lambda _: True, params)
    if callable(mask):
        mask = mask(params)
    return jax.tree_util.tree_map(
        lambda m, sub: jax.tree_util.tree_map(lambda _: bool(m), sub), mask, params)


def scale_by_adamr(
    weight_decay: float = _UNSET,
    *,
    reg: Literal["l2", "l1"] = "l2",
    anchor: PyTree | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    mask: PyTree | None = _UNSET,
    weight: float = _UNSET,
    decay_mask: PyTree | None = _UNSET,
) -> optax.GradientTransformation:
    """Direction ``m^/(sqrt(v^)+eps) + weight_decay R(theta - theta_P)/(sqrt(vbar)+eps)``.

    The Adam part is ``optax.scale_by_adam`` itself, so ``weight_decay=0`` is Adam exactly.
    ``update`` requires ``params``. ``mask`` (where the anchored decay applies) is an
    optax-style mask: a bool tree, a prefix of one, or a callable ``params -> mask``.
    ``weight`` and ``decay_mask`` are the former names (deprecated).
    """
    weight = _renamed(weight_decay, weight, "weight_decay", "weight")
    weight = 0.0 if weight is _UNSET else weight
    decay_mask = _renamed(mask, decay_mask, "mask", "decay_mask")
    decay_mask = None if decay_mask is _UNSET else decay_mask
    if reg not in ("l2", "l1"):
        raise ValueError(
            f"reg={reg!r}; use 'l2' (AdamR-L2, random DPP) or 'l1' (AdamR-L1, importance DPP)."
        )
    if not isinstance(weight, jax.core.Tracer):
        if not is_real(weight):
            raise TypeError(f"adamr: weight_decay must be a number (lambda), got "
                            f"{type(weight).__name__}; the pre-trained params go in anchor= "
                            "(or leave it out: anchored at the params given to init).")
        if not (math.isfinite(float(weight)) and float(weight) >= 0):
            raise ValueError(f"adamr: weight_decay={weight} must be a finite lambda >= 0.")
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype)
    reg_fn = (lambda d: d) if reg == "l2" else jnp.sign

    def init_fn(params):
        if anchor is None:
            anc = jax.tree_util.tree_map(lambda p: jnp.array(p, copy=True), params)
        else:
            def cast(p, a):
                if _is_masked(p):
                    return p
                if jnp.shape(a) != jnp.shape(p):  # a broadcast would decay toward garbage
                    raise ValueError(f"adamr: an anchor leaf of shape {jnp.shape(a)} for a "
                                     f"parameter of shape {jnp.shape(p)}; the anchor must be "
                                     "the pre-trained params, leaf for leaf.")
                return jnp.asarray(a, jnp.result_type(p))

            try:
                anc = jax.tree_util.tree_map(cast, params, anchor, is_leaf=_is_masked)
            except ValueError as e:
                raise ValueError(
                    f"adamr: `anchor` must have the structure of the params ({e}); "
                    "pass the pre-trained params tree, or anchor=None to anchor at init params."
                ) from e
        return ScaleByAdamRState(adam.init(params), anc)

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("adamr needs params: call tx.update(grads, state, params).")
        adam_updates, adam_state = adam.update(updates, state.adam, params)
        count = adam_state.count
        bc2 = 1.0 - jnp.asarray(b2, jnp.float32) ** count.astype(jnp.float32)
        nus = jax.tree_util.tree_leaves(adam_state.nu)
        total = sum(jnp.sum(n.astype(jnp.float32)) for n in nus)
        size = sum(n.size for n in nus)
        vbar = total / bc2 / max(size, 1)
        coef = weight / (jnp.sqrt(vbar) + eps)
        dm = _full_mask(decay_mask, params)

        def add(u, p, a, m):
            if not m:
                return u
            return (
                u + (coef * reg_fn(p.astype(jnp.float32) - a.astype(jnp.float32))).astype(u.dtype)
            ).astype(u.dtype)

        new_updates = jax.tree_util.tree_map(add, adam_updates, params, state.anchor, dm)
        return new_updates, ScaleByAdamRState(adam_state, state.anchor)

    return optax.GradientTransformation(init_fn, update_fn)


def adamr(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: float = _UNSET,
    **kwargs,
) -> optax.GradientTransformation:
    """AdamR-L2 / AdamR-L1 (Algorithm 1) as an optax transformation:
    :func:`scale_by_adamr` then the learning rate.

    ``weight_decay`` is ``lambda`` (default 0: Adam); ``learning_rate`` a float or an optax
    schedule; the other keywords are :func:`scale_by_adamr`'s (``reg``, ``anchor``, ``b1``,
    ``b2``, ``eps``, ``eps_root``, ``mu_dtype``, ``mask``, where the anchored decay applies).
    """
    return optax.chain(scale_by_adamr(weight_decay, **kwargs),
                       optax.scale_by_learning_rate(learning_rate))


def _signature_of_adamr() -> inspect.Signature:
    """``learning_rate`` then :func:`scale_by_adamr`'s parameters: the signature that
    ``optax.inject_hyperparams(adamr)`` binds (a bare ``**kwargs`` would be bound as one
    argument named ``kwargs``)."""
    inner = inspect.signature(scale_by_adamr)
    lr = inspect.Parameter("learning_rate", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                           annotation=optax.ScalarOrSchedule)
    return inner.replace(parameters=[lr, *inner.parameters.values()])


adamr.__signature__ = _signature_of_adamr()
