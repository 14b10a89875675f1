"""optax transformations: AdamR (anchored decay, paper Algorithm 1) and DARE on updates."""

from moejax.optim.anchored import ScaleByAdamRState, adamr, scale_by_adamr
from moejax.optim.dropped_updates import DareUpdatesState, dare_updates

__all__ = [
    "DareUpdatesState",
    "adamr",
    "dare_updates",
    "ScaleByAdamRState",
    "scale_by_adamr",
]
