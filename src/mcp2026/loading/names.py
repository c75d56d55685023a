"""Weight names: HF and GGUF tensors -> our fused layout (qkv_proj, gate_up_proj, per expert too), q rows
pre-scaled."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcp2026.config import ModelConfig
from mcp2026.errors import ModelLoadError
from mcp2026.quant.block_linear import BlockLinear, BlockWeights


@dataclass(frozen=True)
class PendingBlocks:
    """Stored blocks not read yet: ``fuse_weights`` reads each layer's as it reaches them, so a model's worth of
    unpacked values (a byte per weight) never sits in memory at once."""

    shape: torch.Size
    read: Callable[[], BlockWeights]
    # read and packed for the kernels part by part: the token table and output head (a layer's are fused first)
    read_packed: Callable[[], BlockLinear] | None = None


# a float tensor, or a file's stored blocks kept as they are (read, or still to be read)
Weight = torch.Tensor | BlockWeights | PendingBlocks
# what fuse_weights makes of each weight once it is fused (the token table and output head: once reached)
Finish = Callable[[str, Weight], object]


def _loaded(w: Weight) -> torch.Tensor | BlockWeights:
    return w.read() if isinstance(w, PendingBlocks) else w


def _finished(key: str, w: Weight, finish: Finish | None) -> object:
    """A weight outside the layers (token table, output head): ``finish`` gets it unread, so a packer can read
    it part by part."""
    return _loaded(w) if finish is None else finish(key, w)


HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
HF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "q.weight",
    "self_attn.k_proj.weight": "k.weight",
    "self_attn.v_proj.weight": "v.weight",
    "self_attn.q_proj.bias": "q.bias",
    "self_attn.k_proj.bias": "k.bias",
    "self_attn.v_proj.bias": "v.bias",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "mlp.gate_proj.weight": "gate.weight",
    "mlp.up_proj.weight": "up.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm.weight",
}
HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}

GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
GGUF_LAYER_NAMES = {
    "attn_q.weight": "q.weight",
    "attn_k.weight": "k.weight",
    "attn_v.weight": "v.weight",
    "attn_q.bias": "q.bias",
    "attn_k.bias": "k.bias",
    "attn_v.bias": "v.bias",
    "attn_output.weight": "attn.o_proj.weight",
    "ffn_gate.weight": "gate.weight",
    "ffn_up.weight": "up.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}

# A layer tensor with an index inside its name (an expert's: "mlp.experts.3.up_proj.weight"); the maps name such
# tensors with "{}" in the index's place ("mlp.experts.{}.up_proj.weight")
INDEXED = re.compile(r"^(.+?)\.(\d+)\.(.+)$")
# Our name of a stacked tensor of every expert's matrices (GGUF's (experts, rows, cols) "ffn_up_exps")
STACKED_EXPERTS = re.compile(r"(^|\.)experts\.(?!\d)")

# Tensors that are not weights of the decoder are skipped: HF's precomputed inv_freq, and GGUF's rope_freqs,
# which config_from_gguf reads into ModelConfig.rope_scaling.
IGNORED = re.compile(r"(rotary_emb\.inv_freq|rope_freqs\.weight)$")


def map_name(
    name: str, layer_re: re.Pattern, layer_names: dict, global_names: dict, architecture: str = "Llama-family"
) -> str | None:
    """Our intermediate name ("layers.3.q.weight"), or None for ignored tensors; unknown -> error."""
    if IGNORED.search(name):
        return None
    if name in global_names:
        return global_names[name]
    m = layer_re.match(name)
    if m and m.group(2) in layer_names:
        return f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
    indexed = INDEXED.match(m.group(2)) if m else None
    if indexed:
        template = layer_names.get(f"{indexed.group(1)}.{{}}.{indexed.group(3)}")
        if template is not None:
            return f"layers.{m.group(1)}.{template.format(int(indexed.group(2)))}"
    raise ModelLoadError(f"unexpected tensor {name!r}: not part of a {architecture} decoder")


def is_expert_stack(ours: str) -> bool:
    """Whether our name is one of a stacked (experts, rows, cols) tensor (split per expert at load)."""
    return STACKED_EXPERTS.search(ours) is not None


def expert_name(stacked: str, expert: int) -> str:
    """The name of one expert's matrix of a stacked tensor ("layers.0.experts.up.weight" -> "...experts.3.up...")."""
    return STACKED_EXPERTS.sub(lambda m: f"{m.group(1)}experts.{expert}.", stacked, count=1)


def _cat_rows(parts: list[Weight]) -> Weight:
    """Rows of several weights as one; stored blocks stay blocks unless a part is float (then all are)."""
    if all(isinstance(p, BlockWeights) for p in parts):
        return BlockWeights.concat(parts)
    return torch.cat([p.dequantize() if isinstance(p, BlockWeights) else p for p in parts], dim=0)


def _scaled(w: Weight, factor: float) -> Weight:
    return w.scaled(factor) if isinstance(w, BlockWeights) else w * factor


