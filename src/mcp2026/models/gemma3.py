"""Gemma 3 (text): the Llama-family attention with q/k norms, plus what Gemma adds around it.

- every RMSNorm scales by (1 + w); loaders hand over 1 + w (GGUF files store it so, HF checkpoints w), so the
  norms here are the shared ones;
- four norms per layer: the attention and the MLP outputs are normalized again before their residual adds;
- GeGLU (tanh-approximated GELU) instead of SwiGLU;
- embeddings scaled by sqrt(hidden_size), rounded to the weights' dtype first as the reference does;
- interleaved sliding-window ("local") and global layers, each kind with its own rotary base.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mcp2026.config import ModelConfig
from mcp2026.kernels import ops
from mcp2026.models import fused_linear
from mcp2026.models.attention import ForwardContext
from mcp2026.models.family import ModelFamily
from mcp2026.models.layers import Linear, RMSNorm
from mcp2026.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, fused_kernels
from mcp2026.models.rotary import RotaryEmbedding


class GegluMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.gelu_tanh_mul(self.gate_up_proj(x)))


RopeTable = tuple[RotaryEmbedding, torch.Tensor, torch.Tensor]


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Compiled as the Llama layer is (``fused`` / ``forward_fused`` / the decode stack), with Gemma's norms
    around its attention and MLP, its gate and its rotary table as ``kernels.LayerExtras``."""

    stack_norms = ("input_layernorm", "pre_feedforward_layernorm")
    gate = 1  # tanh-GELU

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.sliding = config.attention_window(layer_idx) is not None
        self.local_rope = self.sliding
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = GegluMLP(config)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        tables: dict[bool, RopeTable],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the Llama layer: returns this layer's output and the residual stream before it, the residual add
        fused into the next norm. ``tables``: (rope, cos, sin) of the local (True) and global (False) layers."""
        h, residual = self.input_layernorm.add(residual, x)
        h = self.attn(h, *tables[self.sliding], ctx)
        h, residual = self.pre_feedforward_layernorm.add(residual, self.post_attention_layernorm(h))
        return self.post_feedforward_layernorm(self.mlp(h)), residual

    def extra_norms(self, attn: nn.Module, reads: fused_linear.Reads | None) -> dict[str, Any]:
        get = dict.get if reads is None else reads.get
        own = self._modules
        return {
            **super().extra_norms(attn, reads),
            "post_attn_norm": get(own, "post_attention_layernorm"),
            "post_mlp_norm": get(own, "post_feedforward_layernorm"),
        }


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embed_scale = config.hidden_size**0.5

    def init_rope(self, max_positions: int) -> None:
        c = self.config
        self.rope = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling)
        local_theta = c.rope_local_theta or c.rope_theta
        self.rope_local = RotaryEmbedding(c.head_dim, max_positions, local_theta, None)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext | None = None
    ) -> torch.Tensor:
        ctx = ctx or ForwardContext()
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        tables = {
            sliding: (rope, *rope.table(positions, x.dtype))
            for sliding, rope in ((False, self.rope), (True, self.rope_local))
        }
        residual = None
        kernels = fused_kernels(x)
        stacked, fused = self.compiled_step(kernels, x, ctx, *tables[False][1:], tables[True][1:])
        if stacked is not None:
            return stacked
        for layer, linears in zip(self.layers, fused):
            if linears is not None:
                _, cos, sin = tables[layer.sliding]
                x, residual = layer.forward_fused(kernels, linears, x, residual, cos, sin, ctx)
            else:
                x, residual = layer(x, residual, tables, ctx)
        return self.norm.add(residual, x)[0]


def _sliding_pattern(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Every ``pattern``-th layer global, the others local (Gemma 3's interleaving)."""
    return tuple(
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
    )


def _hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 configs do not set it)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding-model setting) is not supported")
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(
            f"hidden_activation {raw['hidden_activation']!r} is not supported (gelu_pytorch_tanh)"
        )
    n = int(raw["num_hidden_layers"])
    # transformers >= 5 writes rotary parameters per layer kind; older configs rope_theta, rope_local_base_freq
    # and a rope_scaling that applies to the global layers (the loader normalizes it; "default" is none)
    params = raw.get("rope_parameters") or {}
    local = (params.get("sliding_attention") or {}).get(
        "rope_theta", raw.get("rope_local_base_freq", 10000.0)
    )
    full = params.get("full_attention") or {}
    scaling = full if "full_attention" in params else raw.get("rope_scaling")
    return {
        "rope_theta": float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
        "rope_scaling": scaling,
        "qk_norm": True,
        "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        "sliding_window": int(raw.get("sliding_window") or 4096),
        "layer_types": tuple(
            raw.get("layer_types") or _sliding_pattern(n, int(raw.get("sliding_window_pattern", 6)))
        ),
        "rope_local_theta": float(local),
        "final_logit_softcapping": raw.get("final_logit_softcapping"),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
    }


def _gguf_fields(get: Any) -> dict[str, Any]:
    """llama.cpp writes the window but neither the interleaving nor the local base: it fixes both for Gemma 3
    (every sixth layer global, local base 10000), and scales queries by 1/sqrt(key_length) (the 27B model
    excepted, which it scales by 1/sqrt(hidden/heads))."""
    n = int(get("block_count"))
    query_dim = get("attention.key_length") or int(get("embedding_length")) // int(
        get("attention.head_count")
    )
    if n == 62:  # how llama.cpp recognizes the 27B model
        query_dim = int(get("embedding_length")) // int(get("attention.head_count"))
    return {
        "sliding_window": int(get("attention.sliding_window") or 4096),
        "layer_types": _sliding_pattern(n, 6),
        "rope_local_theta": 10000.0,
        "attention_scale": float(query_dim) ** -0.5,
        "final_logit_softcapping": get("final_logit_softcapping"),
    }


FAMILY = ModelFamily(
    Gemma3ForCausalLM,
    gguf_rope_permuted=False,
    hf_config=_hf_fields,
    gguf_config=_gguf_fields,
    gguf_layer_names={
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    hf_norm_offset=1.0,
)
