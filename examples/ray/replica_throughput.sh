#!/usr/bin/env bash
# Throughput of N engine replicas on Ray Serve, each on its own CPU, behind the prefix-aware router: one
# `mcp2026 bench serve` run per N against the same ShareGPT requests. Run from the repository root with Ray
# installed (pip install 'mcp2026[ray]'); usage: examples/ray/replica_throughput.sh [N ...] (default: 1 2).
# Each replica gets one CPU (and so one torch thread): N replicas need N free cores to scale.
set -euo pipefail
counts=("$@")
[ ${#counts[@]} -eq 0 ] && counts=(1 2)
out=${OUT:-runs/ray-replicas}
prompts=${NUM_PROMPTS:-64}
mkdir -p "$out"
# the replicas' serve YAML: deploy/ray/serve.yaml's keys, with the SLO breaker off (a saturating benchmark would
# open it and shed requests, and the run compares throughput, not shedding)
engine_yaml="$PWD/$out/serve.yaml"
{ cat deploy/ray/serve.yaml; echo "breaker: {enabled: false}"; } > "$engine_yaml"
for n in "${counts[@]}"; do
  config="$out/ray-serve-$n.yaml"
  {
    echo "proxy_location: HeadOnly"
    echo "http_options: {host: 127.0.0.1, port: 8000}"
    echo "applications:"
    echo "  - name: mcp2026"
    echo "    route_prefix: /"
    echo "    import_path: mcp2026.serve.ray_ingress:build_app"
    echo "    args: {config: $engine_yaml, replicas: $n}"
    echo "    deployments:"
    echo "      - {name: router, num_replicas: 1, ray_actor_options: {num_cpus: 0}}"
    for ((i = 0; i < n; i++)); do
      echo "      - {name: engine-$i, num_replicas: 1, ray_actor_options: {num_cpus: 1}}"
    done
  } > "$config"
  serve run "$config" > "$out/serve-$n.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 300); do
    curl -sf http://127.0.0.1:8000/readyz > /dev/null && break
    kill -0 $server 2>/dev/null || { echo "serve run exited; see $out/serve-$n.log" >&2; exit 1; }
    sleep 1
  done
  curl -sf http://127.0.0.1:8000/readyz > /dev/null || { echo "replicas not ready in 300 s" >&2; exit 1; }
  mcp2026 bench serve --base-url http://127.0.0.1:8000 --workload sharegpt --num-prompts "$prompts" \
    --request-rate inf --max-concurrency 16 --seed 0 --no-progress --out "$out/replicas-$n"
  # the local cluster goes down with `ray stop`; `serve run` then exits (a background job ignores SIGINT)
  ray stop --force > /dev/null 2>&1 || true
  kill -TERM $server 2>/dev/null || true
  wait $server 2>/dev/null || true
done
