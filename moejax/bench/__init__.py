"""What the benchmarks measure, as library functions (the benchmark modules under
``experiments/benchmarks/`` are their recipes):

* :mod:`~moejax.bench.timing`: host and device timing of jitted calls, why a kernel path has
  no measurement here, synthetic BlockFFN activation patterns;
* :mod:`~moejax.bench.profile`: a call's kernels and their own device time, from the profiler;
* :mod:`~moejax.bench.oracles`: what a kernel's output is checked against before it is timed;
* :mod:`~moejax.bench.cpu`: the matmul rate, one MoE block forward + backward and its PyTorch
  peer, the delta operations;
* :mod:`~moejax.bench.decode_timing`: decode timing and the grown speculative-decoding target;
* :mod:`~moejax.bench.resume`: measurements kept as they are taken, so a benchmark stopped by
  a time limit measures only what is missing when run again.
"""
