"""Host (numpy) expert kernels for the CPU backend: the fused expert FFN (:mod:`.moe`), its
numpy activations (:mod:`.act`) and the memory settings that keep its buffers cheap
(:mod:`.memory`)."""
