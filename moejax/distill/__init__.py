"""Distillation from MoE teachers ("Every Expert Matters", Kim et al. 2025), one home: the
teacher's routing modes (:mod:`.routing_modes`: top-k, all experts, Knowledge Augmentation's
sampled routing) and the methods with their training (:mod:`.training`: KD, GKD,
ALL, KA, SAR). The divergences they minimise are pure losses in
:mod:`moejax.ops.distill_losses`."""
