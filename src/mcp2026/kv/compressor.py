"""``KVCompressor``: the user-facing KV compression config (codec + eviction policy + budget):
``Pipeline(kv=KVCompressor(dtype="int8", policy="heavy_hitter", sparsity_ratio=0.7))``.

It is a frozen, validated dataclass; ``inject`` applies it to an existing pipeline or engine (the KV cache is
rebuilt), ``from_dict`` / ``from_yaml`` read it from configs. The engine turns it into a ``KVCodec`` for the
paged cache and a ``KVEvictor`` that runs after every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mcp2026.config import ModelConfig
from mcp2026.kv.codecs import CODECS, KVCodec, default_block_size, describe_default_block_sizes, make_codec
from mcp2026.kv.eviction import POLICIES, EvictionBudget, make_policy
from mcp2026.kv.evictor import KVEvictor
from mcp2026.kv.layer_weights import AUTO, UNIFORM, auto_weights, parse_layer_weights
from mcp2026.kv.manager import KVCacheManager
from mcp2026.kv.paged_cache import PagedKVCache

BLOCK_SIZES = (8, 16, 32, 64, 128)
DEFAULT_SPARSITY = 0.7


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class KVCompressor:
    """KV cache compression: how K/V are stored (``dtype``) and which blocks long contexts drop (``policy``).

    dtype: fp32 | bf16 | fp16 (stored as is) | int8 (per token and head) | fp8 (e4m3, scale per token and
        head) | int4 (KIVI: keys per channel per block, values per token in groups of 32; 3.54x fewer bytes
        than bf16 on SmolLM2 at its default 32-token blocks, 3.34x at block_size=16) | int4-g64 (values in
        groups of 64; 3.75x at its default 64-token blocks).
    block_size: tokens per KV block, the unit of the paged pool, of prefix sharing and of eviction; None
        takes the codec's default (16; int4 32 and int4-g64 64, their key groups). An engine's
        ``KVConfig.block_size``, when given, must equal it.
    policy: none (the default: a codec changes only how K/V are stored) | sink_window | heavy_hitter | snap |
        dynamic_window (eviction is opt-in: it drops context, and with it some quality).
    Budget: ``sparsity_ratio`` (fraction of the context dropped; 0.7 when neither is given) or
    ``max_kv_tokens`` (tokens kept per request), never both. ``num_sink_tokens`` and ``recent_window`` are
    always kept; with heavy_hitter / snap, so are the ``num_anchors`` passages the question names (lexical
    anchors), for ``anchor_tokens`` tokens after the prompt; ``lookahead_tokens`` greedy drafts may join the
    question in ranking the prompt (off by default). ``layer_weights`` shares the kept blocks between layers
    unevenly; "auto" (the default) uses a calibrated set where one exists for the served model and policy
    (every policy on SmolLM2-135M; ``mcp2026 kv calibrate --install`` for others), else uniform. ``max_error`` is the relative round-trip error above which
    a layer is reported.
    """

    dtype: str = "int8"
    policy: str = "none"
    sparsity_ratio: float | None = None
    block_size: int | None = None  # None: the codec's default (kv.codecs.default_block_size)
    num_sink_tokens: int = 4
    max_kv_tokens: int | None = None
    recent_window: int = 64
    max_error: float = 0.02
    observation_window: int = (
        32  # heavy_hitter / snap / dynamic_window: last prompt queries that score blocks
    )
    heat_fraction: float = 0.6  # dynamic_window: calcLeftBoundary's fraction of the recent mean heat
    # heavy_hitter: the most of a lane's budget for heavy hitters (each lane gives the share of its attention a
    # plain window would lose; the rest is the newest blocks)
    max_heavy_share: float = 0.9
    # heavy_hitter / snap: when a prompt completes, the passages sharing the most rare tokens with its question
    # (its last observation_window tokens), each with the block after it, are kept in every lane
    # (kv.eviction.lexical_anchors; 0 = none) for anchor_tokens tokens, if they fit in half the budget past
    # sinks and window; then heavy_hitter's scores decide. heavy_hitter holds them on top of its budget when the
    # prompt was held whole (kept for good, within the budget, its ΔPPL on the 2k text went +8.3% -> +10.8%);
    # snap evicts once, when they are protected. Retrieval at 2044-token prompts, 70%: fact kept 27/34 -> 34/34.
    num_anchors: int = 1
    anchor_tokens: int = 32
    # heavy_hitter / snap: when a prompt completes, the model drafts this many tokens greedily over the whole
    # prompt (then they are rolled back), and their attention joins the question's, with lookahead_weight, in
    # ranking the prompt's blocks (engine.lookahead; 0 = off). Off by default: on SmolLM2-135M it gained nothing
    # (docs/kv-cache.md, "Lookahead drafts") and costs up to this many decode steps of TTFT.
    lookahead_tokens: int = 0
    lookahead_weight: float = 0.5
    error_check_interval: int = 16  # measure the round-trip error every this many steps
    # Per-layer budgets: one positive weight per model layer; a request's kept blocks are shared between layers in
    # proportion (kv.layer_pages). A sequence, a "w0/w1/..." string, a calibrated preset
    # (kv.layer_weights.PRESETS: "smollm2-135m"), "uniform" (or None: every layer keeps the same), or "auto": the
    # preset calibrated for the served model and policy if there is one, else uniform (resolved by ``for_model``
    # when the engine is built). The kv bench's four 2k texts, heavy_hitter at 70%: ΔPPL +8.3/+24.9/+16.9/+5.7%
    # uniform, +4.0/+2.5/+1.9/+1.7% with "smollm2-135m" (all held out from its calibration; docs/kv-cache.md).
    layer_weights: tuple[float, ...] | str | None = AUTO

    describe_default_block_sizes = staticmethod(describe_default_block_sizes)  # for EngineConfig's errors

    def __post_init__(self) -> None:
        _require(
            self.dtype in CODECS,
            f"KVCompressor.dtype must be one of {', '.join(sorted(CODECS))}, got {self.dtype!r}",
        )
        policies = ("none", *sorted(POLICIES))
        _require(
            self.policy in policies,
            f"KVCompressor.policy must be one of {', '.join(policies)}, got {self.policy!r}",
        )
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.dtype))
        _require(
            self.block_size in BLOCK_SIZES,
            f"KVCompressor.block_size must be one of {BLOCK_SIZES}, got {self.block_size!r}",
        )
        if self.policy == "none":
            _require(
                self.sparsity_ratio is None and self.max_kv_tokens is None,
                "KVCompressor: policy='none' drops nothing; sparsity_ratio / max_kv_tokens need an eviction "
                f"policy ({', '.join(sorted(POLICIES))})",
            )
        else:
            _require(
                self.sparsity_ratio is None or self.max_kv_tokens is None,
                "KVCompressor: give sparsity_ratio (fraction dropped) or max_kv_tokens (tokens kept), not both",
            )
            if self.sparsity_ratio is None and self.max_kv_tokens is None:
                object.__setattr__(self, "sparsity_ratio", DEFAULT_SPARSITY)
        _require(
            self.sparsity_ratio is None or 0.0 <= self.sparsity_ratio < 1.0,
            f"KVCompressor.sparsity_ratio must be in [0, 1), got {self.sparsity_ratio}",
        )
        _require(
            self.num_sink_tokens >= 0,
            f"KVCompressor.num_sink_tokens must be >= 0, got {self.num_sink_tokens}",
        )
        _require(
            self.recent_window >= 1, f"KVCompressor.recent_window must be >= 1, got {self.recent_window}"
        )
        protected = self.num_sink_tokens + self.recent_window
        _require(
            self.max_kv_tokens is None or self.max_kv_tokens > protected,
            f"KVCompressor.max_kv_tokens ({self.max_kv_tokens}) must exceed num_sink_tokens + recent_window "
            f"({protected}): those are always kept",
        )
        _require(0 < self.max_error <= 1, f"KVCompressor.max_error must be in (0, 1], got {self.max_error}")
        _require(
            self.observation_window >= 1,
            f"KVCompressor.observation_window must be >= 1, got {self.observation_window}",
        )
        _require(
            0 < self.heat_fraction <= 1,
            f"KVCompressor.heat_fraction must be in (0, 1], got {self.heat_fraction}",
        )
        _require(
            0 <= self.max_heavy_share <= 1,
            f"KVCompressor.max_heavy_share must be in [0, 1], got {self.max_heavy_share}",
        )
        _require(self.num_anchors >= 0, f"KVCompressor.num_anchors must be >= 0, got {self.num_anchors}")
        _require(
            self.anchor_tokens >= 1, f"KVCompressor.anchor_tokens must be >= 1, got {self.anchor_tokens}"
        )
        _require(
            self.lookahead_tokens >= 0,
            f"KVCompressor.lookahead_tokens must be >= 0, got {self.lookahead_tokens}",
        )
        _require(
            0 <= self.lookahead_weight <= 1,
            f"KVCompressor.lookahead_weight must be in [0, 1], got {self.lookahead_weight}",
        )
        _require(
            self.error_check_interval >= 1,
            f"KVCompressor.error_check_interval must be >= 1, got {self.error_check_interval}",
        )
        weights = self.layer_weights
        if isinstance(weights, str) and weights.strip() in (AUTO, UNIFORM):
            object.__setattr__(self, "layer_weights", None if weights.strip() == UNIFORM else AUTO)
        elif weights is not None:
            object.__setattr__(self, "layer_weights", parse_layer_weights(weights))
            _require(
                self.policy != "none",
                "KVCompressor.layer_weights share an eviction budget between layers; policy='none' has none",
            )

    def for_model(self, config: ModelConfig) -> KVCompressor:
        """This compressor with ``layer_weights="auto"`` resolved for ``config``: the weights calibrated for that
        model and policy (an installed ``mcp2026 kv calibrate`` file, else a built-in preset), else uniform."""
        if self.layer_weights != AUTO:
            return self
        found = auto_weights(config, self.policy)
        return dataclasses.replace(self, layer_weights=found[1] if found is not None else None)

    # --- construction from configs ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVCompressor:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        _require(not unknown, f"KVCompressor: unknown keys {unknown}; allowed: {', '.join(sorted(names))}")
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, source: str | Path) -> KVCompressor:
        """From a YAML file (or YAML text): the mapping itself, or under a top-level ``kv:`` key."""
        try:
            is_file = Path(source).is_file()
        except OSError:  # YAML text too long to be a file name
            is_file = False
        text = Path(source).read_text() if is_file else str(source)
        data = yaml.safe_load(text)
        if isinstance(data, Mapping) and set(data) == {"kv"}:
            data = data["kv"]
        _require(isinstance(data, Mapping), f"KVCompressor YAML must be a mapping, got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def coerce(cls, value: KVCompressor | Mapping[str, Any] | str | Path) -> KVCompressor:
        """A KVCompressor, a dict of its fields, or a YAML path / text."""
        if isinstance(value, KVCompressor):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if isinstance(value, (str, Path)):
            return cls.from_yaml(value)
        raise ValueError(f"kv must be a KVCompressor, a dict or a YAML path, got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # --- runtime pieces --------------------------------------------------------------------------------
    @property
    def evicts(self) -> bool:
        return self.policy != "none"

    def make_codec(self) -> KVCodec:
        return make_codec(self.dtype)

    def budget(self) -> EvictionBudget:
        return EvictionBudget(
            block_size=self.block_size,
            num_sink_tokens=self.num_sink_tokens,
            recent_window=self.recent_window,
            sparsity_ratio=self.sparsity_ratio,
            max_kv_tokens=self.max_kv_tokens,
            heat_fraction=self.heat_fraction,
            observation_window=self.observation_window,
            max_heavy_share=self.max_heavy_share,
            num_anchors=self.num_anchors,
            anchor_tokens=self.anchor_tokens,
            lookahead_tokens=self.lookahead_tokens,
            lookahead_weight=self.lookahead_weight,
        )

    def make_evictor(
        self, manager: KVCacheManager, max_model_len: int, cache: PagedKVCache | None = None
    ) -> KVEvictor | None:
        if not self.evicts:
            return None
        return KVEvictor(
            make_policy(self.policy, self.budget()),
            manager,
            max_model_len,
            cache,
            # "auto" unresolved (no model known here): uniform
            layer_weights=None if self.layer_weights == AUTO else self.layer_weights,
        )

    def inject(self, target: Any) -> Any:
        """Apply to an existing ``Pipeline`` (its engine is rebuilt; returns the pipeline) or ``LLMEngine``
        (returns a new engine on the same model). The engine must have no unfinished requests."""
        engine = target if hasattr(target, "with_kv_compressor") else getattr(target, "engine", None)
        _require(
            hasattr(engine, "with_kv_compressor"),
            f"KVCompressor.inject needs a Pipeline or an LLMEngine, got {type(target).__name__}",
        )
        _require(not engine.has_unfinished(), "KVCompressor.inject: the engine still has unfinished requests")
        new = engine.with_kv_compressor(self)
        if target is engine:
            return new
        target.engine = new
        return target
