"""Frozen, validated configs, one per layer of the system (model, quantization, KV cache, scheduler).

Each component receives only the config it needs. Validation happens in ``__post_init__`` so a bad value
fails where it is written, with a message that names the field and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from mcp2026.rope_types import check_rope_scaling


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM, Gemma 3, Qwen3-MoE, Mixtral); what one family
    implies beyond these fields (Gemma's scaled embeddings and extra norms) lives in its model class."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # transformers' rope_scaling fields under "rope_type" (one of ROPE_TYPES), e.g. {"rope_type": "llama3",
    # "factor": 8.0, ...}; None: plain RoPE
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: a query at position p sees keys p - sliding_window + 1 .. p. ``layer_types``
    # names each layer "sliding_attention" or "full_attention" (HF's names); None with a window set means every
    # layer slides (Mistral).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # rotary base of the sliding layers (Gemma 3); None: rope_theta
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    attention_scale: float | None = None  # query scale; None: 1 / sqrt(head_dim)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma)
    # Partial rotary (Phi-4-mini rotates 3/4 of each head): how many leading dims of each q/k head rotate, the
    # rest pass through unrotated; None rotates all head_dim dims.
    rotary_dim: int | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral): num_experts > 0 replaces the MLP of every layer not in
    # ``dense_layers`` (those keep intermediate_size) by experts of width ``moe_intermediate_size``; a softmax
    # router picks ``num_experts_per_tok`` per token, ``norm_topk_prob`` rescales their weights to sum to 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # None: intermediate_size
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # a list when read back from JSON
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            _require(getattr(self, name) > 0, f"model config: {name} must be > 0, got {getattr(self, name)}")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
        )
        _require(
            self.head_dim > 0 and self.head_dim % 2 == 0,
            f"model config: head_dim must be even, got {self.head_dim}",
        )
        _require(self.rms_norm_eps > 0, f"model config: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, f"model config: rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling, self.head_dim)
        _require(
            self.sliding_window is None or self.sliding_window > 0,
            f"model config: sliding_window must be > 0 or None, got {self.sliding_window}",
        )
        for name in ("rope_local_theta", "attention_scale", "final_logit_softcapping"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"model config: {name} must be > 0 or None, got {value}")
        _require(
            self.rotary_dim is None or (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0),
            f"model config: rotary_dim must be an even number in (0, head_dim={self.head_dim}] or None (all "
            f"dims rotate), got {self.rotary_dim}",
        )
        if self.layer_types is not None:
            _require(
                len(self.layer_types) == self.num_layers,
                f"model config: layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}",
            )
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            _require(
                not unknown, f"model config: layer_types {sorted(unknown)} unknown; known: {LAYER_TYPES}"
            )
            _require(
                self.sliding_window is not None or "sliding_attention" not in self.layer_types,
                "model config: layer_types has sliding_attention layers but sliding_window is not set",
            )
        self._check_experts()

    def _check_experts(self) -> None:
        if self.num_experts == 0:
            only_moe = self.num_experts_per_tok or self.dense_layers or self.moe_intermediate_size is not None
            _require(
                not only_moe,
                "model config: num_experts_per_tok, moe_intermediate_size and dense_layers apply to "
                "mixture-of-experts models only (num_experts > 0)",
            )
            return
        _require(
            0 < self.num_experts_per_tok <= self.num_experts,
            f"model config: num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
            f"{self.num_experts_per_tok}",
        )
        _require(
            (self.moe_intermediate_size or 1) > 0
            and all(0 <= i < self.num_layers for i in self.dense_layers),
            f"model config: moe_intermediate_size must be > 0 or None (got {self.moe_intermediate_size}) and "
            f"dense_layers {list(self.dense_layers)} must name layers in 0..{self.num_layers - 1}",
        )

    def attention_window(self, layer: int) -> int | None:
        """How many positions (itself included) a query of ``layer`` sees; None: the whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def has_experts(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (else one dense MLP)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def expert_size(self) -> int:  # the intermediate width of one expert
        return self.moe_intermediate_size or self.intermediate_size

    def query_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        per_layer = attn + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        moe = self.num_experts * 3 * h * self.expert_size + self.num_experts * h  # experts + router
        mlps = sum(moe if self.has_experts(layer) else 3 * h * i for layer in range(self.num_layers))
        return self.num_layers * per_layer + mlps + v * h * (1 if self.tie_word_embeddings else 2) + h


PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4", "fp8", "auto")
QUANT_METHODS = ("auto", "rtn", "gptq", "learned")
LM_HEAD_PRECISIONS = ("auto", "fp32", "bf16", "fp16", "int8", "int4", "fp8")
GRANULARITIES = ("auto", "per_channel", "per_group", "per_tensor")


@dataclass(frozen=True)
class QuantConfig:
    """What precision the weights should run in, and how the DQG may choose it per layer.

    ``target_precision`` "fp32"/"bf16"/"fp16" means no weight quantization (the activation dtype);
    "int8"/"int4"/"fp8" quantize every linear; "auto" lets the DQG pick per layer within a budget.
    ``lm_head_precision``: the output (vocabulary) projection's format. "auto": int8 under a uniform int4 target
    (as llama.cpp's 4-bit files keep their output in 8 bits: int4 there costs most of int4's perplexity), the
    target's format otherwise, and the DQG's choice with ``enable_dqg``; a format pins it in every mode.
    ``method``: how int4 levels are chosen: "rtn" rounds to nearest; "gptq" minimises each layer's output
    error on calibration text (quant/gptq.py), layer after layer; "learned" learns each group's scale (and zero)
    from round-to-nearest's on calibration text (quant/learned_scales.py); the plan and its storage are the same.
    "auto" (default): "gptq" for a DQG plan (its calibration text is at hand), else "rtn" (``levels_method``).
    ``int4_scale_bits``: a uniform int4 target's grids: 16 (fp16) or 8 (8-bit codes; the DQG measures both).
    ``enable_dtss`` and ``max_kv_cache_shards`` are forwarded to the KV cache (DTSS: kv/dtss.py).
    """

    target_precision: str = "auto"
    enable_dqg: bool = False
    bits_budget: float | None = None  # average bits per weight, scales and zero points included
    # A second, smaller DQG budget: the engine then holds a pressure plan beside the quality plan
    # (quant/gate.py) and the server's traffic gate switches to it under load.
    pressure_bits_budget: float | None = None
    bytes_budget: int | None = None
    max_ppl_increase: float | None = None  # relative, 0.01 = +1%
    group_size: int = 32
    granularity: str = "auto"
    symmetric: bool = False
    lm_head_precision: str = "auto"
    method: str = "auto"
    int4_scale_bits: int = 16
    calibration_source: str = "sharegpt"
    calibration_samples: int = 32
    strict: bool = False
    enable_dtss: bool = False
    max_kv_cache_shards: int = 1

    def __post_init__(self) -> None:
        _require(
            self.target_precision in PRECISIONS,
            f"QuantConfig.target_precision must be one of {PRECISIONS}, got {self.target_precision!r}",
        )
        _require(
            self.granularity in GRANULARITIES,
            f"QuantConfig.granularity must be one of {GRANULARITIES}, got {self.granularity!r}",
        )
        _require(
            self.lm_head_precision in LM_HEAD_PRECISIONS,
            f"QuantConfig.lm_head_precision must be one of {LM_HEAD_PRECISIONS}, got {self.lm_head_precision!r}",
        )
        _require(
            self.method in QUANT_METHODS,
            f"QuantConfig.method must be one of {QUANT_METHODS}, got {self.method!r}",
        )
        _require(
            self.method in ("auto", "rtn") or self.pressure_bits_budget is None,
            f"QuantConfig.method={self.method!r} builds one plan; a pressure plan (pressure_bits_budget) needs "
            "method='rtn'",
        )
        _require(
            self.int4_scale_bits == 16
            or (self.int4_scale_bits == 8 and not self.symmetric and self.method != "learned"),
            "QuantConfig.int4_scale_bits must be 16 (fp16 grids) or 8 (8-bit codes, which need symmetric=False and a "
            f"method other than 'learned'), got {self.int4_scale_bits!r} (symmetric={self.symmetric}, method={self.method!r})",
        )
        _require(
            self.group_size in (32, 64, 128),
            f"QuantConfig.group_size must be 32, 64 or 128, got {self.group_size}",
        )
        _require(
            not (self.target_precision == "int8" and self.granularity == "per_group")
            or self.group_size == 32,
            f"QuantConfig: int8 per_group stores groups of 32 values (GGUF's Q8_0 blocks), got group_size={self.group_size}",
        )
        _require(
            self.bits_budget is None or 2.0 <= self.bits_budget <= 32.0,
            f"QuantConfig.bits_budget must be in [2, 32] bits per weight, got {self.bits_budget}",
        )
        _require(
            self.pressure_bits_budget is None
            or (self.enable_dqg and 2.0 <= self.pressure_bits_budget <= 32.0),
            "QuantConfig.pressure_bits_budget needs enable_dqg=True and a value in [2, 32] bits per weight, "
            f"got {self.pressure_bits_budget} (enable_dqg={self.enable_dqg})",
        )
        _require(
            self.pressure_bits_budget is None
            or self.bits_budget is None
            or self.pressure_bits_budget < self.bits_budget,
            f"QuantConfig.pressure_bits_budget ({self.pressure_bits_budget}) must be below bits_budget "
            f"({self.bits_budget}): the pressure plan is the smaller, faster one",
        )
        _require(
            self.bytes_budget is None or self.bytes_budget > 0,
            f"QuantConfig.bytes_budget must be > 0, got {self.bytes_budget}",
        )
        _require(
            self.max_ppl_increase is None or self.max_ppl_increase > 0,
            f"QuantConfig.max_ppl_increase must be > 0 (relative), got {self.max_ppl_increase}",
        )
        _require(
            self.calibration_samples >= 1,
            f"QuantConfig.calibration_samples must be >= 1, got {self.calibration_samples}",
        )
        _require(
            1 <= self.max_kv_cache_shards <= 64,
            f"QuantConfig.max_kv_cache_shards must be in [1, 64], got {self.max_kv_cache_shards}",
        )

    @property
    def levels_method(self) -> str:
        """``method`` with "auto" resolved: GPTQ for one DQG plan (a pressure plan is round-to-nearest)."""
        auto = "gptq" if self.enable_dqg and self.pressure_bits_budget is None else "rtn"
        return auto if self.method == "auto" else self.method

    @property
    def quantizes_weights(self) -> bool:
        quantized = ("int8", "int4", "fp8")
        return self.enable_dqg or self.target_precision in quantized or self.lm_head_precision in quantized


DEFAULT_BLOCK_SIZE = 16  # tokens per KV block without a compressor that says otherwise


class BlockSizedCompressor(Protocol):
    """What the engine config reads of a KV compressor (``kv.compressor.KVCompressor``, a layer above)."""

    @property
    def block_size(self) -> int: ...

    @staticmethod
    def describe_default_block_sizes() -> str:
        """Each codec's default block size, for the error text when the block sizes disagree."""
        ...


@dataclass(frozen=True)
class KVConfig:
    """Paged KV cache: block size and the memory budget that sizes the preallocated pool.

    Exactly one of ``memory_gb`` / ``memory_fraction`` sizes the pool; ``memory_fraction`` is a share of the
    memory available now (cgroup limits counted). ``num_blocks`` overrides both (tests, tiny pools).
    ``block_size`` None: the KV compressor's (its codec's default), else 16 (``EngineConfig.block_size``);
    it stays None here, so a later compressor still decides.
    """

    block_size: int | None = None
    memory_gb: float | None = None
    memory_fraction: float = 0.2
    num_blocks: int | None = None
    max_kv_cache_shards: int = 1
    enable_dtss: bool = False
    # DTSS: take a shard offline when free memory falls below low, bring one back above high (of total RAM).
    dtss_low_free_fraction: float = 0.05
    dtss_high_free_fraction: float = 0.15
    dtss_check_interval_steps: int = 8
    enable_prefix_caching: bool = True
    # Cached prefix blocks no request holds are kept up to this many GB; past it the least recently used go back
    # to the free list, whose lowest blocks are reused first. The pool is reserved address space, committed as
    # blocks are first written: without a bound, a server caching every finished prompt would write (and keep
    # resident) every block of its pool in turn. None: keep cached blocks until the pool runs out.
    prefix_cache_gb: float | None = 0.25

    def __post_init__(self) -> None:
        _require(
            self.prefix_cache_gb is None or self.prefix_cache_gb >= 0,
            f"KVConfig.prefix_cache_gb must be >= 0 or None, got {self.prefix_cache_gb}",
        )
        _require(
            self.block_size is None or self.block_size in (8, 16, 32, 64, 128),
            f"KVConfig.block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}",
        )
        _require(
            self.memory_gb is None or self.memory_gb > 0,
            f"KVConfig.memory_gb must be > 0, got {self.memory_gb}",
        )
        _require(
            0 < self.memory_fraction <= 0.95,
            f"KVConfig.memory_fraction must be in (0, 0.95], got {self.memory_fraction}",
        )
        _require(
            self.num_blocks is None or self.num_blocks >= 1,
            f"KVConfig.num_blocks must be >= 1, got {self.num_blocks}",
        )
        _require(
            1 <= self.max_kv_cache_shards <= 64,
            f"KVConfig.max_kv_cache_shards must be in [1, 64], got {self.max_kv_cache_shards}",
        )
        _require(
            0 < self.dtss_low_free_fraction < self.dtss_high_free_fraction < 1,
            "KVConfig needs 0 < dtss_low_free_fraction < dtss_high_free_fraction < 1, "
            f"got {self.dtss_low_free_fraction} and {self.dtss_high_free_fraction}",
        )
        _require(
            not self.enable_dtss or self.max_kv_cache_shards >= 2,
            "KVConfig.enable_dtss needs max_kv_cache_shards >= 2 (one shard always stays online)",
        )


SCHEDULING_POLICIES = ("fcfs", "priority", "deadline", "sjf")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step token budget and batch limits. Long contexts get fewer sequences through the token budget."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's context length
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = (
        512  # a prefill chunk larger than this is split to keep decodes flowing (see long_prefill_ms)
    )
    # ... unless the engine's measured prefill rate says a chunk of a multiple of it still runs within this many
    # ms: the split point follows the hardware (a faster prefill takes larger chunks, so a long prompt needs fewer
    # steps while decodes still get a step at least every ~second). None: the threshold alone.
    long_prefill_ms: float | None = 1000.0
    # "sjf" only: a second of waiting counts as this many prompt tokens, so a prompt is overtaken by shorter ones
    # for at most (its length - theirs) / this seconds (1000: ~1 ms per token, the order of a CPU's prefill rate)
    aging_tokens_per_s: float = 1000.0

    def __post_init__(self) -> None:
        _require(
            self.max_num_batched_tokens >= 16,
            f"SchedulerConfig.max_num_batched_tokens must be >= 16, got {self.max_num_batched_tokens}",
        )
        _require(
            self.max_num_seqs >= 1, f"SchedulerConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}"
        )
        _require(
            self.policy in SCHEDULING_POLICIES,
            f"SchedulerConfig.policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}",
        )
        _require(
            self.long_prefill_ms is None or self.long_prefill_ms > 0,
            f"SchedulerConfig.long_prefill_ms must be > 0 or None, got {self.long_prefill_ms}",
        )
        _require(
            self.aging_tokens_per_s > 0,
            f"SchedulerConfig.aging_tokens_per_s must be > 0, got {self.aging_tokens_per_s}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 16,
            f"SchedulerConfig.max_model_len must be >= 16, got {self.max_model_len}",
        )


SPECULATIVE_METHODS = ("ngram", "off")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a decode step also computes up to ``num_tokens`` drafted tokens, and the sampler
    keeps the longest prefix of them that it would have produced itself, plus its own next token. Exact: the
    output is what plain decoding gives (greedy: the same tokens; sampled: the same distribution, and a seeded
    request the same tokens). ``ngram`` drafts by prompt lookup: the tokens that followed the latest earlier
    occurrence of the sequence's last ``max_ngram`` .. ``min_ngram`` tokens. Whether and how far to draft is
    decided per request and step from its measured acceptance and the measured cost of longer steps, so a
    request whose drafts keep failing (free-form chat) stops drafting."""

    method: str = "ngram"  # ngram | off
    # the most draft tokens per request and step (the cost model picks fewer where they pay)
    num_tokens: int = 8
    min_ngram: int = 2
    max_ngram: int = 4

    def __post_init__(self) -> None:
        _require(
            self.method in SPECULATIVE_METHODS,
            f"SpeculativeConfig.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
        )
        _require(
            1 <= self.num_tokens <= 16,
            f"SpeculativeConfig.num_tokens must be in 1..16, got {self.num_tokens}",
        )
        _require(
            1 <= self.min_ngram <= self.max_ngram <= 16,
            f"SpeculativeConfig needs 1 <= min_ngram <= max_ngram <= 16, got {self.min_ngram}, {self.max_ngram}",
        )

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, grouped; each part goes only to the component that uses it."""

    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # KV codec and eviction policy (``kv.compressor.KVCompressor``); None stores KV as the model's dtype.
    kv_compressor: BlockSizedCompressor | None = None
    # On CUDA, decode-only steps of up to this many sequences replay a captured graph of the whole forward
    # (``engine.decode_graphs``); 0 runs every step eagerly. Capped by ``scheduler.max_num_seqs``.
    cuda_graph_max_batch: int = 256
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        _require(
            self.cuda_graph_max_batch >= 0,
            f"EngineConfig.cuda_graph_max_batch must be >= 0 (0 = off), got {self.cuda_graph_max_batch}",
        )
        compressor = self.kv_compressor
        if compressor is not None and self.kv.block_size not in (None, compressor.block_size):
            raise ValueError(
                f"KVCompressor.block_size ({compressor.block_size}) must equal KVConfig.block_size "
                f"({self.kv.block_size}): the compressor works on the cache's blocks. Give the same "
                "block_size to both, or leave KVConfig.block_size (kv.block_size in a serve YAML) unset to "
                "take the compressor's (a KVCompressor without block_size takes its codec's: "
                f"{compressor.describe_default_block_sizes()})"
            )

    @property
    def block_size(self) -> int:
        """Tokens per KV block: KVConfig's if given, else the compressor's (its codec's default), else 16."""
        if self.kv.block_size is not None:
            return self.kv.block_size
        return self.kv_compressor.block_size if self.kv_compressor is not None else DEFAULT_BLOCK_SIZE

    @property
    def resolved_kv(self) -> KVConfig:
        """``kv`` with ``block_size`` filled in: what the cache is built from."""
        return replace(self.kv, block_size=self.block_size)
