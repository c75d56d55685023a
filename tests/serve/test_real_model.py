"""`mcp2026 serve` as a real process on the default model: the openai client end to end, then SIGTERM
drains the in-flight stream and the process exits cleanly with no child left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import free_port

pytestmark = pytest.mark.slow


def _wait_in_flight(url: str, timeout_s: float = 30.0) -> None:
    """Until the engine holds a request (running or waiting): a SIGTERM before that has nothing to drain, and a
    request that reaches the engine after the drain finds it stopped."""
    deadline = time.monotonic() + timeout_s
    names = ("mcp2026_num_requests_running", "mcp2026_num_requests_waiting")
    while time.monotonic() < deadline:
        lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
        if any(float(line.split()[-1]) for line in lines if line.startswith(names)):
            return
        time.sleep(0.05)
    raise AssertionError(f"no request reached the engine within {timeout_s} s")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_serve_cli_real_model(tmp_path):
    port = free_port()
    (tmp_path / "serve.yaml").write_text(
        f"port: {port}\nmodel_name: smol\ndtype: fp32\ndrain_on_sigterm: true\nkv:\n  num_blocks: 512\n"
        # the drain finishes the stream, however slow a loaded machine makes its 64 tokens
        "drain_timeout_s: 120\n"
    )
    cmd = [
        sys.executable,
        "-c",
        "from mcp2026.cli import main; main()",
        "serve",
        "--config",
        str(tmp_path / "serve.yaml"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["smol"]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        full = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0)
        text = full.choices[0].message.content
        assert "Paris" in text
        chunks = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=24, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
        comp = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
        streamed = client.completions.create(
            model="smol", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == comp.choices[0].text

        # SIGTERM while a stream runs: it finishes, then the process exits 0.
        reasons = []

        def stream() -> None:
            s = client.completions.create(
                model="smol",
                prompt="Once upon a time",
                max_tokens=64,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            reasons.extend(c.choices[0].finish_reason for c in s if c.choices)

        thread = threading.Thread(target=stream)
        thread.start()
        _wait_in_flight(url)
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        thread.join(60)
        assert reasons[-1] == "length"
        assert proc.wait(30) == 0
        assert not [c for c in children if Path(f"/proc/{c}").exists()]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
