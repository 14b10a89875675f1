# The two commands (see README): `make demo` runs the tour, `make test` runs the tests;
# `make studies` runs every study's quick preset and writes this machine class's results
# document from the newest run of every study (docs/results.md on a CPU). All create or
# refresh the virtualenv first; set-up is idempotent and skipped when up to date. The demo and the studies use a GPU when
# jax finds one (install the `gpu` extra); the tests always run on the CPU.
PYTHON ?=
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moejax-installed
DEPS   := pyproject.toml scripts/dev_constraints.txt scripts/install_data_deps.sh \
          scripts/install_gpu_compiler.sh
ARGS   ?=

.PHONY: demo studies results test test-floor setup lint bench full-smoke full-aot smoke-devices \
        gpu-check clean-runs

# glibc: put large allocations (XLA's per-step buffers) on transparent huge pages, one page
# fault per 2 MiB instead of per 4 KiB (moejax.kernels.host_memory; ignored off glibc >= 2.35). An
# environment that sets GLIBC_TUNABLES itself keeps its own.
demo studies bench: export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

demo: setup
	$(PY) -m experiments.main suite=demo $(ARGS)

studies: setup
	$(PY) -m experiments.main suite=studies out=runs/studies $(ARGS)
	$(PY) -m experiments.results_doc

# this machine class's results document again (docs/results.md on a CPU, docs/results_gpu.md
# on a GPU) from the newest preset run of every study indexed under runs/; no study is run
results: setup
	$(PY) -m experiments.results_doc

bench: setup
	$(PY) -m experiments.benchmarks.dispatch $(ARGS)

# Every study's and benchmark's full preset as a smoke run here (real sizes and weights, a
# couple of steps and batches each; not part of `make test`) -> runs/full_smoke/full_smoke.md
full-smoke: setup
	$(PY) -m experiments.full_smoke $(ARGS)

# Every full preset's training steps proven ahead of time for cuda and tpu at their real
# shapes (size, FLOPs, memory per device, GPU hours) -> runs/full_aot/full_aot.md
full-aot: setup
	$(PY) -m experiments.full_smoke mode=aot $(ARGS)

# Every study's and benchmark's quick preset as a smoke run on 2 CPU devices (each training
# loop, evaluator and benchmark with its arrays over a mesh of both; not part of `make test`)
# -> runs/smoke_devices/full_smoke.md
smoke-devices: setup
	$(PY) -m experiments.full_smoke preset=quick devices=2 out=runs/smoke_devices $(ARGS)

# On a GPU machine: the gpu extra, then scripts/gpu_check.sh (the kernel tests compiled for the
# GPU and the benchmarks' full presets -> runs/gpu/; its stages within BUDGET, 25 minutes
# unless set) and docs/results_gpu.md.
gpu-check: setup
	$(PY) -m pip install -q -e ".[gpu]"
	PYTHON=$(PY) BUDGET=$${BUDGET:-1500} scripts/gpu_check.sh runs/gpu
	$(PY) -m experiments.results_doc machine=gpu

test: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist worksteal $(ARGS)

# The suite on the lowest jax pyproject.toml allows (a GPU machine's may be that old): that jax
# and jaxlib in a folder of their own ahead of the virtualenv's, which stays as it is, and
# that jaxlib's CUDA plugin (scripts/install_gpu_compiler.sh)
JAX_FLOOR := $(shell sed -n 's/^ *"jax>=\([0-9.]*\),.*/\1/p' pyproject.toml)
test-floor: setup
	test -d $(VENV)/jax-floor/jax-$(JAX_FLOOR).dist-info || $(PY) -m pip install -q --no-deps \
	  --target $(VENV)/jax-floor "jax==$(JAX_FLOOR)" "jaxlib==$(JAX_FLOOR)"
	PYTHONPATH=$(abspath $(VENV))/jax-floor PYTHON=$(PY) bash scripts/install_gpu_compiler.sh
	PYTHONPATH=$(abspath $(VENV))/jax-floor JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist worksteal $(ARGS)

setup: $(STAMP)

# The virtualenv's Python is >= 3.12 (jax 0.12): scripts/find_python.sh finds one (PYTHON=...
# names it) and stops with one line when there is none; an older virtualenv is replaced.
$(STAMP): $(DEPS)
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null || \
	  { rm -rf $(VENV) && py=$$(PYTHON=$(PYTHON) scripts/find_python.sh) && \
	    echo "creating $(VENV) with $$py" && $$py -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]" -c scripts/dev_constraints.txt
	PYTHON=$(PY) bash scripts/install_data_deps.sh
	PYTHON=$(PY) bash scripts/install_gpu_compiler.sh
	touch $(STAMP)

lint: setup
	$(PY) -m ruff check moejax experiments tests

clean-runs:
	rm -rf runs
