"""BlockFFN (Song et al. 2025): chunk-sparse MoE LMs against the sparsely activated baselines,
the router and objective ablations, and the expert granularity (``baselines``, ``ablations``,
``granularity``)."""

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("BlockFFN and baseline LMs of 0.1B, 0.5B, 0.8B and 1.2B parameters at close "
               "total and active parameters and training tokens (BlockFFN Sec. 4.1); decoding "
               "on an NVIDIA Jetson Orin NX (Table 6)")