def _split_rows(w: Weight, sizes: list[int]) -> list[Weight]:
    """Consecutive row ranges of ``sizes``; stored blocks stay blocks (each row holds whole blocks along K)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if isinstance(w, BlockWeights):
        return [w.rows(torch.arange(a, a + n)) for a, n in zip(starts, sizes, strict=True)]
    return list(w.split(sizes, dim=0))


def _unfuse(tensors: dict[str, Weight], prefix: str, config: ModelConfig, source: str) -> None:
    """A layer's fused checkpoint tensors (Phi-3: "qkv" = q, k, v rows; "gate_up" = gate, up rows) split into the
    parts ``fuse_weights`` reads, so every family goes through one fusing (and one q scaling)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    ffn = config.intermediate_size
    for fused, parts, sizes in (
        ("qkv", ("q", "k", "v"), [q, kv, kv]),
        ("gate_up", ("gate", "up"), [ffn, ffn]),
    ):
        w = tensors.pop(f"{prefix}{fused}.weight", None)
        if w is None:
            continue
        w = _loaded(w)
        if w.shape[0] != sum(sizes):
            raise ModelLoadError(
                f"{source}: tensor {prefix}{fused}.weight has shape {tuple(w.shape)} but the config implies "
                f"{sum(sizes)} rows ({' + '.join(map(str, sizes))}: {', '.join(parts)}); the config does not "
                "match the weights"
            )
        for part, piece in zip(parts, _split_rows(w, sizes), strict=True):
            if f"{prefix}{part}.weight" in tensors:
                raise ModelLoadError(
                    f"{source}: {prefix.rstrip('.')} has both a fused {fused} weight and a separate {part} weight"
                )
            tensors[f"{prefix}{part}.weight"] = piece


def fuse_weights(
    tensors: dict[str, Weight], config: ModelConfig, source: str, finish: Finish | None = None
) -> dict[str, object]:
    """Concatenate q/k/v and gate/up per layer and fold the query scale into the q rows (into the q norm's
    weight where heads are normalized first: the norm would undo a scale on the rows). Pending blocks are read
    as their layer is reached; ``finish`` (e.g. packing stored blocks for the kernels) gets each layer's weights
    as soon as that layer is fused, so one layer's intermediate forms are alive at a time, and the token table and
    output head still unread."""
    out: dict[str, object] = {}
    scale = config.query_scale()
    for i in range(config.num_layers):
        p = f"layers.{i}."
        _unfuse(tensors, p, config, source)

        def take(key: str, prefix: str = p) -> Weight:
            try:
                return _loaded(tensors.pop(prefix + key))
            except KeyError:
                raise ModelLoadError(f"{source}: missing tensor {prefix}{key}") from None

        q, k, v = take("q.weight"), take("k.weight"), take("v.weight")
        q_scale = 1.0 if config.qk_norm else scale
        out[p + "attn.qkv_proj.weight"] = _cat_rows([_scaled(q, q_scale), k, v])
        if config.qk_norm:
            out[p + "attn.q_norm.weight"] = take("attn.q_norm.weight") * scale
            out[p + "attn.k_norm.weight"] = take("attn.k_norm.weight")
        if config.attention_bias:
            out[p + "attn.qkv_proj.bias"] = torch.cat(
                [take("q.bias") * q_scale, take("k.bias"), take("v.bias")]
            )
        if config.has_experts(i):
            for e in range(config.num_experts):
                gate_up = [take(f"experts.{e}.gate.weight"), take(f"experts.{e}.up.weight")]
                out[f"{p}mlp.experts.{e}.gate_up_proj.weight"] = _cat_rows(gate_up)
        else:
            out[p + "mlp.gate_up_proj.weight"] = _cat_rows([take("gate.weight"), take("up.weight")])
        rest = [key for key in tensors if key.startswith(p)]  # norms, o, down, routers: as they are
        for key in rest:
            out[key] = _loaded(tensors.pop(key))
        if finish is not None:
            for key in [key for key in out if key.startswith(p)]:
                out[key] = finish(key, out[key])
    for key in ("embed_tokens.weight", "norm.weight"):
        if key not in tensors:
            raise ModelLoadError(f"{source}: missing tensor {key}")
        out[key] = _finished(key, tensors.pop(key), finish)
    if "lm_head.weight" in tensors:
        out["lm_head.weight"] = _finished("lm_head.weight", tensors.pop("lm_head.weight"), finish)
    if tensors:
        raise ModelLoadError(
            f"{source}: tensors not used by a {config.num_layers}-layer model: {sorted(tensors)[:3]}; "
            "the config does not match the weights"
        )
    return out


def check_shapes(state: dict[str, Weight], expected: dict[str, torch.Size], source: str) -> None:
    for name, shape in expected.items():
        if name in state and state[name].shape != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(state[name].shape)} but the config implies {tuple(shape)}; "
                "the config does not match the weights"
            )
