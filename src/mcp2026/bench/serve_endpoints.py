"""What the serving benchmark asks an endpoint over HTTP besides the load: its model id, whether a peer
answers, and our server's state from /metrics after a run.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from mcp2026.bench.kv_usage import prometheus_values
from mcp2026.bench.serve_config import PeerEndpoint, ServeBenchConfig


def discover_model(config: ServeBenchConfig) -> str:
    """The first model id the endpoint lists."""

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    response = httpx.get(f"{config.base_url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{config.base_url}/v1/models lists no model; pass the model name")
    return models[0]["id"]


def server_state(base_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Our server's engine after a run, from /metrics: waits up to ``timeout_s`` for it to go idle (no
    request running or waiting, no KV block held). ``idle`` False means something leaked or hangs."""

    names = {
        "mcp2026_num_requests_running": "num_running",
        "mcp2026_num_requests_waiting": "num_waiting",
        "mcp2026_kv_cache_usage_ratio": "kv_usage",
    }
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] = {}
    while True:
        values = prometheus_values(httpx.get(f"{base_url}/metrics", timeout=10).text, names)
        state.update({names[name]: value for name, value in values.items()})
        state["idle"] = len(state) == len(names) and not any(state[k] for k in names.values())
        if state["idle"] or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def probe_peer(peer: PeerEndpoint, timeout_s: float = 30.0) -> str:
    """The model id to send to ``peer``: its own, or the first its /v1/models lists. Raises an httpx error
    when it does not answer, ValueError when it answers without a model."""

    response = httpx.get(f"{peer.base_url}/v1/models", timeout=min(timeout_s, 10.0))
    response.raise_for_status()
    if peer.model:
        return peer.model
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{peer.base_url}/v1/models lists no model; pass --peer-model {peer.name}=MODEL")
    return models[0]["id"]
