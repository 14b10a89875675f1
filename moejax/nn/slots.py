"""The FFN slot contract shared by every block (dense FFN, MoE, BlockFFN, extracted experts).

A *slot config* is a frozen :class:`moejax.config.Config` subclass with a ``build`` method::

    class MySlotConfig(FFNSlotConfig):
        def build(self, d_model: int, *, rngs: nnx.Rngs, dtype, param_dtype) -> nnx.Module: ...

The module it builds is called as::

    y_BTD, aux = slot(x_BTD, train=False, key=None, mask_BT=None, segment_ids_BT=None)

* ``x_BTD``: ``[batch, time, d_model]`` activations (an encoder uses the same layout).
* ``train``: training mode (e.g. router noise on); ``key``: explicit PRNG key for any random
  step (``None`` is allowed only when the slot needs no randomness in this mode).
* ``mask_BT``: optional bool mask of real (non-padding) tokens; statistics and losses ignore
  the padding positions.
* ``segment_ids_BT``: optional int document id of each token of a packed row (``0`` =
  padding), as produced by ``moejax.data`` packing. Every slot must accept the argument;
  ignoring it is fine (dense FFN, top-k MoE). Slots with sequence-level losses (BlockFFN's
  activation locality / chunk sparsification) use it so that no term spans two documents.
  Blocks pass it only when it is not ``None``.
* ``aux``: a flat ``dict[str, jax.Array]``. The key ``"aux_loss"`` (scalar, already weighted by
  the slot's coefficients) is added to the training objective by the model; every other entry
  is a statistic for analysis (router loads, selected ids, raw unweighted losses, ...). A dense
  FFN returns ``{}``.

Models pick one slot config per layer (``ffn_slots`` tuple), so "MoE in every other block" is
``layer_pattern(n_layers, dense_cfg, moe_cfg, every=2)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moejax.config import Config

__all__ = ["FFNSlotConfig", "layer_pattern", "sum_aux_losses"]


class FFNSlotConfig(Config):
    """Base class of FFN slot configs; subclasses implement :meth:`build`."""

    def build(self, d_model: int, *, rngs, dtype=None, param_dtype=None):  # pragma: no cover
        raise NotImplementedError


def layer_pattern(
    n_layers: int,
    base: FFNSlotConfig,
    other: FFNSlotConfig,
    *,
    every: int = 2,
    offset: int = 1,
    layers: Sequence[int] | None = None,
) -> tuple[FFNSlotConfig, ...]:
    """Per-layer slot configs: ``other`` at ``layers`` (or every ``every``-th layer starting at
    ``offset``), ``base`` elsewhere. ``every=1, offset=0`` puts ``other`` in all layers. A
    pattern of ``every`` / ``offset`` that leaves ``other`` out of every layer is refused (an
    MoE LM of one layer with MoE in every other layer from the second would have none)."""
    if layers is None:
        if every < 1 or offset < 0:
            raise ValueError(f"layer_pattern: every={every} must be >= 1 and offset={offset} "
                             ">= 0")
        chosen = {i for i in range(n_layers) if i >= offset and (i - offset) % every == 0}
        if not chosen:
            raise ValueError(f"layer_pattern: every={every} from offset={offset} places "
                             f"{type(other).__name__} in none of the {n_layers} layers; "
                             "lower the offset (or use base alone)")
    else:
        chosen = set(layers)
        bad = [i for i in chosen if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"layer_pattern: layers {bad} out of range [0, {n_layers})")
    return tuple(other if i in chosen else base for i in range(n_layers))


def sum_aux_losses(aux_per_layer: Sequence[dict[str, Any]]):
    """Sum the ``aux_loss`` entries of per-layer aux dicts (0.0 when there are none)."""
    total = 0.0
    for aux in aux_per_layer:
        if "aux_loss" in aux:
            total = total + aux["aux_loss"]
    return total
