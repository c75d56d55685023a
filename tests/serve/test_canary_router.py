"""The live canary inside one server: sticky routing per tenant to a second engine, per-arm latencies, and the
verdict on /metrics and GET /canary (tiny random models, the ASGI app in-process)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from mcp2026.canary.config import CanaryConfig
from mcp2026.config import EngineConfig, KVConfig, ModelConfig
from mcp2026.engine.async_engine import AsyncEngine
from mcp2026.engine.engine import LLMEngine
from mcp2026.serve.app import create_app
from mcp2026.serve.canary import CanaryRouter
from mcp2026.serve.config import ServeConfig
from mcp2026.serve.tenants import Tenant, TenantRegistry

from conftest import tiny_random_model

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "tiny"
NUM_TENANTS = 16


@functools.cache
def tiny_model() -> tuple[torch.nn.Module, ModelConfig]:
    return tiny_random_model()


def engine() -> AsyncEngine:
    model, config = tiny_model()
    return AsyncEngine(LLMEngine(model, config, None, EngineConfig(KVConfig(block_size=16, num_blocks=64))))


def router(config: CanaryConfig) -> CanaryRouter:
    return CanaryRouter(
        engine(),
        engine(),
        config,
        baseline_weight_bytes=1_000_000,
        candidate_weight_bytes=500_000,
        peak_bytes_per_s=10e9,
        candidate_label="b.yaml",
    )


def tenants() -> TenantRegistry:
    return TenantRegistry({f"key-{i}": Tenant(f"t{i}") for i in range(NUM_TENANTS)})


def complete(client: TestClient, key: str, i: int) -> None:
    body = {"model": MODEL, "prompt": [5 + i % 50, 6, 7, 8], "max_tokens": 4, "temperature": 0}
    r = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text


def serve(canary: CanaryRouter | None, registry: TenantRegistry | None = None) -> TestClient:
    baseline = canary.baseline.engine if canary is not None else engine()
    app = create_app(baseline, None, ServeConfig(model_name=MODEL), registry, canary=canary)
    return TestClient(app)


def wait_candidate_ready(canary: CanaryRouter) -> None:
    """Both arms warmed up (the server answers 503 "not ready yet" before that; a busy CI machine can take a
    while, so the deadline is generous and the wait ends as soon as both are ready)."""
    import time

    deadline = time.monotonic() + 60
    arms = (canary.baseline.engine, canary.candidate.engine)
    while not all(e.is_ready for e in arms) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(e.is_ready for e in arms)


def test_routing_is_sticky_per_tenant_and_follows_the_share():
    canary = router(CanaryConfig(candidate_share=0.5))
    with serve(canary, tenants()) as client:
        wait_candidate_ready(canary)
        for round_ in range(2):
            for i in range(NUM_TENANTS):
                complete(client, f"key-{i}", round_ * NUM_TENANTS + i)
        served = {
            arm.name: set(arm.engine.stats.tenant_tokens) - {None}
            for arm in (canary.baseline, canary.candidate)
        }
        expected = {f"t{i}" for i in range(NUM_TENANTS) if canary.share_of(f"tenant:t{i}") < 0.5}
        assert served["candidate"] == expected  # the hash decides, every time
        assert served["baseline"] == {f"t{i}" for i in range(NUM_TENANTS)} - expected
        assert 0 < len(expected) < NUM_TENANTS
        assert canary.baseline.num_finished + canary.candidate.num_finished == 2 * NUM_TENANTS
        assert canary.candidate.num_finished == 2 * len(expected)

        status = client.get("/canary").json()
        assert status["candidate"] == "b.yaml" and status["candidate_share"] == 0.5
        assert status["arms"]["candidate"]["num_finished"] == 2 * len(expected)
        metrics = {m["name"]: m for m in status["metrics"]}
        accuracy = metrics["ppl_change"]
        assert accuracy["status"] == "hold" and "not measured live" in accuracy["reason"]
        assert status["verdict"] in ("HOLD", "ROLLBACK")  # never PROMOTE without an accuracy measurement
        assert metrics["p99_ttft_change"]["num_samples"] == min(
            canary.baseline.num_finished, canary.candidate.num_finished
        )
        assert status["bandwidth"]["candidate"]["decode_steps"] > 0

        text = client.get("/metrics").text
        verdict = re.findall(r'mcp2026_canary_verdict\{model="tiny",verdict="(\w+)"\} 1\.0', text)
        assert verdict == [status["verdict"]]
        count = re.search(r'mcp2026_canary_requests_total\{arm="candidate",model="tiny"\} (\S+)', text)
        assert float(count.group(1)) == canary.candidate.num_finished
        assert 'mcp2026_canary_p99_seconds{arm="baseline",latency="ttft",model="tiny"}' in text
        assert 'mcp2026_canary_time_to_first_token_seconds_count{arm="candidate",model="tiny"}' in text


def test_open_tenant_routes_by_api_key_then_client_host():
    canary = router(CanaryConfig(candidate_share=0.5))
    open_tenant = Tenant("default")
    assert canary.sticky_key(open_tenant, "sk-1", "10.0.0.1", is_open=True) == "key:sk-1"
    assert canary.sticky_key(open_tenant, None, "10.0.0.1", is_open=True) == "host:10.0.0.1"
    assert canary.sticky_key(Tenant("acme"), "sk-1", "10.0.0.1", is_open=False) == "tenant:acme"
    keys = [f"key:{i}" for i in range(400)]
    share = sum(canary.share_of(k) < 0.5 for k in keys) / len(keys)
    assert 0.4 < share < 0.6
    salted = router(CanaryConfig(candidate_share=0.5, salt="other"))
    assert [canary.share_of(k) for k in keys[:20]] != [salted.share_of(k) for k in keys[:20]]


def test_not_ready_candidate_sends_its_share_to_the_baseline():
    canary = router(CanaryConfig(candidate_share=0.99))  # never started: not ready
    assert canary.route("tenant:anyone") is canary.baseline


def test_offline_accuracy_lets_the_live_verdict_promote(tmp_path):
    report = {
        "metrics": [
            {"name": "ppl_change", "kind": "accuracy", "value": -0.05, "low": -0.1, "high": 0.0,
             "unit": "%", "num_samples": 32}
        ]
    }  # fmt: skip
    path = tmp_path / "canary.json"
    path.write_text(json.dumps(report))
    loose = {"latency_safe_ms": 1e6, "latency_trip_ms": 2e6, "min_samples": 2}
    config = CanaryConfig.from_mapping({**loose, "candidate_share": 0.5, "offline_report": str(path)})
    canary = router(config)
    with serve(canary, tenants()) as client:
        wait_candidate_ready(canary)
        for i in range(NUM_TENANTS):
            complete(client, f"key-{i}", i)
        status = client.get("/canary").json()
        assert status["accuracy_source"] == str(path)
        assert {m["name"]: m["status"] for m in status["metrics"]} == {
            "p99_ttft_change": "safe",
            "p99_e2e_change": "safe",
            "ppl_change": "safe",
            "bandwidth_utilisation": "safe",
        }
        assert status["verdict"] == "PROMOTE"
        canary.candidate.engine.dead_error = "RuntimeError: boom"  # what the loop sets when it dies
        status = client.get("/canary").json()
        assert status["verdict"] == "ROLLBACK" and "boom" in status["reason"]
        canary.candidate.engine.dead_error = None


def test_bad_offline_report_fails_at_startup(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not an offline canary report"):
        router(CanaryConfig(offline_report=str(tmp_path / "x.json")))
    with pytest.raises(FileNotFoundError, match="offline canary report not found"):
        router(CanaryConfig(offline_report=str(tmp_path / "missing.json")))


def test_without_a_canary_the_route_says_so():
    with serve(None) as client:
        r = client.get("/canary")
        assert r.status_code == 404
        assert "--canary-config" in r.json()["error"]["message"]
        assert "mcp2026_canary" not in client.get("/metrics").text


def test_serve_builds_the_candidate_from_its_yaml(tmp_path, tiny_llama_dir):
    from mcp2026.serve.config import load_serve_yaml
    from mcp2026.serve.server import build_server

    (tmp_path / "q8.yaml").write_text("target_precision: int8\ngranularity: per_channel\n")
    kv = "kv: {num_blocks: 32}\nwarmup: false\n"
    (tmp_path / "b.yaml").write_text(f"model: {tiny_llama_dir}\nquant: q8.yaml\n{kv}")
    a = tmp_path / "a.yaml"
    a.write_text(f"model: {tiny_llama_dir}\n{kv}canary:\n  candidate: b.yaml\n  candidate_share: 0.5\n")
    server = build_server(*load_serve_yaml(a))
    canary = server.config.app.state.canary
    assert canary.candidate_label == str(tmp_path / "b.yaml")
    assert canary.candidate.weight_bytes < canary.baseline.weight_bytes  # int8 linears
    with TestClient(server.config.app) as client:
        wait_candidate_ready(canary)
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        for host in range(12):
            r = client.post("/v1/completions", json=body, headers={"X-Api-Key": f"client-{host}"})
            assert r.status_code == 200, r.text
        assert canary.candidate.num_finished > 0 and canary.baseline.num_finished > 0
        assert canary.candidate.num_finished + canary.baseline.num_finished == 12


def test_candidate_with_a_shorter_context_is_refused(tmp_path, tiny_llama_dir):
    from mcp2026.serve.config import load_serve_yaml
    from mcp2026.serve.server import build_server

    kv = "kv: {num_blocks: 32}\n"
    (tmp_path / "b.yaml").write_text(f"model: {tiny_llama_dir}\n{kv}scheduler: {{max_model_len: 64}}\n")
    a = tmp_path / "a.yaml"
    a.write_text(f"model: {tiny_llama_dir}\n{kv}canary: {{candidate: b.yaml}}\n")
    with pytest.raises(ValueError, match=r"context \(64 tokens\) is shorter"):
        build_server(*load_serve_yaml(a))


def test_live_path_resolution_points_at_the_yaml_folder(tmp_path):
    config = CanaryConfig.from_mapping({"candidate": "b.yaml"}).with_paths_under(tmp_path)
    assert Path(config.candidate) == tmp_path / "b.yaml"


def test_a_missing_candidate_fails_before_any_model_loads(tmp_path):
    from mcp2026.serve.config import load_serve_yaml
    from mcp2026.serve.server import build_server

    a = tmp_path / "a.yaml"
    a.write_text("model: no-such-model\ncanary: {candidate: missing.yaml}\n")  # the model is never looked for
    with pytest.raises(FileNotFoundError, match="missing.yaml: no such configuration file"):
        build_server(*load_serve_yaml(a))
