"""GGUF files: metadata -> ModelConfig, tensors -> our layout: block-quantized linears kept as their stored
blocks (``gguf_blocks``) when asked, everything else dequantized by the ``gguf`` package.

llama.cpp's converter permutes Q and K rows for its rotary layout; we undo that so both formats share the
HF "rotate half" convention. Every tensor type the gguf package can dequantize is accepted on the float path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from mcp2026.config import ModelConfig
from mcp2026.errors import ModelLoadError
from mcp2026.loading.gguf_blocks import BLOCK_FORMATS, read_block_rows, read_blocks
from mcp2026.loading.gguf_file import GGUFFile, GGUFFormatError, GGUFTensorInfo
from mcp2026.loading.names import (
    GGUF_GLOBAL_NAMES,
    GGUF_LAYER,
    GGUF_LAYER_NAMES,
    PendingBlocks,
    Weight,
    expert_name,
    is_expert_stack,
    map_name,
)
from mcp2026.loading.progress import load_progress
from mcp2026.loading.rope_scaling import normalized_rope_scaling
from mcp2026.models.registry import family_of, resolve_architecture
from mcp2026.quant.block_linear import BlockLinear, BlockWeights, packable
from mcp2026.rope_types import unsupported_rope_type

log = logging.getLogger(__name__)

# Our names of the matrices a GGUF's stored blocks may stay quantized in (the linears and the token table).
NATIVE_SUFFIXES = ("q.weight", "k.weight", "v.weight", "o_proj.weight", "gate.weight", "up.weight",
                   "down_proj.weight", "embed_tokens.weight", "lm_head.weight",
                   "qkv.weight", "gate_up.weight")  # fmt: skip


def open_gguf(path: Path) -> GGUFFile:
    """The parsed header and tensor table, or a one-line error naming the file and what is wrong with it."""
    try:
        gguf_file = GGUFFile.open(path)
    except GGUFFormatError as e:
        problem = (
            str(e) if str(e).startswith("not a GGUF file") else f"truncated or corrupted GGUF file ({e})"
        )
        raise ModelLoadError(f"{path}: {problem}") from None
    truncated = gguf_file.truncated_tensors()
    if truncated:
        raise ModelLoadError(
            f"{path}: truncated or corrupted GGUF file: tensor {truncated[0].name} ends past the file's "
            f"{gguf_file.file_bytes} bytes (re-download or re-convert it)"
        )
    return gguf_file


def gguf_field(gguf_file: GGUFFile, key: str, default: Any = None) -> Any:
    return gguf_file.metadata.get(key, default)


def config_from_gguf(reader: GGUFFile, source: str) -> ModelConfig:
    """The config a parsed GGUF describes (its rope_freqs tensor, when it has one, is read into rope_scaling)."""
    arch = resolve_architecture(str(gguf_field(reader, "general.architecture", "")), source)
    with_experts = family_of(arch).gguf_with_experts
    # the registry name the model runs as; the metadata keys keep the file's prefix
    architecture = with_experts if with_experts and gguf_field(reader, f"{arch}.expert_count") else arch

    def get(key: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer lists appear in some hybrid models
        kv_heads = kv_heads[0]
    scaling, context = _rope(reader, arch, int(get("context_length", 4096)), source)
    names = {t.name for t in reader.tensors}
    if "rope_factors_long.weight" in names:
        raise ModelLoadError(
            f"{source}: LongRoPE scaling (rope_factors_long/short tensors: Phi-3 128k, Phi-3.5, Phi-4-mini) "
            "is not supported"
        )
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", hidden // heads))
    # the dims of each head llama.cpp rotates; fewer than head_dim: partial rotary (Phi-4-mini)
    rotary_dim = int(gguf_field(reader, f"{arch}.rope.dimension_count", head_dim))
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    try:
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=int(gguf_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        )
        family_fields = family_of(architecture).gguf_config(lambda key: gguf_field(reader, f"{arch}.{key}"))
        return ModelConfig(**{**fields, **family_fields})
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent GGUF metadata: {e}") from None


# GGUF yarn keys (as llama.cpp's converter writes them from config.json) -> transformers' rope_scaling fields
YARN_FIELDS = {
    "rope.scaling.original_context_length": "original_max_position_embeddings",
    "rope.scaling.yarn_beta_fast": "beta_fast",
    "rope.scaling.yarn_beta_slow": "beta_slow",
    "rope.scaling.yarn_attn_factor": "attention_factor",
}
# llama.cpp yarn settings that transformers' YaRN has no field for (with the value that means "off")
YARN_UNMATCHED = {"rope.scaling.yarn_ext_factor": 1.0, "rope.scaling.yarn_log_multiplier": 0.0}


def _rope_scaling(reader: GGUFFile, arch: str, source: str) -> dict[str, Any] | None:
    """The rope scaling a GGUF's metadata names, under transformers' field names."""
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    scaling: dict[str, Any] | None = None
    if kind in ("linear", "yarn"):
        factor = gguf_field(reader, f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ModelLoadError(
                f"{source}: GGUF metadata names {kind} rope scaling but lacks {arch}.rope.scaling.factor"
            )
        scaling = {"rope_type": kind, "factor": float(factor)}
    elif kind not in (None, "none"):
        raise ModelLoadError(
            f"{source}: GGUF metadata {arch}.rope.scaling.type: {unsupported_rope_type(kind)}"
        )
    if kind == "yarn":
        for key, name in YARN_FIELDS.items():
            if (value := gguf_field(reader, f"{arch}.{key}")) is not None:
                scaling[name] = value
        for key, off in YARN_UNMATCHED.items():
            value = gguf_field(reader, f"{arch}.{key}")
            if value is not None and float(value) != off:
                raise ModelLoadError(
                    f"{source}: GGUF metadata {arch}.{key} = {value} is not supported (YaRN runs as transformers "
                    f"computes it, which has no such setting; only {off} is)"
                )
    return scaling


def _rope(reader: GGUFFile, arch: str, context_length: int, source: str) -> tuple[dict[str, Any] | None, int]:
    """(rope_scaling, context length): the scaling the metadata names, or the file's rope_freqs tensor."""
    scaling, context = normalized_rope_scaling(_rope_scaling(reader, arch, source), context_length, source)
    freq_factors = _rope_freqs(reader, source)
    if freq_factors is None:
        return scaling, context
    if scaling is not None:
        raise ModelLoadError(
            f"{source}: the GGUF has both {scaling['rope_type']} rope scaling and a rope_freqs tensor; "
            "only one is supported"
        )
    return {"rope_type": "freq_factors", "freq_factors": freq_factors}, context


