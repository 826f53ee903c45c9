# Every target that runs project code depends on `venv`, so a fresh clone needs nothing but
# `make bench` or `make test`. The install re-runs only when pyproject.toml changes.

VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@if [ ! -x $(PYTHON) ]; then \
		if command -v python3.11 >/dev/null 2>&1; then python3.11 -m venv $(VENV); \
		else python3 -m venv $(VENV); fi; \
	fi
	# The CPU torch wheel first: the package's torch extra is unpinned, and an unpinned torch
	# resolves to a CUDA build elsewhere (gigabytes of nvidia-* wheels and triton).
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[test,torch,jax,flax,equinox,bench,hf]'
	touch $@

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PYTHON) -m pytest -n 2 -q

bench: venv
	$(VENV)/bin/nki-rmsnorm bench

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
