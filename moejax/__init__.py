"""moejax: cheap Mixture-of-Experts in JAX/Flax NNX (upcycling, delta compression,
chunk-sparse MoEs, MoE distillation, expert extraction)."""

__version__ = "0.1.0"
