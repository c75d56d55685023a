"""One arm of a canary: a serve YAML (model, dtype, quant plan, KV policy, scheduler) built into a pipeline
exactly as ``mcp2026 serve --config`` builds it, so the canary measures what would be deployed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp2026.bench.workloads import tokenizer_id
from mcp2026.config import EngineConfig
from mcp2026.pipeline import Pipeline
from mcp2026.serve.config import ServeConfig, load_quant_spec, load_serve_yaml

BASELINE, CANDIDATE = "baseline", "candidate"


@dataclass
class Arm:
    name: str  # baseline | candidate
    path: Path  # the serve YAML
    serve: ServeConfig
    engine_config: EngineConfig
    pipeline: Pipeline

    @property
    def engine(self) -> Any:
        return self.pipeline.engine

    def describe(self) -> dict[str, Any]:
        """What this arm runs, for the report: resolved settings, not just the YAML's path."""
        compressor = self.engine_config.kv_compressor
        spec, quant = self.pipeline.quant_spec, None
        if spec is not None:  # the QuantConfig's fields, and the calibration and DQG settings used
            quant = {"yaml": self.serve.quant, **dataclasses.asdict(spec.quant)}
            quant.update(calibration=dataclasses.asdict(spec.calibration), dqg=dataclasses.asdict(spec.dqg))
        loaded = self.pipeline.loaded
        return {
            "config": str(self.path),
            "model": str(loaded.source),
            "dtype": str(self.pipeline.dtype).removeprefix("torch."),
            "quant": quant,
            "kv": dataclasses.asdict(self.engine_config.resolved_kv),
            "kv_compressor": None if compressor is None else compressor.to_dict(),
            "scheduler": dataclasses.asdict(self.engine_config.scheduler),
            "weight_bytes_per_decode_step": self.pipeline.weight_bytes(),
            "kv_bytes_per_token": self.engine.cache.bytes_per_token,
            "max_model_len": self.engine.max_model_len,
        }


def read_arm_config(path: str | Path) -> tuple[ServeConfig, EngineConfig]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such configuration file (a serve YAML, see examples/canary/)")
    serve, engine = load_serve_yaml(path)
    if serve.quant is not None:
        load_quant_spec(serve.quant)  # a bad quant YAML (any section) fails here, before any model loads
    return serve, engine


def build_arm(name: str, path: str | Path, configs: tuple[ServeConfig, EngineConfig] | None = None) -> Arm:
    """``configs``: the YAML already read by ``read_arm_config`` (check every file before loading models)."""
    from mcp2026.serve.server import build_pipeline  # defer: torch

    serve, engine_config = configs or read_arm_config(path)
    return Arm(name, Path(path), serve, engine_config, build_pipeline(serve, engine_config))


def check_comparable(baseline: Arm, candidate: Arm) -> None:
    """Both arms must read the same token ids the same way: same vocabulary and tokenizer."""

    b, c = baseline.pipeline.loaded, candidate.pipeline.loaded
    if b.config.vocab_size != c.config.vocab_size:
        raise ValueError(
            f"baseline and candidate have different vocabularies ({b.config.vocab_size} vs "
            f"{c.config.vocab_size}); a canary compares configurations of one model family"
        )
    if (b.tokenizer is None) != (c.tokenizer is None) or (
        b.tokenizer is not None and tokenizer_id(b.tokenizer) != tokenizer_id(c.tokenizer)
    ):
        raise ValueError(
            "baseline and candidate tokenize differently; a canary compares configurations of one model family"
        )
