import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests run tiny models: compiling dominates their time, running them does not. LLVM's
# optimisation level 0 compiles 30-40% faster here (e.g. the darex_controlled smoke test
# 23-26 s -> 14-19 s) and changes no result beyond float rounding. Set MOEJAX_TEST_XLA_OPT=1 to
# test with XLA's default optimisation.
if os.environ.get("MOEJAX_TEST_XLA_OPT", "0") != "1":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

# Many tests compile the same tiny programs (the tiny substrates, the same train step on the
# same shapes); XLA's persistent compilation cache, shared by the pytest workers, compiles
# each once per machine. Keyed by the program, jax version and flags, so it is never stale.
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("MOEJAX_TEST_JAX_CACHE",
                                 str(Path(__file__).resolve().parent.parent / ".cache" / "jax")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


import pytest  # noqa: E402


@pytest.fixture()
def tiny_recipes(monkeypatch, tmp_path):
    """Tiny substrate recipes in the registry (tests/tiny_substrates.py); returns a fresh
    cache directory."""
    from moejax.substrates import registry
    from tests.tiny_substrates import tiny_registry

    monkeypatch.setattr(registry, "SUBSTRATES", tiny_registry())
    return tmp_path / "subs"
