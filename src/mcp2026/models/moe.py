"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral. The Llama-family attention (q/k norms for Qwen3-MoE), and
in place of the MLP a router and experts.

Router: logits x @ W.T in the activations' dtype, softmax in fp32, the top-k experts of each token, their
probabilities rescaled to sum to 1 where the model does (Mixtral always, Qwen3-MoE with ``norm_topk_prob``),
as transformers computes them. Dispatch: the (token, expert) pairs sorted by expert, each expert's linears run
once over all of its tokens (one matmul per expert hit, never a loop over tokens), the outputs weighted and
summed back per token. Each expert is an ordinary MLP of ``Linear`` modules, so quantization sees and replaces
them one by one; the router is a plain weight, not a linear, and stays float.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcp2026.config import ModelConfig
from mcp2026.models import fused_linear
from mcp2026.models.family import ModelFamily
from mcp2026.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class Router(nn.Module):
    """Picks ``top_k`` experts per token and their weights (fp32 softmax, as the reference)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=hidden_size**-0.5)  # loaders replace it; a model built bare runs
        self.top_k, self.normalize = top_k, normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x (T, H) -> weights (T, k) in x's dtype, expert ids (T, k)
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)  # (T, E)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class SparseMoeBlock(nn.Module):
    """The MLP of a mixture-of-experts layer: ``experts[e]`` is a SwiGLU MLP (fused gate_up and down)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.router = Router(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob
        )
        self.experts = nn.ModuleList(LlamaMLP(config, config.expert_size) for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        k = self.router.top_k
        weights, experts = self.router(x)  # (T, k)
        flat = experts.reshape(-1)  # (T * k,): pair i is token i // k
        order = flat.argsort(stable=True)  # the pairs grouped by expert
        # NOTE: data-dependent: one host sync per layer for the group sizes (CUDA decode graphs are off for
        # these models, see engine/runner.py)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k  # (T * k,) the token of each sorted pair
        grouped = x.index_select(0, tokens)  # (T * k, H)
        # one call per expert hit, over all of its rows
        outs = [self.experts[e](rows) for e, rows in enumerate(grouped.split(counts)) if rows.shape[0]]
        out = torch.cat(outs) * weights.reshape(-1, 1).index_select(0, order)  # (T * k, H)
        return torch.zeros_like(x).index_add_(0, tokens, out)  # (T, H)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.router.top_k}"


class MoeDecoderLayer(LlamaDecoderLayer):
    """The Llama layer with a ``SparseMoeBlock`` as its MLP (except the config's ``dense_layers``)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        if config.has_experts(layer_idx):
            self.mlp = SparseMoeBlock(config)

    def fused(
        self, kernels: Any, quant_rows: bool, reads: fused_linear.Reads | None = None
    ) -> tuple[Any, ...] | None:
        """None for an experts layer: the compiled layer's second call runs one dense MLP, so these layers take
        the per-op path (its linears, attention and norms still run our kernels)."""
        mlp = self._modules["mlp"] if reads is None else reads.get(self._modules, "mlp")
        if isinstance(mlp, SparseMoeBlock):
            return None
        return super().fused(kernels, quant_rows, reads)


class MoeForCausalLM(LlamaForCausalLM):
    decoder_layer = MoeDecoderLayer


# ---- config.json ----------------------------------------------------------------------------------------
# Fields whose names say they are about experts or routing. One a family neither applies nor knows to be
# training-only is refused: a checkpoint that depends on it would run with other routing than it was trained with.
ROUTING_FIELD = re.compile(r"expert|router|routed|moe|topk|top_k|scoring|gating|shared|sparse")
# Read only when training (auxiliary losses, router noise): they do not change inference
TRAINING_ONLY = frozenset({"output_router_logits", "router_aux_loss_coef", "router_jitter_noise"})


def _refuse_unknown_routing(raw: dict[str, Any], applied: set[str], routing: str) -> None:
    for key in sorted(raw):
        if ROUTING_FIELD.search(key) and key not in applied | TRAINING_ONLY:
            raise ValueError(
                f"{key}={raw[key]!r} is a routing setting mcp2026 does not apply (this architecture routes "
                f"{routing}); the model would run with other routing than it was trained with, so it is refused"
            )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported for the experts (only silu)")


QWEN3_MOE_APPLIED = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}  # fmt: skip


def _num_experts(raw: dict[str, Any]) -> int:
    # transformers >= 5 writes num_local_experts for both; released Qwen3-MoE configs say num_experts
    return int(raw.get("num_local_experts", raw.get("num_experts", 0)))


def _qwen3_moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE: q/k norms; experts on the layers ``decoder_sparse_step`` picks, except ``mlp_only_layers``;
    every layer slides when ``use_sliding_window`` (transformers reads no per-layer split for this model)."""
    _refuse_unknown_routing(raw, QWEN3_MOE_APPLIED, "softmax -> top-k -> renormalised when norm_topk_prob")
    fields: dict[str, Any] = {
        "qk_norm": True,
        "sliding_window": raw.get("sliding_window") if raw.get("use_sliding_window") else None,
    }
    num_experts = _num_experts(raw)
    if num_experts == 0:  # transformers then builds every layer with the dense MLP
        return fields
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    n = int(raw["num_hidden_layers"])
    return {
        **fields,
        "num_experts": num_experts,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),  # transformers' default
        "dense_layers": tuple(i for i in range(n) if i in only or (i + 1) % step),
    }


