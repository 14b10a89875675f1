"""XLA flags are passed only where the installed XLA knows them: an unknown one would abort
the process (no Python exception), so it is left out."""

import subprocess
import sys

from moejax.xla_flags import supported, with_flags

KNOWN = "--xla_backend_optimization_level=0"
UNKNOWN = "--xla_moejax_no_such_flag=true"


def test_an_unknown_flag_would_abort_and_is_left_out():
    r = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                       env={"XLA_FLAGS": UNKNOWN, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                       text=True)
    assert r.returncode != 0 and "Unknown flag" in r.stderr  # what the check protects from
    assert supported([KNOWN, UNKNOWN]) == (KNOWN,)
    assert supported([UNKNOWN]) == ()
    assert supported([]) == ()


def test_with_flags_appends_known_flags_and_keeps_the_callers():
    env = {"XLA_FLAGS": "--xla_backend_optimization_level=2"}
    # the caller's value of a flag wins; the unknown one is dropped
    assert with_flags([KNOWN, UNKNOWN], env) == "--xla_backend_optimization_level=2"
    assert with_flags([KNOWN, UNKNOWN], {}) == KNOWN
