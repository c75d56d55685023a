"""Clients that leave, floods that time out, injected faults, a dead engine loop: the server frees every
KV block, keeps answering, and reports failures in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from serve_helpers import live_server

MODEL = "tiny"
LONG = {"model": MODEL, "prompt": [7] * 40, "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def sse_events(r: httpx.Response) -> list:
    events = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_disconnect_mid_stream_frees_blocks():
    with live_server(speculative="off") as live, httpx.Client(base_url=live.url, timeout=30) as client:
        free_before = live.engine.kv_manager.num_free_blocks
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert live.engine.kv_manager.num_free_blocks < free_before  # it holds blocks now
        # The response is closed after one chunk: the request must be aborted, not run to 400 tokens.
        live.wait_blocks_back(timeout_s=5)
        assert (
            live.engine.kv_manager.pool.num_free_blocks + live.engine.kv_manager.num_evictable_blocks
            == free_before
        )
        assert live.async_engine.num_in_flight == 0


def test_flood_of_timed_out_clients_then_fresh_request():
    async def flood(url: str) -> int:
        async with httpx.AsyncClient(base_url=url, timeout=0.5) as client:

            async def request(i: int) -> None:
                body = {**LONG, "prompt": [7 + i] * 40, "stream": i % 2 == 0}
                if body["stream"]:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass
                else:
                    await client.post("/v1/completions", json=body)

            async def one(i: int) -> str:
                try:  # the whole request, stream included, is cut at 0.5 s
                    await asyncio.wait_for(request(i), 0.5)
                except (httpx.TimeoutException, asyncio.TimeoutError):
                    return "timeout"
                return "done"

            results = await asyncio.gather(*(one(i) for i in range(50)))
        return results.count("timeout")

    with live_server(speculative="off") as live:
        assert asyncio.run(flood(live.url)) >= 45
        t0 = time.monotonic()
        r = httpx.post(
            f"{live.url}/v1/completions",
            json={"model": MODEL, "prompt": "fresh", "max_tokens": 4},
            timeout=10,
        )
        assert r.status_code == 200 and time.monotonic() - t0 < 5
        live.wait_blocks_back(timeout_s=10)
        assert live.async_engine.num_queued_requests == 0 and live.async_engine.num_queued_tokens == 0


MARKER = 777  # prompts containing this token fail inside the engine


def test_fault_fails_only_its_request():
    def fault(chunk):
        if MARKER in chunk.token_ids:
            raise RuntimeError("injected fault")

    with live_server(speculative="off") as live, httpx.Client(base_url=live.url, timeout=30) as client:
        live.engine.fault_hook = fault
        results = {}

        def good(i: int) -> None:
            body = {"model": MODEL, "prompt": [20 + i] * 10, "max_tokens": 30, "ignore_eos": True}
            results[i] = client.post("/v1/completions", json=body)

        threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        bad = {"model": MODEL, "prompt": [MARKER, 5, 6], "max_tokens": 30}
        r = client.post("/v1/completions", json=bad)
        assert r.status_code == 500
        error = r.json()["error"]
        assert "injected fault" in error["message"] and error["type"] == "server_error"
        with client.stream("POST", "/v1/completions", json={**bad, "stream": True}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert "injected fault" in events[-2]["error"]["message"]
        for t in threads:
            t.join(30)
        assert [results[i].status_code for i in range(3)] == [200] * 3
        assert all(results[i].json()["choices"][0]["finish_reason"] == "length" for i in range(3))
        assert live.async_engine.is_alive
        live.wait_blocks_back()


def test_dead_engine_loop_fails_health_and_readiness():
    with live_server(speculative="off") as live, httpx.Client(base_url=live.url, timeout=30) as client:
        assert client.get("/healthz").status_code == 200

        def broken_step():
            raise RuntimeError("loop bug")

        live.engine.step = broken_step
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert r.status_code == 503 and "loop bug" in r.json()["error"]["message"]
        for path in ("/healthz", "/readyz"):
            r = client.get(path)
            assert r.status_code == 503 and r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert r.status_code == 503


def test_client_timeout_non_stream_aborts():
    # 400 steps of at least 20 ms outlast both the client's 0.3 s and the 5 s wait: the blocks come back only
    # if the server aborts the request when its client goes away
    with live_server(speculative="off", step_delay_s=0.02) as live:
        with pytest.raises(httpx.TimeoutException), httpx.Client(base_url=live.url, timeout=0.3) as client:
            client.post("/v1/completions", json=LONG)
        live.wait_blocks_back(timeout_s=5)
