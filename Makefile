PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint fuzz bench clean graphviz chromium

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[test,torch,ray,openvino]"
	touch $(STAMP)

# System packages, installed when missing (as root, with apt-get): Graphviz lays out the
# report page's graph (without it the page uses its own simpler layout); Chromium runs the
# browser tests headless (without it they are skipped, saying why).
APT_INSTALL = DEBIAN_FRONTEND=noninteractive apt-get install -y -qq
graphviz:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && $(APT_INSTALL) graphviz >/dev/null) || echo "note: graphviz could not be installed"; \
	  else echo "note: graphviz not installed (needs root and apt-get): reports use the simple layout"; fi; }

chromium:
	@test -x /usr/bin/chromium || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && $(APT_INSTALL) chromium >/dev/null) || echo "note: chromium could not be installed"; \
	  else echo "note: chromium not installed (needs root and apt-get): browser tests will skip"; fi; }

demo: $(STAMP) graphviz
	$(BIN)/python examples/make_demo_model.py demo-out/demo_fp32.onnx
	$(BIN)/mixprec convert demo-out/demo_fp32.onnx -o demo-out/demo_fp16.onnx --dtype fp16 --validate \
	  --report demo-out/demo_report.html

test: $(STAMP) graphviz chromium
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
