# The two commands the README leads with. Both create or update .venv first.
#   make serve   install and start the server on http://localhost:8080
#   make test    install with dev extras, then ruff, mypy and pytest
PYTHON ?= python3
VENV ?= .venv
# Install torch first so that the package's "torch>=2.4" never pulls a second one.
# On a CUDA machine set TORCH_SPEC to the build you want (or install it into .venv yourself).
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: venv install install-dev serve test lint typecheck pytest clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -e ".[dev]"
	touch $@

venv: $(PY)
install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

serve: install
	$(VENV)/bin/voice-out serve --config configs/default.toml $(SERVE_ARGS)

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install-dev
	$(VENV)/bin/mypy

pytest: install-dev
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
