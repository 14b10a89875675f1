"""Layer surgery on nnx models through pure variable dicts (penzai-style: select a sublayer,
replace it): transform ``nnx.to_pure_dict(nnx.state(model))`` with a pure function, change
the config to match, and :func:`build_from_pure` the new model. Upcycling, layer dropping,
DeRS synthesis and expert extraction all build their models this way."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["build_from_pure", "with_slot_config"]


def build_from_pure(make: Callable[[], nnx.Module], pure: dict) -> nnx.Module:
    """``make()`` built abstractly (no random init), its variables set from the pure dict
    ``pure`` (every array copied, so the new model never aliases its source's buffers: a
    training step that donates its state must not delete the source's weights). Every array
    must have the shape and dtype the model's config gives that variable, so the config
    describes the model it built (a rebuild from the config alone gets the same model)."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    _check_against(nnx.to_pure_dict(state), pure)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.array(x, copy=True), pure))
    return nnx.merge(graphdef, state)


def _check_against(abstract: dict, pure: dict) -> None:
    """Refuse arrays of ``pure`` whose shape or dtype differs from the abstract model's, and a
    ``pure`` that leaves any of the model's variables unset (built abstractly, it would hold
    no value: a buffer such as DeRS-SM's indices, not only the parameters, must be given)."""
    want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(abstract)}
    given = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(pure)}
    missing = sorted(set(want) - given)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"build_from_pure: no value for {', '.join(missing[:3])}{more}; give "
                         "every variable of the model (nnx.state(model), not only its "
                         "nnx.Param)")
    wrong = []
    for k, x in jax.tree_util.tree_leaves_with_path(pure):
        spec = want.get(jax.tree_util.keystr(k))
        if spec is not None and (tuple(spec.shape) != tuple(jnp.shape(x))
                                 or jnp.dtype(spec.dtype) != jnp.result_type(x)):
            wrong.append(f"{jax.tree_util.keystr(k)} is {jnp.result_type(x)}{list(jnp.shape(x))}"
                         f", the config gives {jnp.dtype(spec.dtype)}{list(spec.shape)}")
    if wrong:
        more = f"; {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise ValueError("build_from_pure: arrays that do not match the model's config ("
                         + "; ".join(wrong[:3]) + more + "); build from the config that "
                         "describes these arrays")


def with_slot_config(model: nnx.Module, slot_type: type, **changes) -> nnx.Module:
    """A copy of ``model`` (own buffers) whose every ``slot_type`` sublayer has its config
    replaced by ``cfg.replace(**changes)`` (compute-path settings such as BlockFFN's
    ``path`` / ``union_chunk``: the parameters stay the same)."""
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, jax.tree.map(lambda x: jnp.array(x, copy=True), state))
    found = 0
    for _, m in nnx.iter_modules(out):
        if isinstance(m, slot_type):
            same = getattr(m, "moe_cfg", None) is m.cfg  # BlockFFN: one config for both
            m.cfg = m.cfg.replace(**changes)
            if same:
                m.moe_cfg = m.cfg
            found += 1
    if not found:
        raise ValueError(f"with_slot_config: the model has no {slot_type.__name__} sublayer")
    return out
