"""BlockFFN (Song et al. 2025): chunk-sparse MoE LMs against the sparsely activated baselines,
the router and objective ablations, and the expert granularity (``baselines``, ``ablations``,
``granularity``), the chunk-union kernels against their bounds (``kernels``) and speculative
decoding (``speculative``); ``common``: what they share."""