def _mixtral_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Mixtral: every layer's MLP is experts of width ``intermediate_size``, the top-k softmax renormalised
    (a softmax over the selected logits); every layer slides when ``sliding_window`` is set."""
    applied = {"num_local_experts", "num_experts", "num_experts_per_tok"}
    _refuse_unknown_routing(raw, applied, "softmax -> top-k -> renormalised")
    return {
        "sliding_window": raw.get("sliding_window"),
        "num_experts": _num_experts(raw),
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "norm_topk_prob": True,
    }


# ---- GGUF metadata --------------------------------------------------------------------------------------
# llama.cpp keys that would change the routing, and the value each takes when it does not (absent is fine too):
# no shared experts, softmax gating (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX = 1), no weight scale,
# no expert groups
GGUF_ROUTING_OFF = {"expert_shared_count": (0,), "expert_gating_func": (1,),
                    "expert_weights_scale": (0.0, 1.0), "expert_group_count": (0, 1)}  # fmt: skip


def _gguf_fields(get: Any) -> dict[str, Any]:
    """Experts from llama.cpp's keys; its qwen3moe and llama (Mixtral) graphs renormalise the top-k weights
    unless the file says otherwise (``expert_weights_norm``)."""
    for key, off in GGUF_ROUTING_OFF.items():
        value = get(key)
        if value is not None and value not in off:
            raise ValueError(
                f"{key} = {value} is a routing setting mcp2026 does not apply (it routes softmax -> top-k -> "
                "renormalised); the model would run with other routing than it was trained with"
            )
    num_experts = get("expert_count")
    if not num_experts:
        raise ValueError("a mixture-of-experts GGUF needs expert_count > 0 in its metadata")
    size = get("expert_feed_forward_length")  # Qwen3-MoE; Mixtral's experts have feed_forward_length
    norm = get("expert_weights_norm")
    return {
        "num_experts": int(num_experts),
        "num_experts_per_tok": int(get("expert_used_count") or 0),
        "moe_intermediate_size": int(size) if size else None,
        "norm_topk_prob": True if norm is None else bool(norm),
    }


# Checkpoint tensor names (after the layer prefix; "{}" is the expert index) -> ours. Each expert's gate and
# up rows are fused at load (``loading/names.py``), as the dense MLP's are.
EXPERT_NAMES = {
    "gate": "experts.{}.gate.weight",
    "up": "experts.{}.up.weight",
    "down": "mlp.experts.{}.down_proj.weight",
}
GGUF_EXPERT_NAMES = {
    "ffn_gate_inp.weight": "mlp.router.weight",
    # llama.cpp's stacked (experts, rows, cols) tensors, split per expert at load
    "ffn_gate_exps.weight": "experts.gate.weight",
    "ffn_up_exps.weight": "experts.up.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    # one tensor per expert, as older Mixtral conversions wrote them
    "ffn_gate.{}.weight": EXPERT_NAMES["gate"],
    "ffn_up.{}.weight": EXPERT_NAMES["up"],
    "ffn_down.{}.weight": EXPERT_NAMES["down"],
}

QWEN3_MOE_FAMILY = ModelFamily(
    MoeForCausalLM,
    gguf_rope_permuted=False,
    hf_config=_qwen3_moe_fields,
    gguf_config=_gguf_fields,
    hf_layer_names={
        "mlp.gate.weight": "mlp.router.weight",
        "mlp.experts.{}.gate_proj.weight": EXPERT_NAMES["gate"],
        "mlp.experts.{}.up_proj.weight": EXPERT_NAMES["up"],
        "mlp.experts.{}.down_proj.weight": EXPERT_NAMES["down"],
    },
    gguf_layer_names=GGUF_EXPERT_NAMES,
)
MIXTRAL_FAMILY = ModelFamily(
    MoeForCausalLM,
    hf_config=_mixtral_fields,
    gguf_config=_gguf_fields,
    hf_layer_names={
        "block_sparse_moe.gate.weight": "mlp.router.weight",
        "block_sparse_moe.experts.{}.w1.weight": EXPERT_NAMES["gate"],
        "block_sparse_moe.experts.{}.w3.weight": EXPERT_NAMES["up"],
        "block_sparse_moe.experts.{}.w2.weight": EXPERT_NAMES["down"],
    },
    gguf_layer_names=GGUF_EXPERT_NAMES,
)
