"""Start-up and memory under sustained load: ``mcp2026 serve`` launched as its own process, the seconds until
``/readyz`` answers, then ShareGPT streams for a long while (a share of clients hanging up mid-stream and a
share of malformed requests), the server's resident memory sampled all along. A server whose SLO breaker
sheds the load answers most requests with 429 (the table counts them): to measure memory under load, not
under shedding, pass a serve YAML with ``breaker: {enabled: false}`` (``--serve-arg=--config=FILE``;
examples/serve/no_breaker.yaml).

What it reports: ready seconds; RSS idle, at its peak, at the end of the load and after it; the RSS slope over
the load after a warm-up (MB per minute, a least-squares line: flat means memory plateaus); 5xx answers; and the
server's state afterwards (nothing running, no KV block held).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from mcp2026.bench.report import BenchRun, Table, machine_info
from mcp2026.bench.serve import bench_serve
from mcp2026.bench.serve_config import ServeBenchConfig
from mcp2026.bench.workloads import BenchRequest

WINDOWS = 6  # spans of the load whose RSS peaks the report lists


@dataclass(frozen=True)
class SoakConfig:
    model: str | None = None  # None: the embedded default model
    duration_s: float = 1800.0
    max_concurrency: int = 64
    disconnect_share: float = 0.2
    malformed_share: float = 0.1
    warmup_s: float = 120.0  # the RSS slope is fitted after this much load
    sample_every_s: float = 5.0
    ready_timeout_s: float = 300.0
    seed: int = 0
    serve_args: tuple[str, ...] = ()  # more `mcp2026 serve` options, as on its command line

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or not self.sample_every_s > 0 or self.warmup_s < 0:
            raise ValueError("duration_s and sample_every_s must be > 0, warmup_s >= 0")
        if self.warmup_s >= self.duration_s:
            raise ValueError(
                f"warmup_s ({self.warmup_s}) must be shorter than duration_s ({self.duration_s})"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")

    def command(self) -> str:
        parts = ["mcp2026 bench soak"]
        if self.model:
            parts.append(f"--model {self.model}")
        parts += [
            f"--duration {self.duration_s:g}",
            f"--max-concurrency {self.max_concurrency}",
            f"--disconnect-share {self.disconnect_share:g}",
            f"--malformed-share {self.malformed_share:g}",
            f"--warmup {self.warmup_s:g}",
            f"--seed {self.seed}",
        ]
        parts += [f"--serve-arg={a}" for a in self.serve_args]
        return " ".join(parts)


def status_bytes(pid: int, *fields: str) -> dict[str, int]:
    """Byte fields of a live process's /proc status ("VmRSS": resident set size; "VmHWM": its high-water mark,
    the largest RSS the kernel saw, between samples too); empty once the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        return {f: int(line.split()[1]) * 1024 for line in lines for f in fields if line.startswith(f"{f}:")}
    except (OSError, ValueError, IndexError):
        return {}


def rss_bytes(pid: int, field: str = "VmRSS") -> int | None:
    """One ``status_bytes`` field (resident set size by default), None once the process is gone."""
    return status_bytes(pid, field).get(field)


class RssSampler:
    """Samples a process's RSS every ``every_s`` on a thread: (seconds since start, bytes, phase)."""

    def __init__(self, pid: int, every_s: float) -> None:
        self.pid, self.every_s = pid, every_s
        self.phase = "idle"
        self.samples: list[tuple[float, int, str]] = []
        self.high_water: dict[str, int] = {}  # phase -> the process's high-water mark at its last sample
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def elapsed(self) -> float:
        """Seconds since the sampler was made (the clock of ``samples``)."""
        return time.monotonic() - self._started

    def sample(self) -> None:
        status = status_bytes(self.pid, "VmRSS", "VmHWM")
        if "VmRSS" in status:
            self.samples.append((self.elapsed(), status["VmRSS"], self.phase))
        if "VmHWM" in status:
            self.high_water[self.phase] = status["VmHWM"]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)


