"""Speed and memory benchmarks: dispatch paths, expert kernels against their bounds, the
grouped matmul, speculative decoding, expert parallelism, extracted experts' layouts, DeRS
experts at decode, and the kernel autotuner."""
