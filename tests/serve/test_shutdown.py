"""SIGTERM handling: drain lets in-flight requests finish while new ones get 503; abort ends them with
finish_reason "abort". Both end every stream with [DONE] and stop the server."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from serve_helpers import live_server

from mcp2026.serve.config import ServeConfig

STREAM = {"model": "tiny", "prompt": [9] * 20, "max_tokens": 120, "ignore_eos": True, "stream": True}


@pytest.mark.parametrize("drain", [True, False])
def test_sigterm_drains_or_aborts(drain):
    config = ServeConfig(model_name="tiny", drain_on_sigterm=drain)
    with live_server(config, speculative="off") as live:  # cut short by the clock
        events, status = [], {}

        def stream():
            with httpx.stream("POST", f"{live.url}/v1/completions", json=STREAM, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            started.set()

        started = threading.Event()
        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(10)
        live.server.handle_exit(signal.SIGTERM, None)
        if drain:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and "new" not in status:
                r = httpx.post(f"{live.url}/v1/completions", json={**STREAM, "stream": False}, timeout=5)
                if live.async_engine.num_in_flight:
                    status["new"] = r.status_code
            assert status["new"] == 503
        thread.join(30)
        assert events[-1] == "[DONE]"
        final = json.loads(events[-2])["choices"][0]
        if drain:
            assert final["finish_reason"] == "length"
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            assert text  # streamed to the end
        else:
            assert final["finish_reason"] == "abort"
        deadline = time.monotonic() + 10
        while not live.server.should_exit and time.monotonic() < deadline:
            time.sleep(0.02)
        assert live.server.should_exit and not live.async_engine.is_alive
        live.wait_blocks_back()
