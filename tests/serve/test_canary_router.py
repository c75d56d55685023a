"""The live canary inside one server: sticky routing per tenant to a second engine, per-arm latencies, and the
verdict on /metrics and GET /canary (tiny random models, the ASGI app in-process)."""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from mcp2026.canary.config import CanaryConfig
from mcp2026.config import EngineConfig, KVConfig, ModelConfig
from mcp2026.engine.async_engine import AsyncEngine
from mcp2026.engine.engine import LLMEngine
from mcp2026.serve.app import create_app
from mcp2026.serve.canary import REFRESH_S, CanaryRouter
from mcp2026.serve.config import ServeConfig
from mcp2026.serve.tenants import Tenant, TenantRegistry

from conftest import tiny_random_model

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "tiny"
NUM_TENANTS = 16


@functools.cache
def tiny_model() -> tuple[torch.nn.Module, ModelConfig]:
    return tiny_random_model()


def engine(model: torch.nn.Module | None = None) -> AsyncEngine:
    tiny, config = tiny_model()
    kv = EngineConfig(KVConfig(block_size=16, num_blocks=64))
    return AsyncEngine(LLMEngine(model or tiny, config, None, kv))


def router(config: CanaryConfig, candidate: AsyncEngine | None = None, clock=time.monotonic) -> CanaryRouter:
    return CanaryRouter(
        engine(),
        candidate or engine(),
        config,
        baseline_weight_bytes=1_000_000,
        candidate_weight_bytes=500_000,
        peak_bytes_per_s=10e9,
        candidate_label="b.yaml",
        clock=clock,
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


# ---- the traffic ramp: the verdict moves the candidate's share -------------------------------------------
class Clock:
    """The ramp's evaluation clock, moved by the test instead of waiting."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def safe_accuracy_report(tmp_path: Path) -> Path:
    row = {"name": "ppl_change", "kind": "accuracy", "value": -0.05, "low": -0.1, "high": 0.0, "unit": "%",
           "num_samples": 32}  # fmt: skip
    path = tmp_path / "canary.json"
    path.write_text(json.dumps({"metrics": [row]}))
    return path


def served_tenants(canary: CanaryRouter) -> dict[str, dict[str, int]]:
    return {a.name: dict(a.engine.stats.tenant_tokens) for a in (canary.baseline, canary.candidate)}


def one_round(client: TestClient, canary: CanaryRouter, max_tokens: int = 4) -> dict[str, set[str]]:
    """Every tenant sends one request; which tenants each arm served in this round."""
    before = served_tenants(canary)
    for i in range(NUM_TENANTS):
        body = {"model": MODEL, "prompt": [5 + i, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0}
        r = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer key-{i}"})
        assert r.status_code == 200, r.text
    after = served_tenants(canary)
    return {arm: {t for t, n in after[arm].items() if t and n > before[arm].get(t, 0)} for arm in after}


def metric(text: str, name: str, **labels: str) -> float:
    where = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "model": MODEL}.items()))
    found = re.search(rf"^{name}\{{{re.escape(where)}\}} (\S+)$", text, re.MULTILINE)
    assert found, f"{name}{{{where}}} not in /metrics"
    return float(found.group(1))


def test_promotes_walk_the_share_up_the_ramp_keeping_tenants_sticky(tmp_path, caplog):
    loose = {"latency_safe_ms": 1e6, "latency_trip_ms": 2e6, "min_samples": 2}
    config = CanaryConfig.from_mapping(
        {
            **loose,
            "ramp": [0.25, 0.5, 1.0],
            "evaluate_every_s": 30,
            "offline_report": str(safe_accuracy_report(tmp_path)),
        }
    )
    clock = Clock()
    canary = router(config, clock=clock)
    expected = {share: {f"t{i}" for i in range(NUM_TENANTS) if canary.share_of(f"tenant:t{i}") < share}
                for share in (0.25, 0.5, 1.0)}  # fmt: skip
    assert 2 <= len(expected[0.25]) < len(expected[0.5]) < NUM_TENANTS  # each step moves some tenants
    everyone = {f"t{i}" for i in range(NUM_TENANTS)}
    caplog.set_level("INFO", logger="mcp2026.serve")
    with serve(canary, tenants()) as client:
        wait_candidate_ready(canary)
        for step, share in enumerate((0.25, 0.5, 1.0)):
            served = one_round(client, canary)
            clock.now_s += REFRESH_S  # the verdict is recomputed at most this often
            # stickiness: exactly the tenants hashed below the share, so earlier candidate tenants stay there
            assert served["candidate"] == expected[share]
            assert served["baseline"] == everyone - expected[share]
            status = client.get("/canary").json()
            assert status["verdict"] == "PROMOTE", (step, status["metrics"])
            assert status["candidate_share"] == share  # not due yet
            clock.now_s += 30
            status = client.get("/canary").json()
            assert len(status["ramp"]["shifts"]) == min(step + 1, 2)
            if share < 1.0:
                assert status["ramp"]["shifts"][-1]["from_share"] == share
            if status["candidate_share"] < 1.0:  # the next step is judged on its own requests
                assert status["arms"]["candidate"]["window"] == status["arms"]["baseline"]["window"] == 0
        assert status["candidate_share"] == 1.0 and status["ramp"]["state"] == "promoted"
        assert [s["to_share"] for s in status["ramp"]["shifts"]] == [0.5, 1.0]
        assert {s["verdict"] for s in status["ramp"]["shifts"]} == {"PROMOTE"}
        assert status["ramp"]["evaluations"] == {"PROMOTE": 2, "HOLD": 0, "ROLLBACK": 0}
        text = client.get("/metrics").text
        assert metric(text, "mcp2026_canary_candidate_share") == 1.0
        assert metric(text, "mcp2026_canary_state", state="promoted") == 1.0
        assert metric(text, "mcp2026_canary_state", state="ramping") == 0.0
        assert metric(text, "mcp2026_canary_shifts_total", decision="PROMOTE") == 2
        assert metric(text, "mcp2026_canary_shifts_total", decision="ROLLBACK") == 0
        assert metric(text, "mcp2026_canary_evaluations_total", verdict="PROMOTE") == 2
    shifts = [r.getMessage() for r in caplog.records if "candidate share" in r.getMessage()]
    assert len(shifts) == 2
    assert shifts[0].startswith(
        "canary: candidate share 0.25 -> 0.5 (PROMOTE: every metric safe: p99_ttft_change"
    )
    assert shifts[1].startswith("canary: candidate share 0.5 -> 1 (PROMOTE:")


def slow_candidate(delay_s: float) -> tuple[AsyncEngine, threading.Event]:
    """The same weights with every forward pass delayed once the event is set (after its warm-up): a
    candidate clearly worse in latency."""
    model, is_slow = copy.deepcopy(tiny_model()[0]), threading.Event()

    def delay(_module: torch.nn.Module, _args: tuple) -> None:
        if is_slow.is_set():
            time.sleep(delay_s)

    model.register_forward_pre_hook(delay)
    return engine(model), is_slow


def test_a_clearly_slower_candidate_is_rolled_back_to_zero(caplog):
    tight = {"latency_safe_ms": 5, "latency_trip_ms": 10, "min_samples": 3}
    config = CanaryConfig.from_mapping({**tight, "ramp": [0.5, 1.0], "evaluate_every_s": 10})
    clock = Clock()
    candidate, is_slow = slow_candidate(0.2)
    canary = router(config, candidate, clock)
    caplog.set_level("INFO", logger="mcp2026.serve")
    with serve(canary, tenants()) as client:
        wait_candidate_ready(canary)
        is_slow.set()
        served = one_round(client, canary, max_tokens=1)
        assert len(served["candidate"]) >= 3 and len(served["baseline"]) >= 3
        assert client.get("/canary").json()["candidate_share"] == 0.5  # evidence, but not due yet
        clock.now_s += 10
        status = client.get("/canary").json()
        assert status["candidate_share"] == 0.0 and status["ramp"]["state"] == "rolled_back"
        (shift,) = status["ramp"]["shifts"]
        assert (shift["from_share"], shift["to_share"], shift["verdict"]) == (0.5, 0.0, "ROLLBACK")
        assert "p99_" in shift["reason"] and "> trip +10" in shift["reason"]
        num_candidate = canary.candidate.num_finished
        served = one_round(client, canary, max_tokens=1)
        assert served["candidate"] == set() and len(served["baseline"]) == NUM_TENANTS  # everyone back
        assert canary.candidate.num_finished == num_candidate
        clock.now_s += 100
        assert client.get("/canary").json()["ramp"]["shifts"] == [shift]  # no more evaluations
        text = client.get("/metrics").text
        assert metric(text, "mcp2026_canary_candidate_share") == 0.0
        assert metric(text, "mcp2026_canary_state", state="rolled_back") == 1.0
        assert metric(text, "mcp2026_canary_shifts_total", decision="ROLLBACK") == 1
    (line,) = [r.getMessage() for r in caplog.records if "candidate share" in r.getMessage()]
    assert line.startswith("canary: candidate share 0.5 -> 0 (ROLLBACK: p99_")


def test_a_dead_candidate_is_rolled_back_at_once():
    config = CanaryConfig.from_mapping({"ramp": [0.5, 1.0], "evaluate_every_s": 3600})
    canary = router(config, clock=Clock())
    with serve(canary, tenants()) as client:
        wait_candidate_ready(canary)
        assert one_round(client, canary)["candidate"]
        canary.candidate.engine.dead_error = "RuntimeError: boom"  # what the loop sets when it dies
        served = one_round(client, canary)  # no evaluation interval, no samples needed
        assert served["candidate"] == set() and len(served["baseline"]) == NUM_TENANTS
        status = client.get("/canary").json()
        assert status["candidate_share"] == 0.0 and status["ramp"]["state"] == "rolled_back"
        assert status["ramp"]["shifts"][0]["reason"] == "the candidate engine died: RuntimeError: boom"
        canary.candidate.engine.dead_error = None  # ready again: the rollback still holds
        assert one_round(client, canary)["candidate"] == set()


def test_without_a_ramp_the_share_stays_fixed():
    clock = Clock()
    canary = router(CanaryConfig(candidate_share=0.3), clock=clock)  # today's configs: observe only
    for _ in range(30):
        canary.baseline.observe("stop", 0.01, 0.02)
        canary.candidate.observe("stop", 5.0, 6.0)  # seconds slower: the verdict trips
    clock.now_s += 1e6
    assert canary.tick() is None
    assert canary.status()["verdict"] == "ROLLBACK"
    canary.candidate.engine.dead_error = "RuntimeError: boom"
    assert canary.tick() is None
    assert (canary.ramp.share, canary.ramp.state, canary.ramp.shifts) == (0.3, "observing", [])
    status = canary.status()
    assert status["candidate_share"] == 0.3 and status["ramp"]["state"] == "observing"
