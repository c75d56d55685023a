"""What ``mcp2026 bench serve`` runs against: the run's settings (``ServeBenchConfig``), the peers measured
side by side with our server, and the parsing of ``--peer-url``/``--peer-model``/``--goodput``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
METRICS_MS = ("ttft", "tpot", "itl", "e2el")
OURS = "mcp2026"  # our endpoint's name in side-by-side runs
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# the fields the load generator owns: an extra body may not replace what makes the workload the same
_OWNED_FIELDS = ("model", "prompt", "stream", "stream_options", "max_tokens")


def check_extra_body(body: dict, owner: str) -> dict:
    if not isinstance(body, dict):
        raise ValueError(f"{owner}: the extra body must be a JSON object, got {body!r}")
    owned = sorted(set(body) & set(_OWNED_FIELDS))
    if owned:
        raise ValueError(f"{owner}: the extra body may not set {owned} (the workload sets them)")
    return dict(body)


def parse_extra_body(text: str, owner: str) -> dict:
    """A JSON object given on the command line, or ``@FILE`` to read it from a file."""
    try:
        if text.startswith("@"):
            with open(text[1:], encoding="utf-8") as f:
                text = f.read()
        return check_extra_body(json.loads(text), owner)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{owner}: cannot read the extra body ({e})") from None


@dataclass(frozen=True)
class PeerEndpoint:
    """Another OpenAI-compatible server measured side by side with ours (e.g. llama.cpp's llama-server)."""

    name: str
    base_url: str
    model: str | None = None  # None: the first id of its GET /v1/models
    extra_body: dict = field(default_factory=dict)  # merged into every request body sent to it

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_body", check_extra_body(self.extra_body, f"peer {self.name}"))
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
    # merged into every request body (e.g. a response_format; {"ignore_eos": false} replaces ignore_eos)
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peers", tuple(self.peers))
        object.__setattr__(self, "extra_body", check_extra_body(self.extra_body, "extra body"))
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


def parse_peers(
    urls: Sequence[str], models: Sequence[str] = (), bodies: Sequence[str] = ()
) -> tuple[PeerEndpoint, ...]:
    """``--peer-url NAME=URL`` (repeatable), ``--peer-model NAME=MODEL`` and ``--peer-body NAME=JSON`` (or
    ``NAME=@FILE``) for some of those peers. The same server may be a peer under another body: e.g. our
    own server with a ``response_format`` beside it without one."""

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
    by_body = pairs(bodies, "--peer-body", "JSON")
    for option, given in (("--peer-model", by_model), ("--peer-body", by_body)):
        unknown = sorted(set(given) - set(by_url))
        if unknown:
            raise ValueError(f"{option} names peers without a --peer-url: {unknown}")
    return tuple(
        PeerEndpoint(
            n,
            u.rstrip("/"),
            by_model.get(n),
            parse_extra_body(by_body[n], f"--peer-body {n}") if n in by_body else {},
        )
        for n, u in by_url.items()
    )


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
