"""What ``mcp2026 bench serve`` runs against: the run's settings (``ServeBenchConfig``), the peers measured
side by side with our server, and the parsing of ``--peer-url``/``--peer-model``/``--goodput``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
METRICS_MS = ("ttft", "tpot", "itl", "e2el")
OURS = "mcp2026"  # our endpoint's name in side-by-side runs
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class PeerEndpoint:
    """Another OpenAI-compatible server measured side by side with ours (e.g. llama.cpp's llama-server)."""

    name: str
    base_url: str
    model: str | None = None  # None: the first id of its GET /v1/models

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.name == OURS:
            raise ValueError(
                f"a peer's name is letters, digits, '.', '_' and '-' and not {OURS!r}, got {self.name!r}"
            )
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"peer {self.name}: URL must start with http:// or https://, got {self.base_url!r}"
            )


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # Gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular
    max_concurrency: int | None = None
    seed: int = 0
    duration_s: float | None = None  # cycle the requests until then (None: each request once)
    max_requests: int = 100_000  # hard cap on requests issued in duration mode
    goodput_ms: dict[str, float] = field(default_factory=dict)  # SLOs, e.g. {"ttft": 1000, "tpot": 100}
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    disconnect_share: float = 0.0  # clients that close the stream after a few chunks
    malformed_share: float = 0.0  # requests replaced by broken bodies (they must get a 4xx)
    ignore_eos: bool = True  # every engine generates exactly output_len tokens
    kv_sample_s: float | None = 0.5  # poll the server's /metrics for its KV usage this often (None: never)
    timeout_s: float = 600.0
    check_server: bool = False  # afterwards read our server's /metrics: nothing running, no KV held
    detailed: bool = False  # keep every request's ITLs in the records
    peers: tuple[PeerEndpoint, ...] = ()  # served the same workload, interleaved with ours
    rounds: int = 2  # side by side: phases per endpoint (every other round in reverse order)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peers", tuple(self.peers))
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        names = [p.name for p in self.peers]
        if len(set(names)) != len(names):
            raise ValueError(f"peer names must be unique, got {names}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf = all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.kv_sample_s is not None and not self.kv_sample_s > 0:
            raise ValueError(f"kv_sample_s must be > 0 (None: no sampling), got {self.kv_sample_s}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        unknown = sorted(set(self.goodput_ms) - set(GOODPUT_METRICS))
        if unknown or any(not v > 0 for v in self.goodput_ms.values()):
            raise ValueError(
                f"goodput takes {GOODPUT_METRICS} with positive milliseconds, got {self.goodput_ms}"
            )
        for name in ("disconnect_share", "malformed_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")


def parse_peers(urls: Sequence[str], models: Sequence[str] = ()) -> tuple[PeerEndpoint, ...]:
    """``--peer-url NAME=URL`` (repeatable) and ``--peer-model NAME=MODEL`` for some of those peers."""

    def pairs(items: Sequence[str], option: str, what: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for item in items:
            name, sep, value = item.partition("=")
            if not sep or not name or not value:
                raise ValueError(f"{option} takes NAME={what}, got {item!r}")
            if name in out:
                raise ValueError(f"{option}: {name!r} given twice")
            out[name] = value
        return out

    by_url = pairs(urls, "--peer-url", "URL")
    by_model = pairs(models, "--peer-model", "MODEL")
    unknown = sorted(set(by_model) - set(by_url))
    if unknown:
        raise ValueError(f"--peer-model names peers without a --peer-url: {unknown}")
    return tuple(PeerEndpoint(n, u.rstrip("/"), by_model.get(n)) for n, u in by_url.items())


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:1000", "tpot:100"]`` -> ``{"ttft": 1000.0, "tpot": 100.0}`` (vLLM's --goodput syntax); an item
    may hold several, comma- or space-separated (``"ttft:1000,tpot:100"``)."""
    slos = {}
    for item in (part for text in items for part in re.split(r"[,\s]+", text.strip()) if part):
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS or not value:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {GOODPUT_METRICS}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    return slos
