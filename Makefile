# Two commands for a fresh machine: `make demo` (the offline demo) and `make test` (the test-suite).
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch (resolved from a local wheel on our machines). Override for a CUDA box,
# e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
TORCH_SPEC ?= torch==2.13.0
CONSTRAINTS ?= .ci/constraints.txt
STAMP := $(VENV)/.trl_fp8_installed
DEMO_DIR ?= trl_fp8_demo

.PHONY: demo test install bench clean

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(VENV)/bin/python -m pip install --quiet -c $(CONSTRAINTS) -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trl-fp8 demo --output-dir $(DEMO_DIR)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) runs .pytest_cache
