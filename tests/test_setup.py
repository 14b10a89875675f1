"""`make setup` finds a Python >= 3.12 (scripts/find_python.sh) or stops with one line."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "find_python.sh")


def _run(env):
    return subprocess.run(["/bin/bash", SCRIPT], env=env, capture_output=True, text=True)


def test_a_python_312_is_found_and_an_old_one_named_is_refused(tmp_path):
    r = _run({"PATH": os.environ["PATH"], "PYTHON": sys.executable})
    assert r.returncode == 0 and os.path.samefile(r.stdout.strip(), sys.executable)
    old = tmp_path / "python3.11"
    old.write_text("#!/bin/sh\nexit 1\n")  # fails the version check like a 3.11 would
    old.chmod(0o755)
    r = _run({"PATH": os.environ["PATH"], "PYTHON": str(old)})
    assert r.returncode == 1 and "is not a Python >= 3.12" in r.stderr


def test_no_python_312_stops_with_one_line_saying_what_to_install(tmp_path):
    for name in ("python3", "python3.12", "python3.13"):
        fake = tmp_path / name
        fake.write_text("#!/bin/sh\nexit 1\n")
        fake.chmod(0o755)
    r = _run({"PATH": str(tmp_path), "HOME": str(tmp_path)})
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1
    assert "needs Python >= 3.12" in r.stderr and "install python3.12" in r.stderr
