# The two commands of the README:
#   make demo   set up everything needed (venv, packages, a tiny model) and run a demo
#   make test   same set-up, then lint, type check and the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
LMCACHE_VERSION ?= 0.5.6
DEMO_MODEL ?= models/tiny-llama
STAMP := $(VENV)/.kvferry-installed
# Without a GPU, take PyTorch's CPU build (a plain PyPI torch is a multi-GB CUDA build).
# Machines that carry a local CPU wheel in /opt/wheels use it through pip's find-links.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
LOCAL_CPU_TORCH := $(wildcard /opt/wheels/torch-$(TORCH_VERSION)+cpu*)
TORCH_INDEX ?= $(if $(HAS_GPU)$(LOCAL_CPU_TORCH),,--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: setup demo test lint typecheck unit bench chaos clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(TORCH_INDEX)
	$(BIN)/python -m pip install -q --no-deps "lmcache==$(LMCACHE_VERSION)"
	$(BIN)/python -m pip install -q -e ".[test,nixl,mooncake,lmcache]"
	bash scripts/system_deps.sh
	touch $(STAMP)

setup: $(STAMP)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(BIN)/kvferry make-tiny-model $(DEMO_MODEL) --arch llama

demo: $(STAMP) $(DEMO_MODEL)/config.json
	$(BIN)/kvferry generate --model $(DEMO_MODEL) --max-tokens 48 --ignore-eos --temperature 0 \
	  --prompt "The ferry crossed the river at dawn" \
	  --prompt "The ferry crossed the river at dawn, carrying" \
	  --prompt "A short note on caches:"

lint: $(STAMP)
	$(BIN)/ruff format --check kvferry tests benchmarks
	$(BIN)/ruff check kvferry tests benchmarks
	$(BIN)/lint-imports --no-cache --no-logo

typecheck: $(STAMP)
	$(BIN)/mypy kvferry

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests

test: lint typecheck unit

# The chaos suite's long profile (the short one runs in `make test`); then the table of
# docs/reliability.md from its results.
chaos: $(STAMP)
	KVFERRY_CHAOS_PROFILE=long $(BIN)/python -m pytest -q tests/chaos; status=$$?; \
	$(BIN)/python tests/chaos/report.py --profile long --write docs/reliability.md; \
	exit $$status

# Benchmarks (run on a quiet machine; results go to .bench/results, summaries to docs/)
bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/connector_bench.py

clean:
	rm -rf $(VENV) models .pytest_cache .mypy_cache .ruff_cache