def slope_mb_per_min(points: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of RSS over time, in MB per minute (None with fewer than 3 points)."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_r = sum(r for _, r in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (r - mean_r) for t, r in points)
    return cov / var * 60 / 1e6


def window_peaks(points: list[tuple[float, int]], start: float, end: float, windows: int) -> list[int | None]:
    """The largest RSS sampled in each of ``windows`` equal spans of [start, end) (None where a span has no
    sample): a plateau shows as level peaks, a leak as rising ones."""
    width = (end - start) / windows
    peaks: list[int | None] = [None] * windows
    for t, r in points:
        i = int((t - start) // width) if width > 0 else 0
        if 0 <= i < windows:
            current = peaks[i]
            peaks[i] = r if current is None else max(current, r)
    return peaks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(config: SoakConfig, port: int, log: Any) -> subprocess.Popen:
    """``mcp2026 serve`` on ``port`` with the config's options, its output into the open file ``log``."""
    args = [sys.executable, "-m", "mcp2026.cli", "serve", "--port", str(port), "--log-level", "warning"]
    if config.model:
        args += ["--model", config.model]
    args += list(config.serve_args)
    return subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def wait_ready(server: subprocess.Popen, base_url: str, timeout_s: float, log_path: Path) -> float:
    """Seconds from launch until /readyz answers 200; raises with the server's log tail if it never does."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if server.poll() is not None:
            tail = log_path.read_text()[-2000:]
            raise RuntimeError(f"mcp2026 serve exited with {server.returncode} before it was ready:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/readyz", timeout=1.0).status_code == 200:
                return time.monotonic() - t0
        time.sleep(0.05)
    raise RuntimeError(f"mcp2026 serve was not ready within {timeout_s:g} s (log: {log_path})")


def run_soak(
    config: SoakConfig, requests: list[BenchRequest], log_dir: Path, progress: Any = None
) -> BenchRun:
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "soak-server.log"
    with log_path.open("w") as log:
        sampler, load_started, ready_s, served = _serve_and_load(
            config, requests, port, log, log_path, progress
        )
    samples = sampler.samples
    aggregates = _aggregate(samples, load_started, config, ready_s, served.aggregates, sampler.high_water)
    records = [{"seconds": t, "rss_bytes": r, "phase": p} for t, r, p in samples]
    return BenchRun(
        kind="soak",
        command=config.command(),
        config=asdict(config),
        records=records,
        aggregates=aggregates,
        tables=[_table(aggregates, config)],
        notes=served.notes,
        machine=machine_info(),
    )


def _serve_and_load(
    config: SoakConfig, requests: list[BenchRequest], port: int, log: Any, log_path: Path, progress: Any
) -> tuple[RssSampler, float, float, BenchRun]:
    """Launch, wait for ready, sample RSS idle / under load / after it; the server is stopped at the end."""
    base_url = f"http://127.0.0.1:{port}"
    server = launch_server(config, port, log)
    try:
        ready_s = wait_ready(server, base_url, config.ready_timeout_s, log_path)
        with RssSampler(server.pid, config.sample_every_s) as sampler:
            time.sleep(min(10.0, config.sample_every_s * 2))  # idle after start
            sampler.sample()
            sampler.phase = "load"
            load_started = sampler.elapsed()
            load = ServeBenchConfig(
                base_url=base_url,
                max_concurrency=config.max_concurrency,
                seed=config.seed,
                duration_s=config.duration_s,
                disconnect_share=config.disconnect_share,
                malformed_share=config.malformed_share,
                kv_sample_s=None,
                check_server=True,
            )
            served = bench_serve(load, requests, progress)
            sampler.phase = "after"
            time.sleep(min(10.0, config.sample_every_s * 2))  # idle again: what the load left behind
            sampler.sample()
        return sampler, load_started, ready_s, served
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def _aggregate(
    samples: list[tuple[float, int, str]],
    load_started: float,
    config: SoakConfig,
    ready_s: float,
    served: dict[str, Any],
    high_water: dict[str, int] | None = None,
) -> dict[str, Any]:
    high_water = high_water or {}

    def mb(value: int | None) -> float | None:
        return None if value is None else value / 1e6

    idle = [r for _, r, p in samples if p == "idle"]
    load = [(t, r) for t, r, p in samples if p == "load"]
    after = [r for _, r, p in samples if p == "after"]
    settled = [(t, r) for t, r in load if t - load_started >= config.warmup_s]
    warm = settled[0][1] if settled else None
    return {
        "ready_s": ready_s,
        "rss_idle_mb": mb(idle[-1] if idle else None),
        "rss_peak_mb": mb(max(r for _, r, _ in samples) if samples else None),
        # the kernel's high-water marks: at start (loading and warm-up) and over the whole run
        "rss_high_water_start_mb": mb(high_water.get("idle")),
        "rss_high_water_mb": mb(max(high_water.values(), default=None)),
        "rss_after_warmup_mb": mb(warm),
        "rss_end_of_load_mb": mb(load[-1][1] if load else None),
        "rss_after_mb": mb(after[-1] if after else None),
        "rss_slope_mb_per_min": slope_mb_per_min(settled),
        # the peak of each span of the load: level once memory plateaus
        "rss_window_peaks_mb": [
            mb(r) for r in window_peaks(load, load_started, load_started + config.duration_s, WINDOWS)
        ],
        "num_completed": served.get("completed"),
        "num_5xx": served.get("num_5xx"),
        "num_429": sum(int(by.get("429", 0)) for by in (served.get("statuses") or {}).values()),
        "statuses": served.get("statuses"),
        "output_throughput": served.get("output_throughput"),
        "server_after": served.get("server_after"),
    }


def _table(a: dict[str, Any], config: SoakConfig) -> Table:
    def fmt(value: float | None, digits: int = 0) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    after = a.get("server_after") or {}
    rows = [
        ["ready after launch (s)", fmt(a["ready_s"], 2)],
        ["RSS idle after start (MB)", fmt(a["rss_idle_mb"])],
        [f"RSS after {config.warmup_s:g} s of load (MB)", fmt(a["rss_after_warmup_mb"])],
        ["RSS at the end of the load (MB)", fmt(a["rss_end_of_load_mb"])],
        ["RSS peak (MB)", fmt(a["rss_peak_mb"])],
        [
            "high-water mark: by ready / whole run (MB, the kernel's VmHWM)",
            f"{fmt(a.get('rss_high_water_start_mb'))} / {fmt(a.get('rss_high_water_mb'))}",
        ],
        ["RSS idle after the load (MB)", fmt(a["rss_after_mb"])],
        ["RSS slope after warm-up (MB/min)", fmt(a["rss_slope_mb_per_min"], 2)],
        [
            f"RSS peak in each of {WINDOWS} spans of the load ({config.duration_s / WINDOWS / 60:g} min each, MB)",
            " / ".join(fmt(v) for v in a.get("rss_window_peaks_mb") or []),
        ],
        ["server errors (5xx)", str(a["num_5xx"])],
        ["output tok/s", fmt(a["output_throughput"], 1)],
        ["requests completed", str(a["num_completed"])],
        ["requests refused (429: the SLO breaker or a tenant limit)", str(a["num_429"])],
        [
            "afterwards: running / waiting / KV in use",
            f"{after.get('num_running', '—')} / {after.get('num_waiting', '—')} / {after.get('kv_usage', '—')}",
        ],
    ]
    title = (
        f"Soak: mcp2026 serve under {config.duration_s / 60:g} min of ShareGPT streams at {config.max_concurrency} "
        f"concurrent ({config.disconnect_share:.0%} hang up mid-stream, {config.malformed_share:.0%} malformed)"
    )
    return Table(title, ["measure", "value"], rows)
