PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint fuzz bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[test,torch]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/make_demo_model.py demo-out/demo_fp32.onnx
	$(BIN)/mixprec convert demo-out/demo_fp32.onnx -o demo-out/demo_fp16.onnx --dtype fp16 --validate

test: $(STAMP)
	$(BIN)/python -m ruff check src tests
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/python -m ruff check src tests bench
	$(BIN)/python -m ruff format --check src tests
	$(BIN)/python -m mypy

# A fuzz campaign: FUZZ_CASES cases round robin over the mutations from seed FUZZ_SEED,
# counts per mutation and outcome and the defects by cause at the end (tests/fuzz).
FUZZ_CASES ?= 1200
FUZZ_SEED ?= 1000
fuzz: $(STAMP)
	$(BIN)/python -m tests.fuzz --cases $(FUZZ_CASES) --seed $(FUZZ_SEED)

bench:
	bash bench/run.sh

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache
