"""ServeConfig: what the HTTP server needs (address, keys, limits, SLOs), and the serve YAML reader.

One YAML holds the same keys as ``mcp2026 serve``'s options, plus ``kv:`` and ``scheduler:`` sections that
go to the engine's KVConfig and SchedulerConfig unchanged, ``kv_compressor:`` (KVCompressor fields),
``breaker:``, ``traffic:`` and ``canary:`` (release-gate thresholds and the live canary, see mcp2026.canary).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mcp2026.canary.config import CanaryConfig
from mcp2026.config import EngineConfig, KVConfig, QuantConfig, SchedulerConfig, SpeculativeConfig
from mcp2026.kv.codecs import default_block_size
from mcp2026.kv.compressor import KVCompressor
from mcp2026.quant.compile_cli import load_spec
from mcp2026.serve.slo import BreakerConfig
from mcp2026.serve.traffic import TrafficConfig
from mcp2026.types import POOLINGS

if TYPE_CHECKING:
    from mcp2026.quant.compile_cli import CompileSpec

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None  # HF folder or .gguf; None = the embedded default model
    model_name: str | None = None  # the id clients send as "model"; None = the model file's stem
    dtype: str = "auto"
    device: str = "cpu"  # "cuda" (or "cuda:N") runs the model on that GPU
    quant: str | None = None  # quant YAML, all of it as `mcp2026 compile` reads it; None = weights as stored
    host: str = "127.0.0.1"
    port: int = 8000
    tenants_file: str | None = None  # API keys -> tenants YAML; None = one open tenant
    cors_origins: tuple[str, ...] = ()
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # Admission: reject early (429) rather than time out late.
    max_queued_requests: int = 256  # requests accepted but without a first token yet
    max_queued_tokens: int = 256 * 1024  # their prompt tokens
    max_n: int = 16  # choices per request
    max_request_body_bytes: int = 16 * 2**20  # larger bodies get a 413 before they are read
    max_embedding_inputs: int = 2048  # inputs per /v1/embeddings request (OpenAI's own cap)
    # /v1/embeddings pooling when a request does not name one: "last" (the last token's final hidden state,
    # what a decoder LLM's last position summarises) or "mean" (over the input's tokens)
    embedding_pooling: str = "last"
    # SLOs: requests slower than these count as violations for the circuit breaker.
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    traffic: TrafficConfig = field(default_factory=TrafficConfig)  # profile + pressure gate rule
    drain_on_sigterm: bool = True  # False: abort in-flight requests (finish_reason "abort")
    drain_timeout_s: float = 30.0
    warmup: bool = True  # /readyz only after one request went through the engine
    canary: CanaryConfig = field(default_factory=CanaryConfig)  # release-gate thresholds, live canary
    otlp_traces_endpoint: str | None = None  # OpenTelemetry spans to this OTLP endpoint; None: no tracing

    def __post_init__(self) -> None:
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins))
        _require(0 <= self.port <= 65535, f"ServeConfig.port must be in [0, 65535], got {self.port}")
        limits = ("max_queued_requests", "max_queued_tokens", "max_n", "max_request_body_bytes")
        for name in (*limits, "max_embedding_inputs"):
            value = getattr(self, name)
            _require(value >= 1, f"ServeConfig.{name} must be >= 1, got {value}")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "drain_timeout_s"):
            value = getattr(self, name)
            _require(value > 0, f"ServeConfig.{name} must be > 0, got {value}")
        _require(
            self.embedding_pooling in POOLINGS,
            f"ServeConfig.embedding_pooling must be one of {POOLINGS}, got {self.embedding_pooling!r}",
        )
        _require(
            self.device == "cpu" or self.device.startswith("cuda"),
            f"ServeConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}",
        )
        _require(
            self.otlp_traces_endpoint is None
            or self.otlp_traces_endpoint.startswith(("http://", "https://")),
            f"ServeConfig.otlp_traces_endpoint must be an http(s):// URL, got {self.otlp_traces_endpoint!r}",
        )
        _require(
            (self.ssl_certfile is None) == (self.ssl_keyfile is None),
            "ServeConfig: give both ssl_certfile and ssl_keyfile, or neither",
        )

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")


def load_serve_yaml(path: str | Path) -> tuple[ServeConfig, EngineConfig]:
    """Read a serve YAML: ServeConfig keys at the top level; ``kv:``, ``scheduler:``, ``speculative:``,
    ``breaker:`` sections."""

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the serve config ({e})") from None
    _require(isinstance(raw, dict), f"{path}: the serve config must be a mapping of keys to values")
    raw = dict(raw)
    kv, scheduler = raw.pop("kv", None) or {}, raw.pop("scheduler", None) or {}
    speculative = dict(raw.pop("speculative", None) or {})
    if speculative.get("method") is False:  # YAML 1.1 reads a bare `off` as false
        speculative["method"] = "off"
    compressor = raw.pop("kv_compressor", None)
    for key, cls in (("breaker", BreakerConfig), ("traffic", TrafficConfig)):
        try:
            raw[key] = cls(**(raw.pop(key, None) or {}))
        except TypeError as e:
            raise ValueError(f"{path}: bad {key} section ({e})") from None
    raw["canary"] = CanaryConfig.from_mapping(raw.pop("canary", None), f"{path}: canary").with_paths_under(
        path.parent
    )
    if "tenants" in raw:  # the CLI option's name
        raw["tenants_file"] = raw.pop("tenants")
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(raw) - known)
    sections = {"kv", "scheduler", "kv_compressor", "speculative"}
    _require(not unknown, f"{path}: unknown keys {unknown}; known: {sorted(known | sections)}")
    try:
        kv_compressor = None
        if compressor:
            kv_compressor = KVCompressor.from_dict(compressor)
        engine = EngineConfig(
            KVConfig(**kv),
            SchedulerConfig(**scheduler),
            kv_compressor=kv_compressor,
            speculative=SpeculativeConfig(**speculative),
        )
    except TypeError as e:
        raise ValueError(f"{path}: bad kv/scheduler/kv_compressor/speculative section ({e})") from None
    return ServeConfig(**_resolve_paths(raw, path.parent)), engine


def _resolve_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """File paths in the YAML are relative to the YAML's folder."""
    for key in ("model", "quant", "tenants_file", "ssl_certfile", "ssl_keyfile"):
        if raw.get(key) is not None and not Path(str(raw[key])).expanduser().is_absolute():
            raw[key] = str(base / str(raw[key]))
    return raw


