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
    training step that donates its state must not delete the source's weights)."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.array(x, copy=True), pure))
    return nnx.merge(graphdef, state)


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