def _rope_freqs(reader: GGUFFile, source: str) -> list[float] | None:
    """llama.cpp's per-dimension frequency divisors (``rope_freqs``: angle_i = p * base^(-2i/d) / freqs[i]), the
    form its converter stores Llama 3.1 scaling in; None when the file has none."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return [float(f) for f in _read_float(reader, t, source).reshape(-1)]
    return None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute: rows (heads, 2, hd/2) were stored as (heads, hd/2, 2)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _unpermute_rows(rows: int, n_heads: int) -> torch.Tensor:
    """The row order ``_unpermute`` produces, as an index into the stored rows."""
    return torch.from_numpy(_unpermute(np.arange(rows).reshape(rows, 1), n_heads)[:, 0].copy())


def _heads_of(ours: str, config: ModelConfig) -> int | None:
    """The head count whose rotary permutation a q or k tensor carries; None for the others (and for every
    tensor of a family llama.cpp stores unpermuted)."""
    if not family_of(config.architecture).gguf_rope_permuted:
        return None
    if ours.endswith(("q.weight", "q.bias")):
        return config.num_heads
    if ours.endswith(("k.weight", "k.bias")):
        return config.num_kv_heads
    return None


def _read_float(reader: GGUFFile, t: GGUFTensorInfo, source: str) -> np.ndarray:
    try:
        return dequantize(reader.raw(t), t.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"{source}: tensor {t.name} has type {t.tensor_type.name}, which the gguf package cannot dequantize"
        ) from None
    except Exception as e:
        raise ModelLoadError(f"{source}: tensor {t.name} cannot be read ({type(e).__name__}: {e})") from None


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def keeps_blocks(t: GGUFTensorInfo, ours: str, source: str) -> bool:
    """Whether a matrix stays in its stored blocks: a linear or token table of a block type we run exactly.

    A block type we cannot run exactly is an error naming the tensor (the float path still loads it); a matrix
    the GEMM tiles do not fit (rows not in 16s, K not in 32s) runs as floats, with a warning naming it."""
    type_name = t.tensor_type.name
    matrix = len(t.dims) == 2 or (len(t.dims) == 3 and is_expert_stack(ours))  # each expert's is a matrix
    if not matrix or not ours.endswith(NATIVE_SUFFIXES) or type_name in FLOAT_TYPES:
        return False
    if type_name not in BLOCK_FORMATS:
        raise ModelLoadError(
            f"{source}: tensor {t.name} is stored as {type_name}, which mcp2026 cannot run as stored (it runs "
            f"{', '.join(BLOCK_FORMATS)}); load the model as floats instead: dtype='fp32' or 'bf16' "
            "(--dtype fp32)"
        )
    if not packable(t.shape[-2:]):
        log.warning(
            "%s: tensor %s %s runs as floats: the block GEMM needs rows in 16s and columns in 32s",
            source, t.name, tuple(t.shape),
        )  # fmt: skip
        return False
    return True


def load_gguf_tensors(
    reader: GGUFFile, config: ModelConfig, dtype: torch.dtype, source: str, native: bool = False
) -> dict[str, Weight]:
    """Every tensor under our name: float ``dtype`` tensors, or with ``native`` the block-quantized matrices as
    ``BlockWeights`` (their stored values, exactly; see ``keeps_blocks``)."""
    tensors: dict[str, Weight] = {}
    layer_names = {**GGUF_LAYER_NAMES, **family_of(config.architecture).gguf_layer_names}
    with load_progress(f"loading {Path(source).name}", len(reader.tensors)) as advance:
        for t in reader.tensors:
            ours = map_name(t.name, GGUF_LAYER, layer_names, GGUF_GLOBAL_NAMES, config.architecture)
            advance(1)
            if ours is None:
                continue
            if len(t.dims) == 3 and is_expert_stack(ours):
                tensors.update(
                    _experts(reader, t, ours, native and keeps_blocks(t, ours, source), dtype, source)
                )
                continue
            heads = _heads_of(ours, config)
            if native and keeps_blocks(t, ours, source):  # read when fuse_weights reaches its layer
                tensors[ours] = PendingBlocks(
                    torch.Size(t.shape),
                    functools.partial(_blocks, reader, t, heads),
                    # the token table and output head only: a layer's weights are fused before packing
                    None if ours.startswith("layers.") else functools.partial(_packed_blocks, reader, t),
                )
                continue
            data = _read_float(reader, t, source)
            if heads is not None:
                data = _unpermute(data.reshape(data.shape[0], -1), heads).reshape(data.shape)
            tensors[ours] = torch.from_numpy(np.array(data, dtype=np.float32, copy=True)).to(dtype)
    return tensors


def _blocks(reader: GGUFFile, t: GGUFTensorInfo, heads: int | None) -> BlockWeights:
    blocks = read_blocks(reader.raw(t), t.tensor_type.name)
    return blocks if heads is None else blocks.rows(_unpermute_rows(t.shape[0], heads))


def _packed_blocks(reader: GGUFFile, t: GGUFTensorInfo) -> BlockLinear:
    read_rows = functools.partial(reader.read_rows, t)
    return BlockLinear(read_block_rows(read_rows, t.tensor_type.name, torch.Size(t.shape)))


def _experts(
    reader: GGUFFile, t: GGUFTensorInfo, ours: str, blocks: bool, dtype: torch.dtype, source: str
) -> dict[str, Weight]:
    """A stacked (experts, rows, cols) tensor as one matrix per expert: stored blocks, or floats."""
    if blocks:
        raw = reader.raw(t)  # (experts, rows, bytes per row)
        type_name = t.tensor_type.name
        return {expert_name(ours, e): read_blocks(raw[e], type_name) for e in range(t.shape[0])}
    data = _read_float(reader, t, source)  # (experts, rows, cols)
    return {
        expert_name(ours, e): torch.from_numpy(np.array(data[e], dtype=np.float32, copy=True)).to(dtype)
        for e in range(t.shape[0])
    }
