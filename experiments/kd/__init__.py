"""Distillation from an MoE teacher ("Every Expert Matters", Kim et al. 2025): KD, GKD, ALL,
KA and SAR (``moe_kd``, its sweeps in ``sweeps``); ``common``: what they share."""
