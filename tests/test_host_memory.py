"""``retain_freed_memory``: glibc keeps freed heap memory, so a step that allocates and frees
the same large buffers stops page-faulting (run in subprocesses: the setting is process-wide)."""

import platform
import subprocess
import sys

import pytest

STEP = """
import sys, numpy as np
from moejax.host_memory import retain_freed_memory, minor_page_faults
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def step():  # three 12 MiB buffers, touched, freed: the heap's free top exceeds glibc's trim
    arrs = [np.empty(3 * 2**20, np.float32) for _ in range(3)]
    for a in arrs:
        a[:] = 1
for _ in range(3):
    step()
f0 = minor_page_faults()
for _ in range(10):
    step()
print((minor_page_faults() - f0) / 10)
"""


def _faults_per_step(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True,
                         timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_retained_memory_stops_the_page_faults():
    default, retained = _faults_per_step("default"), _faults_per_step("retain")
    assert default > 500, f"the default allocator should fault here (got {default}/step)"
    assert retained < default / 10, (default, retained)
