"""Per-layer KV budgets calibrated for a model (``mcp2026 kv calibrate``): how much each layer's eviction costs.

The probe runs the real engine: for every layer L, a teacher-forced long text where only L evicts, at the policy's
uniform budget (``KVEvictor.probe_layer``), against the uncompressed cache; its ΔPPL is L's sensitivity. A layer's
weight is the square root of its share of the summed sensitivity, added over the texts and floored, so a layer
that matters gets more and none gets nothing (docs/kv-cache.md, "Per-layer budgets"): the eviction simulation's
rule, with every number from the engine itself. The built-in SmolLM2-135M preset is this command's output.

Cost: one lockstep pass per text with an engine per layer (memory: a pool of one context per layer).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mcp2026.bench.kv import token_sequences
from mcp2026.bench.kv_config import PROMPT_CHUNK
from mcp2026.bench.kv_measure import lockstep_group_size, measurement_engine
from mcp2026.bench.quality import compare_quality_many
from mcp2026.kv.codecs import IDENTITY_CODECS
from mcp2026.kv.compressor import KVCompressor
from mcp2026.kv.eviction import POLICIES
from mcp2026.kv.layer_weights import FILE_KIND, fingerprint

CHUNK = (
    32  # as ``mcp2026 bench kv`` (its default --chunk-size): the prompt half in PROMPT_CHUNK chunks, then 32
)
FLOOR = 0.005  # per text: the least share a layer is credited with (its weight is never zero)


@dataclass(frozen=True)
class CalibrationConfig:
    policy: str = "heavy_hitter"
    sparsity: float = 0.7
    context_tokens: int = 2048
    num_texts: int = 2
    text: str = "sharegpt"  # held-out ShareGPT conversations, "random" ids, or a path to a UTF-8 text file
    # 1, not the kv bench's 0: the bench's texts stay held out from what calibrates
    seed: int = 1

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(sorted(POLICIES))}, got {self.policy!r}")
        if not 0.0 < self.sparsity < 1.0:
            raise ValueError(f"--sparsity must be in (0, 1), got {self.sparsity}")
        if self.context_tokens < 4 * CHUNK:
            raise ValueError(f"--context-tokens must be at least {4 * CHUNK}, got {self.context_tokens}")
        if self.num_texts < 1:
            raise ValueError(f"--texts must be >= 1, got {self.num_texts}")
        if self.text not in ("sharegpt", "random") and not Path(self.text).is_file():
            raise ValueError(f"--text: no such file {self.text!r} (or give sharegpt / random)")


def weights_from_probes(probes: Sequence[Sequence[float]], floor: float = FLOOR) -> tuple[float, ...]:
    """Per text, each layer's positive ΔPPL as a share of the text's sum; shares added over texts, floored at
    ``floor`` per text, square root."""
    share = [0.0] * len(probes[0])
    for probe in probes:
        positive = [max(d, 0.0) for d in probe]
        total = sum(positive) or 1.0
        share = [s + d / total for s, d in zip(share, positive, strict=True)]
    return tuple(round(max(s, floor * len(probes)) ** 0.5, 6) for s in share)


def calibration_texts(loaded: Any, config: CalibrationConfig) -> list[list[int]]:
    """``num_texts`` sequences of ``context_tokens``: from a text file (consecutive windows) or the kv bench's
    sources at this seed."""
    if config.text not in ("sharegpt", "random"):
        path = Path(config.text)
        if loaded.tokenizer is None:
            raise ValueError("--text FILE needs a model with a tokenizer")
        ids = loaded.tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        n = config.context_tokens
        if len(ids) < n * config.num_texts:
            raise ValueError(
                f"--text {path}: {len(ids)} tokens, need {n * config.num_texts} ({config.num_texts} windows of "
                f"{n}); give a longer file, or fewer --texts / --context-tokens"
            )
        return [ids[i * n : (i + 1) * n] for i in range(config.num_texts)]

    vocab = loaded.config.vocab_size
    return token_sequences(
        config.text, loaded.tokenizer, vocab, config.num_texts, config.context_tokens, config.seed
    )


def probe_layers(
    loaded: Any,
    config: CalibrationConfig,
    texts: Sequence[Sequence[int]],
    group: int | None = None,
    advance: Callable[[], None] | None = None,
) -> list[list[float]]:
    """Per text, per layer: ΔPPL (%) of the text when that layer alone evicts. ``group`` engines run in one
    lockstep pass (None: as many as a quarter of free memory holds); ``advance`` is called after each pass."""
    num_layers = loaded.config.num_layers
    dtype = next(loaded.model.parameters()).dtype
    kv = KVCompressor(
        dtype=IDENTITY_CODECS[dtype],
        policy=config.policy,
        sparsity_ratio=config.sparsity,
        layer_weights=(1.0,) * num_layers,
    )
    group = group or lockstep_group_size(
        loaded, kv.block_size, config.context_tokens, PROMPT_CHUNK, num_layers
    )
    ref = measurement_engine(loaded, None, config.context_tokens, kv.block_size)
    probes = [[math.nan] * num_layers for _ in texts]
    for first in range(0, num_layers, group):
        layers = range(first, min(first + group, num_layers))
        engines = [measurement_engine(loaded, kv, config.context_tokens, None) for _ in layers]
        for layer, engine in zip(layers, engines):
            engine.evictor.probe_layer = layer
        for t, tokens in enumerate(texts):
            results = compare_quality_many(ref, engines, tokens, len(tokens) // 2, PROMPT_CHUNK, CHUNK)
            for layer, r in zip(layers, results):
                probes[t][layer] = 100.0 * r.delta_ppl
            if advance is not None:
                advance()
        del engines
    return probes


def calibrate(
    loaded: Any, config: CalibrationConfig, model: str, advance: Callable[[], None] | None = None
) -> dict[str, Any]:
    """The calibration file's content: weights, what they were measured on, and every probe."""
    texts = calibration_texts(loaded, config)
    probes = probe_layers(loaded, config, texts, advance=advance)
    return {
        "kind": FILE_KIND,
        "model": model,
        "fingerprint": fingerprint(loaded.config),
        "policy": config.policy,
        "weights": list(weights_from_probes(probes)),
        "calibration": asdict(config),
        "probes_delta_ppl_pct": probes,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
