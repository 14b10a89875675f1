"""BlockFFN (Song et al. 2025) beyond its layer, one home: the adaptive chunk-sparsification
coefficient (:mod:`.schedule`: BlockFFN App. B's scheduler, and ReMoE's L1 controller it is
compared with) and the speculative drafts distilled from a chunk-sparse target (:mod:`.draft`). The
layer is :mod:`moejax.nn.blockffn`, its kernels :mod:`moejax.kernels.chunk_union`, its
objectives pure losses in :mod:`moejax.ops.chunk_sparsity`."""
