# Every target that runs project code depends on its venv, so a fresh clone needs nothing but
# `make run` or `make test`. An install re-runs only when pyproject.toml changes.
#
#   make run        the Trn1 / Trn2 / Trn3 example on the simulator: accuracy and modeled time
#   make test       lint and the whole suite on Python 3.11; the suite without the frameworks on 3.10
#   make bench      the benchmark's default sweep (nki-rmsnorm bench --help for the options)

# The interpreters: the first of python3.X on the path or pyenv's 3.X.* that runs.
find_python = $(shell for c in python$(1) $$HOME/.pyenv/versions/$(1).*/bin/python$(1); do \
	if "$$c" -c "import sys" >/dev/null 2>&1; then echo "$$c"; break; fi; done)
PYTHON311 ?= $(call find_python,3.11)
PYTHON310 ?= $(call find_python,3.10)

VENV      := .venv
VENV310   := .venv310
PYTHON    := $(VENV)/bin/python
PY310     := $(VENV310)/bin/python
PYTEST    := -m pytest -q -p no:cacheprovider
JOBS      ?= 2

# The 3.10 leg runs the whole suite without the frameworks: the simulator, the kernels in both
# dialects, the NumPy launchers and the bench, i.e. what a Trn1 / Inf2 user on a Python 3.10
# Neuron SDK (<= 2.29) venv runs under the frameworks. The binding tests skip there (their
# framework is not installed) and run on the 3.11 leg: PyPI has no CPU build of torch for 3.10
# (only the multi-GB CUDA one) and JAX's last 3.10 release (0.6.2) lacks
# jax.make_user_context, which the JAX binding needs.

.PHONY: venv venv310 run test test-311 test-310 lint bench clean

venv: $(VENV)/.installed
venv310: $(VENV310)/.installed

# make run needs only the package (NumPy, ml_dtypes): the same venv, without the frameworks
# and test tools unless make test installed them already.
$(VENV)/.core: pyproject.toml
	@test -n "$(PYTHON311)" || { echo "no Python 3.11 found: set PYTHON311=/path/to/python3.11" >&2; exit 1; }
	@test -x $(PYTHON) || $(PYTHON311) -m venv $(VENV)
	$(PYTHON) -m pip install -q -e .
	touch $@

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON311)" || { echo "no Python 3.11 found: set PYTHON311=/path/to/python3.11" >&2; exit 1; }
	@test -x $(PYTHON) || $(PYTHON311) -m venv $(VENV)
	# The CPU torch wheel first: the package's torch extra is a range, and a torch range with
	# no torch installed resolves to a CUDA build (gigabytes of nvidia-* wheels and triton).
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[test,torch,jax,flax,equinox,bench,hf]'
	touch $@

$(VENV310)/.installed: pyproject.toml
	@test -n "$(PYTHON310)" || { echo "no Python 3.10 found: set PYTHON310=/path/to/python3.10" >&2; exit 1; }
	@test -x $(PY310) || $(PYTHON310) -m venv $(VENV310)
	$(PY310) -m pip install -q -e '.[test]'
	touch $@

run: $(VENV)/.core
	$(PYTHON) examples/quickstart.py

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# Both legs run even when the first fails; the target fails if either did.
test:
	@status=0; \
	$(MAKE) --no-print-directory test-311 || status=1; \
	$(MAKE) --no-print-directory test-310 || status=1; \
	exit $$status

test-311: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PYTHON) $(PYTEST) -n $(JOBS)

test-310: venv310
	$(PY310) $(PYTEST) -n $(JOBS)

bench: venv
	$(VENV)/bin/nki-rmsnorm bench

clean:
	rm -rf $(VENV) $(VENV310) build dist *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
