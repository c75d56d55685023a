"""Serving section: the port is free and not in the kernel's ephemeral range, the TLS files, the tenants
file, and the readiness of a running server (``--url``: GET /healthz and /readyz)."""

from __future__ import annotations

import errno
import os
import socket
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from mcp2026.doctor import tls
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.result import CheckResult, failed, passed, skipped, warned
from mcp2026.serve.tenants import TenantRegistry

PROBE_TIMEOUT_S = 3.0
_LISTEN, _BOUND = "0A", "07"  # /proc/net/tcp socket states


# ---- port ------------------------------------------------------------------------------------------------
def port_holder(port: int) -> str | None:
    """'pid N (name)' of the process holding TCP ``port``, when /proc says (Linux, processes we may see)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if (
                len(fields) > 9
                and fields[3] in (_LISTEN, _BOUND)
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return f"pid {proc.name} ({(proc / 'comm').read_text().strip()})"
        except OSError:  # another user's process, or gone
            continue
    return None


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return None


def _reserved_ports() -> set[int]:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text().strip()
    except OSError:
        return set()
    ports: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        ports.update(range(int(low), int(high or low) + 1))
    return ports


def check_port(host: str, port: int) -> CheckResult:
    name = f"port {port}"
    where = f"{host}:{port}"
    if port == 0:
        return passed(name, "port 0: the OS picks a free port when the server starts")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        return failed(name, f"cannot resolve host {host!r} ({e})", "set host to an address of this machine")
    with socket.socket(family, kind, proto) as sock:
        # As uvicorn binds: SO_REUSEADDR, so a TIME_WAIT leftover of a stopped server is no conflict (a
        # listening or bound socket still is).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                holder = port_holder(port)
                return failed(
                    name,
                    f"{where} is in use" + (f" by {holder}" if holder else ""),
                    "stop what holds it, or choose another port (--port, or port: in the serve YAML)",
                    holder=holder,
                )
            if e.errno == errno.EACCES:
                return failed(name, f"{where}: binding a port below 1024 needs root", "use a port >= 1024")
            if e.errno == errno.EADDRNOTAVAIL:
                return failed(
                    name,
                    f"{host} is not an address of this machine",
                    "bind 127.0.0.1, 0.0.0.0 or a local address",
                )
            return failed(name, f"{where}: cannot bind ({e})", "choose another host or port")
    ephemeral = _ephemeral_range()
    if ephemeral and ephemeral[0] <= port <= ephemeral[1] and port not in _reserved_ports():
        return warned(
            name,
            f"{where} is free but inside the ephemeral range {ephemeral[0]}-{ephemeral[1]}: an outgoing "
            "connection may take it while the server is down",
            f"choose a port below {ephemeral[0]}, or add {port} to net.ipv4.ip_local_reserved_ports",
        )
    return passed(name, f"{where} is free (the API and /metrics share it)")


def check_serve_port(ctx: DoctorContext) -> CheckResult:
    if ctx.url and urlsplit(ctx.url).port == ctx.serve.port:
        return skipped(f"port {ctx.serve.port}", "held by the running server that --url probes")
    return check_port(ctx.serve.host, ctx.serve.port)


# ---- TLS -------------------------------------------------------------------------------------------------
def check_tls(ctx: DoctorContext) -> list[CheckResult]:
    serve = ctx.serve
    if serve.ssl_certfile is None or serve.ssl_keyfile is None:
        if not serve.is_loopback:
            return [
                warned(
                    "tls",
                    f"plain HTTP on {serve.host}: API keys and prompts cross the network unencrypted",
                    "set ssl_certfile and ssl_keyfile, or keep a TLS proxy in front",
                )
            ]
        return [skipped("tls", "not configured (plain HTTP on a loopback address)")]
    return tls.check_tls_files(Path(serve.ssl_certfile), Path(serve.ssl_keyfile), ctx.ca_bundle)


# ---- tenants ---------------------------------------------------------------------------------------------
def check_tenants(ctx: DoctorContext) -> CheckResult:
    name = "tenants"
    path = ctx.serve.tenants_file
    if path is None:
        if not ctx.serve.is_loopback:
            return warned(
                name,
                f"no tenants file: anyone who can reach {ctx.serve.host} can use the server",
                "set tenants_file (API keys -> tenants YAML)",
            )
        return skipped(name, "no tenants file: one open tenant on a loopback address")
    try:
        registry = TenantRegistry.from_yaml(path)
    except ValueError as e:
        return failed(name, str(e), "fix the tenants YAML (its format: src/mcp2026/serve/tenants.py)")
    names = sorted(registry.tenants)
    return passed(name, f"{path}: {len(names)} tenant(s): {', '.join(names)}", tenants=names)


# ---- readiness -------------------------------------------------------------------------------------------
def _message(response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def check_readiness(ctx: DoctorContext) -> CheckResult:
    name = "readiness"
    if not ctx.url:
        return skipped(name, "give --url http://host:port to probe a running server")
    base = ctx.url.rstrip("/")
    verify = ssl.create_default_context(cafile=str(ctx.ca_bundle)) if ctx.ca_bundle else True
    try:
        with httpx.Client(timeout=PROBE_TIMEOUT_S, verify=verify) as client:
            health = client.get(f"{base}/healthz")
            ready = client.get(f"{base}/readyz")
    except httpx.ConnectError as e:
        return failed(
            name,
            f"{base}: cannot connect ({e})",
            "start the server (mcp2026 serve), or check the host and port in --url",
        )
    except httpx.TimeoutException:
        return failed(
            name, f"{base}: no answer within {PROBE_TIMEOUT_S:g} s", "check the server's log and load"
        )
    except httpx.HTTPError as e:
        return failed(name, f"{base}: {type(e).__name__}: {e}", "check --url (http://host:port)")
    details = {"healthz": health.status_code, "readyz": ready.status_code}
    if health.status_code != 200:
        return failed(
            name,
            f"/healthz answered {health.status_code}: {_message(health)}",
            "the engine loop is down: read the server log and restart the server",
            **details,
        )
    if ready.status_code != 200:
        return warned(
            name,
            f"/healthz ok but /readyz answered {ready.status_code}: {_message(ready)}",
            "wait for the warm-up (or a drain) to finish and probe again",
            **details,
        )
    elapsed = (health.elapsed + ready.elapsed).total_seconds() * 1e3
    return passed(name, f"{base}: /healthz ok, /readyz ready ({elapsed:.0f} ms for both)", **details)
