"""Settings of ``mcp2026 bench kv``: the grid of KV configs and how each is named. A config is a codec
(``int8``: K/V stored with it, nothing evicted), a policy at a sparsity (``heavy_hitter@0.7``: K/V stored
as the model's dtype, 70% of the context dropped), or both (``int4+heavy_hitter@0.7``: what a deployment
short of memory would run, and whether the two losses add up).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mcp2026.bench.kv_peer import LLAMA_KV_TYPES
from mcp2026.bench.weights import check_weights
from mcp2026.kv.compressor import BLOCK_SIZES, KVCompressor

PROMPT_CHUNK = 256  # prefill chunk of the prompt half (memory: every engine holds one chunk of logits)
DECODE_SPARSITY = 0.7  # "70% eviction", the setting the decode-speed target is stated for
MAX_CONTEXT = 8192
TEXTS = ("sharegpt", "random")


def config_name(policy: str, sparsity: float) -> str:
    return f"{policy}@{sparsity:g}"


def _parts(name: str, identity: str) -> tuple[str, str | None]:
    """(codec, "POLICY@SPARSITY" or None) of a config name; a policy alone stores K/V as ``identity``."""
    codec, plus, evict = (part.strip() for part in name.partition("+"))
    if plus:
        return codec, evict
    return (identity, codec) if "@" in codec else (codec, None)


def codec_of(name: str, identity: str) -> str:
    """The codec a config stores K/V with: ``int4`` for ``int4`` and ``int4+heavy_hitter@0.7``,
    ``identity`` (the model's dtype) for ``heavy_hitter@0.7``."""
    return _parts(name, identity)[0]


def _option(name: str, text: str, types: dict[str, str]) -> tuple[str, int | float | str]:
    """``FIELD=NUMBER`` -> (field, value as the field's type: an int field takes whole numbers only);
    ``layer_weights=W0/W1/...`` as given."""
    key, eq, value = (part.strip() for part in text.partition("="))
    if not eq or not key:
        raise ValueError(f"KV config {name!r}: expected :FIELD=NUMBER options, e.g. :lookahead_tokens=16")
    if key in ("dtype", "policy", "sparsity_ratio", "block_size"):
        raise ValueError(f"KV config {name!r}: set codec, policy, sparsity and block size in the name itself")
    if key not in types:
        raise ValueError(f"KV config {name!r}: {key} is no KVCompressor field; see `KVCompressor` for them")
    if key == "layer_weights":  # one weight per layer, "w0/w1/..." (KVCompressor checks them)
        return key, value
    is_int = "int" in types[key] and "float" not in types[key]
    try:
        return key, int(value) if is_int else float(value)
    except ValueError:
        kind = "a whole number" if is_int else "a number"
        raise ValueError(f"KV config {name!r}: {key} takes {kind}, got {value!r}") from None


def parse_config(name: str, identity: str, block_size: int | None = None) -> Any:
    """``int8`` (a codec, no eviction), ``heavy_hitter@0.7`` (a policy at a sparsity, K/V stored as
    ``identity``, the model's dtype) or ``int4+heavy_hitter@0.7`` (both) -> KVCompressor. A policy may carry
    KVCompressor fields: ``heavy_hitter@0.7:lookahead_tokens=16:num_anchors=0``. ``block_size`` None: the
    codec's default."""

    codec, evict = _parts(name, identity)
    if evict is None:
        return KVCompressor(dtype=codec, policy="none", block_size=block_size)
    if "@" not in evict:
        raise ValueError(f"KV config {name!r}: expected CODEC+POLICY@SPARSITY, e.g. int4+heavy_hitter@0.7")
    policy, _, rest = evict.partition("@")
    sparsity, *options = rest.split(":")
    try:
        ratio = float(sparsity)
    except ValueError:
        raise ValueError(f"KV config {name!r}: expected POLICY@SPARSITY, e.g. heavy_hitter@0.7") from None
    types = {f.name: str(f.type) for f in dataclasses.fields(KVCompressor)}
    pairs = [_option(name, o, types) for o in options]
    fields = dict(pairs)
    if len(fields) < len(pairs):
        raise ValueError(f"KV config {name!r}: a field is given twice")
    return KVCompressor(dtype=codec, policy=policy, sparsity_ratio=ratio, block_size=block_size, **fields)


@dataclass(frozen=True)
class KVBenchConfig:
    model: str | None = None  # None: the embedded default model
    dtype: str = "fp32"  # activations, and how the reference (and eviction rows) store K/V
    context_tokens: int = 2048
    num_sequences: int = 1
    codecs: tuple[str, ...] = ("int8", "int4", "fp8")
    policies: tuple[str, ...] = ("sink_window", "heavy_hitter", "snap", "dynamic_window")
    sparsities: tuple[float, ...] = (0.5, 0.7, 0.9)
    combined: tuple[str, ...] = ()  # codec + eviction rows, e.g. int4+heavy_hitter@0.7
    block_size: int | None = None  # None: each codec's default (16; int4 32, int4-g64 64)
    chunk_size: int = 32  # teacher-forced chunk after the prompt half (1 = token by token)
    retrieval_seeds: int = 50  # 20 gave 5-point steps around the 90% target
    retrieval_tokens: int = 1024  # prompt length of the retrieval check
    retrieval_configs: tuple[str, ...] = ("heavy_hitter@0.7",)
    budget_gb: float = 1.0
    concurrent_len: int = 2048
    decode_context: int = 4096  # 0: skip the decode-speed comparison
    decode_tokens: int = 32
    decode_policy: str = "heavy_hitter"
    # weights of the decode-speed engines: "" = as loaded in --dtype; int8 | int4 | fp8 | dqg:BITS quantized (what
    # a long-context deployment would serve; the less time the weights take, the more the KV reads count)
    decode_weights: str = ""
    # more configs timed in the decode comparison, each vs uncompressed: codecs (what a quantized cache's
    # decode-on-read costs or saves), codec + policy rows (int4+heavy_hitter@0.7)
    decode_configs: tuple[str, ...] = ()
    text: str = "sharegpt"  # sharegpt | random (models without a tokenizer always use random ids)
    seed: int = 0
    # llama.cpp's own KV cache types scored on the same sequences (bench.kv_peer); () skips the peer
    llama_cpp_kv: tuple[str, ...] = ("q8_0", "q4_0")

    def __post_init__(self) -> None:
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"--dtype must be fp32 or bf16, got {self.dtype!r}")
        if not 16 <= self.context_tokens <= MAX_CONTEXT:
            raise ValueError(f"--context-tokens must be in [16, {MAX_CONTEXT}], got {self.context_tokens}")
        for name in ("num_sequences", "chunk_size", "concurrent_len", "decode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.retrieval_seeds < 0 or self.decode_context < 0:
            raise ValueError("--retrieval-seeds and --decode-context must be >= 0 (0 skips that part)")
        if self.retrieval_tokens < 64:
            raise ValueError(f"--retrieval-tokens must be >= 64, got {self.retrieval_tokens}")
        if self.budget_gb <= 0:
            raise ValueError(f"--budget-gb must be > 0, got {self.budget_gb}")

        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            raise ValueError(f"--block-size must be one of {BLOCK_SIZES}, got {self.block_size}")
        if self.text not in TEXTS:
            raise ValueError(f"--text must be one of {', '.join(TEXTS)}, got {self.text!r}")
        # "int4 + heavy_hitter@0.7" and "int4+heavy_hitter@0.7" are one config (one row, one name)
        object.__setattr__(self, "combined", tuple(n.replace(" ", "") for n in self.combined))
        object.__setattr__(
            self, "retrieval_configs", tuple(n.replace(" ", "") for n in self.retrieval_configs)
        )
        for name in self.combined:
            if "+" not in name or "@" not in name:
                raise ValueError(
                    f"--combined takes CODEC+POLICY@SPARSITY rows, e.g. int4+heavy_hitter@0.7, got {name!r}"
                )
        if not self.grid():
            raise ValueError("nothing to measure: give at least one codec or one policy with a sparsity")
        for name in self.retrieval_configs:
            parse_config(name, self.identity, self.block_size)
        parse_config(config_name(self.decode_policy, DECODE_SPARSITY), self.identity, self.block_size)
        object.__setattr__(self, "decode_configs", tuple(n.replace(" ", "") for n in self.decode_configs))
        for name in self.decode_configs:
            parse_config(name, self.identity, self.block_size)

        # f16 is the peer's reference, not a type to compare
        unknown = sorted((set(self.llama_cpp_kv) - set(LLAMA_KV_TYPES)) | ({"f16"} & set(self.llama_cpp_kv)))
        if unknown:
            raise ValueError(
                f"--llama-cpp-kv takes {', '.join(t for t in LLAMA_KV_TYPES if t != 'f16')} (f16 is the "
                f"reference) or none, got {unknown}"
            )
        if self.decode_weights:
            check_weights((self.decode_weights,), ("int8", "int4", "fp8"))

    @property
    def identity(self) -> str:
        """The codec that stores K/V as the model computes them."""
        return self.dtype

    @property
    def prompt_len(self) -> int:
        return self.context_tokens // 2

    def grid(self) -> list[tuple[str, Any]]:
        """(name, KVCompressor) of every quality row: codecs, then policies x sparsities."""
        names = [
            *self.codecs,
            *(config_name(p, s) for p in self.policies for s in self.sparsities),
            *self.combined,
        ]
        return [(n, parse_config(n, self.identity, self.block_size)) for n in dict.fromkeys(names)]

    def command(self) -> str:
        parts = ["mcp2026 bench kv"]
        if self.model:
            parts.append(f"--model {self.model}")
        parts += [
            f"--dtype {self.dtype}",
            f"--context-tokens {self.context_tokens}",
            f"--num-sequences {self.num_sequences}",
            f"--codecs {','.join(self.codecs) or 'none'}",
            f"--policies {','.join(self.policies) or 'none'}",
            f"--sparsities {','.join(f'{s:g}' for s in self.sparsities)}",
            *([f"--combined {','.join(self.combined)}"] if self.combined else []),
            *([f"--block-size {self.block_size}"] if self.block_size is not None else []),
            f"--chunk-size {self.chunk_size}",
            f"--retrieval-seeds {self.retrieval_seeds}",
            f"--retrieval-tokens {self.retrieval_tokens}",
            f"--retrieval-configs {','.join(self.retrieval_configs) or 'none'}",
            f"--budget-gb {self.budget_gb:g}",
            f"--concurrent-len {self.concurrent_len}",
            f"--decode-context {self.decode_context}",
            f"--decode-tokens {self.decode_tokens}",
            f"--decode-policy {self.decode_policy}",
            *([f"--decode-weights {self.decode_weights}"] if self.decode_weights else []),
            *([f"--decode-configs {','.join(self.decode_configs)}"] if self.decode_configs else []),
            f"--text {self.text}",
            f"--seed {self.seed}",
            f"--llama-cpp-kv {','.join(self.llama_cpp_kv) or 'none'}",
        ]
        return " ".join(parts)


# --quick: a small grid that still exercises every part (a smoke run, or a first look).
QUICK = dict(
    context_tokens=1024,
    codecs=("int8", "int4"),
    policies=("heavy_hitter",),
    sparsities=(0.7,),
    retrieval_seeds=4,
    retrieval_tokens=512,
    decode_context=1024,
    decode_tokens=16,
)


def make_config(quick: bool = False, **given: Any) -> KVBenchConfig:
    """Defaults (or the --quick grid), overridden by the options given (None = not given)."""
    values = {**(QUICK if quick else {}), **{k: v for k, v in given.items() if v is not None}}
    return KVBenchConfig(**values)
