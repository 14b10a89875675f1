"""The MoE FFN op, one package as tokamax arranges its ops: route-weighted experts over the
tokens each expert received, by named dispatch path.

* :mod:`.api`: every dispatch path by name (``DISPATCH_PATHS``, ``"auto"``) and the call;
* :mod:`.jnp_paths`: the jnp paths (the dense oracle, capacity, dropless ``ragged_dot``,
  block-padded ``grouped``, ``bucketed``) with :mod:`.permute` (row permutations, forward and
  backward) and :mod:`.every_expert` (every expert on every row: the oracle's inner product);
* :mod:`.host` / :mod:`.host_act`: the fused numpy expert FFN of the CPU backend
  (``dispatch="host"`` / ``"host_capacity"``) and its activations;
* :mod:`.expert_parallel`: the all-to-all paths over an ``expert`` mesh axis.

The grouped matmul these paths call is its own op (:mod:`moejax.kernels.grouped`, with its
layout); BlockFFN's chunk-union experts are another (:mod:`moejax.kernels.chunk_union`).
"""
