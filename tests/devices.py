"""Run a test script in a fresh Python with ``n`` simulated CPU devices (the device count is
fixed before JAX starts, so multi-device tests run in a subprocess)."""

import os
import subprocess
import sys

from moejax.train.distributed import cpu_devices_env
from moejax.xla_flags import with_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_devices(script: str, n_devices: int = 8, timeout: int = 600, hang_s: int = 240) -> str:
    """Run ``script`` (``ROOT`` in it is replaced by the repository path) with ``n_devices``
    CPU devices; fail the test unless it exits 0 and its output ends with ``OK``. Returns
    the output, for the caller to check the stages the script reports. ``hang_s``: how long
    a device may wait in a collective before XLA ends the process."""
    env = cpu_devices_env(n_devices)  # keeps the suite's XLA flags and compilation cache
    # the simulated devices share two cores with the other pytest worker: XLA's 40 s for every
    # device to reach a collective can pass under that load (a false "stuck" abort); a real
    # hang still ends at hang_s (240 s), inside every caller's subprocess timeout
    env["XLA_FLAGS"] = with_flags(
        [f"--xla_cpu_collective_call_warn_stuck_timeout_seconds={min(60, hang_s // 2)}",
         f"--xla_cpu_collective_call_terminate_timeout_seconds={hang_s}"], env)
    r = subprocess.run([sys.executable, "-c", script.replace("ROOT", repr(ROOT), 1)], env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (r.stdout[-3000:]
                                                                   + r.stderr[-5000:])
    return r.stdout
