"""The configurations a sweep serves: serve YAMLs (or the defaults) crossed with inline grid axes
(max_num_seqs, max_num_batched_tokens, KV codec, KV eviction policy, quantization YAML), each named after
what it changes."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp2026.config import EngineConfig
from mcp2026.serve.config import ServeConfig, kv_compressor_from_options, load_quant_config, load_serve_yaml

AS_CONFIGURED = "none"  # a grid value meaning "what the serve config says"


@dataclass(frozen=True)
class SweepPoint:
    """One server configuration of the sweep."""

    name: str
    serve: ServeConfig
    engine: EngineConfig

    def describe(self) -> dict[str, Any]:
        """JSON-ready: the serve config and the engine's KV, scheduler and KV compressor settings."""
        compressor = self.engine.kv_compressor
        return {
            "serve": dataclasses.asdict(self.serve),
            "kv": dataclasses.asdict(self.engine.resolved_kv),
            "scheduler": dataclasses.asdict(self.engine.scheduler),
            "kv_compressor": compressor.to_dict() if compressor is not None else None,
        }


@dataclass(frozen=True)
class GridAxes:
    """Inline grid values; an empty axis keeps what each serve config says."""

    max_num_seqs: tuple[int, ...] = ()
    max_num_batched_tokens: tuple[int, ...] = ()
    kv_dtypes: tuple[str, ...] = ()  # KV codecs (int8, int4, ...); "none": as configured
    kv_policies: tuple[str, ...] = ()  # eviction policies; "none": no eviction
    kv_sparsity: float | None = None  # for the policies (their default when None)
    quants: tuple[str, ...] = ()  # QuantConfig YAML paths; "none": weights as stored


_KINDS = {float: "numbers, e.g. 0.5,0.7,0.9"}


def parse_list(text: str | None, convert: type = str, option: str = "") -> tuple[Any, ...]:
    """``"8,32"`` -> ``(8, 32)``; a one-line error naming the option on a bad item."""
    items = [s.strip() for s in (text or "").split(",") if s.strip()]
    try:
        return tuple(convert(s) for s in items)
    except ValueError:
        raise ValueError(
            f"{option or 'list'}: expected comma-separated {_KINDS.get(convert, convert.__name__ + 's')}, "
            f"got {text!r}"
        ) from None


def _bases(
    configs: Sequence[Path], model: str | None, dtype: str | None
) -> list[tuple[str, ServeConfig, EngineConfig]]:
    bases = []
    for path in configs:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: serve config YAML not found")
        serve, engine = load_serve_yaml(path)
        bases.append((Path(path).stem, serve, engine))
    if not bases:
        bases = [("default", ServeConfig(), EngineConfig())]
    names = [name for name, _, _ in bases]
    if len(set(names)) < len(names):  # a.yaml in two folders
        bases = [(f"{name}-{i + 1}", s, e) for i, (name, s, e) in enumerate(bases)]
    overrides = {k: v for k, v in (("model", model), ("dtype", dtype)) if v is not None}
    return [(name, dataclasses.replace(serve, **overrides), engine) for name, serve, engine in bases]


def build_grid(
    configs: Sequence[Path] = (),
    axes: GridAxes = GridAxes(),
    model: str | None = None,
    dtype: str | None = None,
) -> list[SweepPoint]:
    """Every serve config crossed with every combination of the axes. Bad values fail here, before any
    model loads (unknown codec, missing quant YAML, max_num_seqs < 1, ...)."""
    if axes.kv_sparsity is not None and not set(axes.kv_policies) - {AS_CONFIGURED}:
        raise ValueError("--kv-sparsity needs an eviction policy: add --kv-policy (e.g. heavy_hitter)")
    for quant in axes.quants:
        if quant != AS_CONFIGURED:
            load_quant_config(quant)  # fails now with the file's problem
    bases = _bases(configs, model, dtype)
    grid = list(
        itertools.product(
            axes.max_num_seqs or (None,),
            axes.max_num_batched_tokens or (None,),
            axes.kv_dtypes or (None,),
            axes.kv_policies or (None,),
            axes.quants or (None,),
        )
    )
    points = []
    for base_name, serve, engine in bases:
        for seqs, tokens, kv_dtype, policy, quant in grid:
            scheduler = engine.scheduler
            if seqs is not None:
                scheduler = dataclasses.replace(scheduler, max_num_seqs=seqs)
            if tokens is not None:
                scheduler = dataclasses.replace(scheduler, max_num_batched_tokens=tokens)
            codec = None if kv_dtype in (None, AS_CONFIGURED) else kv_dtype
            sparsity = axes.kv_sparsity if policy not in (None, AS_CONFIGURED) else None
            compressor = kv_compressor_from_options(engine, codec, policy, sparsity)
            point_engine = dataclasses.replace(engine, scheduler=scheduler, kv_compressor=compressor)
            point_serve = serve
            if quant is not None:
                point_serve = dataclasses.replace(serve, quant=None if quant == AS_CONFIGURED else str(quant))
            parts = [base_name] if len(bases) > 1 or not any((seqs, tokens, kv_dtype, policy, quant)) else []
            parts += [
                f"{label}={value}"
                for label, value in (
                    ("seqs", seqs),
                    ("tokens", tokens),
                    ("kv", kv_dtype),
                    ("policy", policy),
                    ("quant", Path(quant).stem if quant not in (None, AS_CONFIGURED) else quant),
                )
                if value is not None
            ]
            points.append(SweepPoint(" ".join(parts), point_serve, point_engine))
    return points
