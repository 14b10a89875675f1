"""The study harness: what runs a paper's recipe and publishes its results, apart from the
methods it runs. Run directories and their records (:mod:`.results`, :mod:`.run_record`), the
run index (:mod:`.run_index`), the command-line runner (:mod:`.experiment`, :mod:`.study`),
claims judged from paired seeds (:mod:`.claims`), tables (:mod:`.tables`), plots
(:mod:`.plots`) and smoke-run cuts (:mod:`.smoke`). Nothing here is imported by the layers
below (ops, kernels, nn, train, io), except the substrate cache's smoke cuts."""
