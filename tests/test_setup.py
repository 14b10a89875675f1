"""`make setup`: a Python >= 3.12 found (scripts/find_python.sh) or one line saying what to
install; the pinned jax of the dev environment; the GPU compiler's failure in one line."""

import os
import re
import subprocess
import sys
import tomllib

from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "find_python.sh")
PINS = os.path.join(ROOT, "scripts", "dev_constraints.txt")


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


def test_the_dev_environments_jax_is_one_release_within_pyprojects_range():
    with open(PINS) as f:
        pins = dict(re.fullmatch(r"([a-z]+)==([0-9.]+)", line.strip()).groups()
                    for line in f if line.strip() and not line.startswith("#"))
    assert set(pins) == {"jax", "jaxlib"} and pins["jax"] == pins["jaxlib"]
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    for name, pin in pins.items():
        (spec,) = [d for d in deps if re.match(rf"{name}[><=]", d)]
        low, high = re.fullmatch(rf"{name}>=([0-9.]+),<([0-9.]+)", spec).groups()
        assert Version(low) <= Version(pin) < Version(high), (name, pin, spec)


def test_a_jaxlib_without_a_published_cuda_plugin_stops_with_one_line(tmp_path):
    fake = tmp_path / "python"  # says jaxlib 9.9.9, its prefix tmp_path; pip finds nothing
    fake.write_text('#!/bin/sh\ncase "$*" in\n  *"version("*) echo 9.9.9 ;;\n'
                    f"  *sys.prefix*) echo {tmp_path} ;;\n"
                    '  *) echo "pip: no match" >&2; exit 1 ;;\nesac\n')
    fake.chmod(0o755)
    r = subprocess.run(["/bin/bash", os.path.join(ROOT, "scripts", "install_gpu_compiler.sh")],
                       env={"PATH": os.environ["PATH"], "PYTHON": str(fake)},
                       capture_output=True, text=True)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and not (tmp_path / "gpu-compiler-9.9.9").exists()
    assert "CUDA plugin 9.9.9" in last and "scripts/dev_constraints.txt" in last
