"""Our fused model back in the per-tensor layout of the files it was loaded from: q/k/v and gate/up split into
their rows, the query scale taken back out of the q rows (or the q norm), a tied output left out. The inverse of
``loading.names.fuse_weights``; names are its intermediate ones ("layers.3.q.weight"), which the exporters
map to a format's own names with the loaders' tables."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mcp2026.config import ModelConfig
from mcp2026.errors import ExportError
from mcp2026.export.matrices import Matrix, bias_of, matrix_of
from mcp2026.quant.block_linear import BlockEmbedding

# The architectures both exporters write (Llama-shaped tensors: every other family brings tensors of its own)
EXPORTABLE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
              "llama", "mistral", "qwen2", "qwen3")  # fmt: skip

Weight = Matrix | Tensor  # a linear's matrix, or a 1-D float tensor (norms, biases)


def _split(m: Matrix, sizes: list[int]) -> list[Matrix]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [m.rows(torch.arange(a, a + n)) for a, n in zip(starts, sizes, strict=True)]


def is_tied(model: nn.Module) -> bool:
    """Whether the output projection is the token table itself (one tensor in a file)."""
    embed, head = model.embed_tokens, model.lm_head
    if isinstance(embed, BlockEmbedding):
        return head is embed.table
    return isinstance(head, nn.Linear) and head.weight is embed.weight


def _no_bias(name: str, module: nn.Module) -> None:
    if bias_of(module) is not None:
        raise ExportError(
            f"{name}: has a bias (a bias correction of the plan) that the exported model has no tensor for; "
            "compile without bias correction to export"
        )


def check_exportable(config: ModelConfig) -> None:
    if config.architecture not in EXPORTABLE:
        raise ExportError(
            f"export writes Llama, Mistral, Qwen2 and Qwen3 models; {config.architecture} is not supported yet"
        )


def unfused_weights(model: nn.Module, config: ModelConfig) -> dict[str, Weight]:
    """Every tensor of the model under the loaders' intermediate names, as the source file laid it out (rows in
    the Hugging Face order: a format whose q/k rows differ permutes them itself)."""
    check_exportable(config)
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    ffn = config.intermediate_size
    q_scale = config.query_scale()
    row_scale = 1.0 if config.qk_norm else q_scale  # fuse_weights folded it into the q rows, or the q norm
    out: dict[str, Weight] = {}
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        qkv, o_proj = layer.attn.qkv_proj, layer.attn.o_proj
        gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
        q, k, v = _split(matrix_of(f"{p}attn.qkv_proj", qkv), [q_size, kv_size, kv_size])
        out[p + "q.weight"] = q if row_scale == 1.0 else q.scaled(1.0 / row_scale)
        out[p + "k.weight"], out[p + "v.weight"] = k, v
        bias = bias_of(qkv)
        if config.attention_bias and bias is not None:
            qb, kb, vb = bias.split([q_size, kv_size, kv_size])
            out[p + "q.bias"], out[p + "k.bias"], out[p + "v.bias"] = qb / row_scale, kb, vb
        elif bias is not None:
            _no_bias(f"{p}attn.qkv_proj", qkv)
        for name, module in (
            (f"{p}attn.o_proj", o_proj),
            (f"{p}mlp.down_proj", down),
            (f"{p}mlp.gate_up_proj", gate_up),
        ):
            _no_bias(name, module)  # fmt: skip
        out[p + "attn.o_proj.weight"] = matrix_of(f"{p}attn.o_proj", o_proj)
        gate, up = _split(matrix_of(f"{p}mlp.gate_up_proj", gate_up), [ffn, ffn])
        out[p + "gate.weight"], out[p + "up.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = matrix_of(f"{p}mlp.down_proj", down)
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight.detach().float()
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.detach().float()
        if config.qk_norm:
            out[p + "attn.q_norm.weight"] = layer.attn.q_norm.weight.detach().float() / q_scale
            out[p + "attn.k_norm.weight"] = layer.attn.k_norm.weight.detach().float()
    out["embed_tokens.weight"] = matrix_of("embed_tokens", model.embed_tokens)
    out["norm.weight"] = model.norm.weight.detach().float()
    if not is_tied(model):
        _no_bias("lm_head", model.lm_head)
        out["lm_head.weight"] = matrix_of("lm_head", model.lm_head)
    return out