def load_quant_spec(path: str | Path) -> CompileSpec:
    """A quant YAML as ``mcp2026 compile`` reads it: the QuantConfig and its ``calibration:`` and ``dqg:``
    sections (``Pipeline(config=spec)`` quantizes exactly as compile does). Bad keys or values: ValueError."""

    return load_spec(path)


def load_quant_config(path: str | Path) -> QuantConfig:
    """The QuantConfig of a quant YAML (the whole file is checked; ``load_quant_spec`` keeps its
    calibration and DQG settings too)."""
    return load_quant_spec(path).quant


def kv_compressor_from_options(
    engine: EngineConfig,
    dtype: str | None,
    policy: str | None,
    sparsity_ratio: float | None,
    layer_weights: str | None = None,
) -> KVCompressor | None:
    """The serve options ``--kv-dtype/--kv-policy/--kv-sparsity/--kv-layer-weights`` over the YAML's
    ``kv_compressor``. Without either, None (KV stored as the model's dtype). ``--kv-dtype`` alone evicts
    nothing. Block size: the YAML's ``kv.block_size`` if it set one; else the YAML compressor's, unless that was
    its codec's default and the codec changes; else the codec's."""
    base = engine.kv_compressor
    if dtype is None and policy is None and sparsity_ratio is None and layer_weights is None:
        return base

    if base is not None:
        fields = base.to_dict()
        if dtype is not None and base.block_size == default_block_size(base.dtype):
            del fields["block_size"]  # a default block size follows the new codec
    else:
        fields = {"policy": "none"}
    if engine.kv.block_size is not None:  # the YAML's kv.block_size, when it set one, over any default
        fields["block_size"] = engine.kv.block_size
    if dtype is not None:
        fields["dtype"] = dtype
    if policy is not None:
        fields["policy"] = policy
        if policy == "none":
            fields["sparsity_ratio"] = fields["max_kv_tokens"] = fields["layer_weights"] = None
    if sparsity_ratio is not None:
        _require(fields["policy"] != "none", "--kv-sparsity needs an eviction policy (--kv-policy)")
        fields["sparsity_ratio"], fields["max_kv_tokens"] = sparsity_ratio, None
    if layer_weights is not None:
        _require(fields["policy"] != "none", "--kv-layer-weights needs an eviction policy (--kv-policy)")
        fields["layer_weights"] = layer_weights
    return KVCompressor.from_dict(fields)
