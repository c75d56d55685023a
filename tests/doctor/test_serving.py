"""Serving checks: a port bound here is reported busy (with its holder), ephemeral ports warn, tenants
files parse or fail, and the readiness probe tells refused, unhealthy, warming and ready servers apart."""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mcp2026.doctor import serving
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.result import Status
from mcp2026.serve.config import ServeConfig


def _bound(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    return sock


def test_busy_port_fails_naming_the_port_and_holder():
    with _bound() as sock:
        sock.listen()
        port = sock.getsockname()[1]
        result = serving.check_port("127.0.0.1", port)
    assert result.status is Status.FAIL
    assert f"127.0.0.1:{port} is in use" in result.reason and "--port" in result.fix
    if os.path.exists("/proc/net/tcp"):
        assert result.details["holder"].startswith(f"pid {os.getpid()} ")


def test_free_port_passes_and_ephemeral_ports_warn(monkeypatch):
    with _bound() as sock:
        port = sock.getsockname()[1]
    monkeypatch.setattr(serving, "_ephemeral_range", lambda: (port + 1, port + 100))
    assert serving.check_port("127.0.0.1", port).status is Status.PASS
    monkeypatch.setattr(serving, "_ephemeral_range", lambda: (port - 10, port + 10))
    result = serving.check_port("127.0.0.1", port)
    assert result.status is Status.WARN and "ephemeral" in result.reason
    monkeypatch.setattr(serving, "_reserved_ports", lambda: {port})
    assert serving.check_port("127.0.0.1", port).status is Status.PASS


def test_bad_host_fails():
    result = serving.check_port("no-such-host.invalid", 8000)
    assert result.status is Status.FAIL and "no-such-host.invalid" in result.reason


def _ctx(**serve) -> DoctorContext:
    return DoctorContext(serve=ServeConfig(**serve))


def test_tenants_file(tmp_path):
    good = tmp_path / "tenants.yaml"
    good.write_text("tenants:\n  - name: acme\n    api_keys: [k1]\n  - name: beta\n    api_keys: [k2, k3]\n")
    result = serving.check_tenants(_ctx(tenants_file=str(good)))
    assert result.status is Status.PASS and result.details["tenants"] == ["acme", "beta"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - name: acme\n    weight: -1\n    api_keys: [k1]\n")
    result = serving.check_tenants(_ctx(tenants_file=str(bad)))
    assert result.status is Status.FAIL and "weight must be > 0" in result.reason
    assert serving.check_tenants(_ctx()).status is Status.SKIP
    assert serving.check_tenants(_ctx(host="0.0.0.0")).status is Status.WARN


def test_plain_http_off_loopback_warns():
    assert serving.check_tls(_ctx())[0].status is Status.SKIP
    assert serving.check_tls(_ctx(host="0.0.0.0"))[0].status is Status.WARN


class _Server:
    """A stand-in for `mcp2026 serve`'s probes: /healthz and /readyz answer with the given codes."""

    def __init__(self, health: int, ready: int) -> None:
        codes = {"/healthz": health, "/readyz": ready}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                code = codes.get(self.path, 404)
                body = {"status": "ok"} if code == 200 else {"error": {"message": f"{self.path} says no"}}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize(
    ("health", "ready", "status", "text"),
    [
        (200, 200, Status.PASS, "/readyz ready"),
        (200, 503, Status.WARN, "/readyz says no"),
        (503, 503, Status.FAIL, "/healthz says no"),
    ],
)
def test_readiness_probe(health, ready, status, text):
    server = _Server(health, ready)
    try:
        result = serving.check_readiness(DoctorContext(url=server.url + "/"))
    finally:
        server.close()
    assert result.status is status and text in result.reason


def test_readiness_probe_refused_and_not_asked():
    with _bound() as sock:
        port = sock.getsockname()[1]  # nothing listens there once closed
    result = serving.check_readiness(DoctorContext(url=f"http://127.0.0.1:{port}"))
    assert result.status is Status.FAIL and "cannot connect" in result.reason
    assert serving.check_readiness(DoctorContext()).status is Status.SKIP


def test_the_port_of_the_probed_server_is_not_reported_busy():
    ctx = DoctorContext(serve=ServeConfig(port=8123), url="http://127.0.0.1:8123")
    result = serving.check_serve_port(ctx)
    assert result.status is Status.SKIP and "--url" in result.reason
