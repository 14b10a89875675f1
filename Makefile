# The two commands (see README): `make demo` runs the main job, `make test` runs the tests.
# Both create/refresh the virtualenv first; set-up is idempotent and skipped when up to date.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moejax-installed
DEPS   := pyproject.toml scripts/install_data_deps.sh
ARGS   ?=

.PHONY: demo test setup lint bench clean-runs

demo: setup
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m experiments.main $(ARGS)

test: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadfile $(ARGS)

setup: $(STAMP)

$(STAMP): $(DEPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	PYTHON=$(PY) bash scripts/install_data_deps.sh
	touch $(STAMP)

lint: setup
	$(PY) -m ruff check moejax experiments tests

clean-runs:
	rm -rf runs
