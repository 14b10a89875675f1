"""Speed and memory benchmarks of the MoE FFN op: its dispatch paths and train step, the
dropless grouped matmul, expert parallelism, and the kernel autotuner. The benchmarks of one
paper live with its studies (``experiments.blockffn.kernels``, ``experiments.blockffn.
speculative``, ``experiments.extraction.bench``, ``experiments.ders.bench``)."""
