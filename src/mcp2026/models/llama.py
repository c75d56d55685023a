"""One Llama-family decoder for Llama 2/3, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norms)
and SmolLM.

Loaders hand over fused weights: q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``, so a
layer runs four matmuls. The attention scale is folded into the q rows at load time (into the q norm's weight
where heads are normalized).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mcp2026.config import ModelConfig
from mcp2026.kernels import ops
from mcp2026.models import decode_stack, fused_linear
from mcp2026.models.attention import ForwardContext, attention
from mcp2026.models.family import ModelFamily
from mcp2026.models.layers import Linear, RMSNorm
from mcp2026.models.rotary import RotaryEmbedding
from mcp2026.quant.cpu_routing import gemv_rows


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.window = config.attention_window(layer_idx)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q + 2kv)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads rotated together: one rope pass instead of two (fewer ops per decode step)
        qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qn, kn = self.q_norm, self.k_norm
            if ops.rms_norm_heads_(qk, qn.weight, kn.weight, self.num_heads, qn.eps) is None:
                q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
                qk = torch.cat((qn(q), kn(k)), dim=1)
        if ops.rope_(qk, cos, sin) is None:
            qk = rope.apply(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = attention(self.layer_idx, q, k, v, ctx, window=self.window)  # (T, nh, hd)
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        """``intermediate_size``: the width when not the config's (one expert of a mixture)."""
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


# kernels.LayerExtras's eps field of each of its norms (q and k norms share one)
_EPS_FIELD = {
    "q_norm": "qk_eps",
    "k_norm": "qk_eps",
    "post_attn_norm": "post_attn_eps",
    "post_mlp_norm": "post_mlp_eps",
}


class LlamaDecoderLayer(nn.Module):
    # The norms the compiled layer (kernels.DecodeLayer) applies before the attention and before the MLP, and
    # its MLP gate (0: SiLU, 1: tanh-GELU): a family with its own layer (Gemma 3) names its own.
    stack_norms = ("input_layernorm", "post_attention_layernorm")
    gate = 0
    local_rope = False  # whether the layer rotates with the model's local table (Gemma 3's sliding layers)

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings with residual None); returns this layer's output
        and the residual stream before it. The residual add is fused into the next norm (one op, not two)."""
        h, residual = self.input_layernorm.add(residual, x)
        h = self.attn(h, rope, cos, sin, ctx)
        h, residual = self.post_attention_layernorm.add(residual, h)
        return self.mlp(h), residual

    def extra_norms(self, attn: nn.Module, reads: fused_linear.Reads | None) -> dict[str, Any]:
        """The norms the compiled layer applies besides ``stack_norms``, by ``kernels.LayerExtras`` field (None:
        the layer has none there)."""
        return {
            "q_norm": fused_linear.submodule(attn, "q_norm", reads),
            "k_norm": fused_linear.submodule(attn, "k_norm", reads),
        }

    def fused(
        self, kernels: Any, quant_rows: bool, reads: fused_linear.Reads | None = None
    ) -> tuple[Any, ...] | None:
        """The four linears as compiled handles, and the layer's ``kernels.LayerExtras`` (None for a plain
        Llama layer), when all of them can run inside ``forward_fused``. ``reads``: record the lookups the
        answer rests on (models/decode_stack.py repeats them on later steps)."""
        # Called for every layer of a step the decode stack's guard does not answer: submodules straight from
        # _modules (nn.Module.__getattr__ is a slow fallback, and a step makes hundreds of these lookups)
        get = dict.get if reads is None else reads.get
        own = self._modules
        attn, mlp = get(own, "attn"), get(own, "mlp")
        a, m = attn._modules, mlp._modules
        modules = (get(a, "qkv_proj"), get(a, "o_proj"), get(m, "gate_up_proj"), get(m, "down_proj"))
        norms = tuple(get(own, name) for name in self.stack_norms)
        extra = self.extra_norms(attn, reads)
        present = [n for n in extra.values() if n is not None]
        if fused_linear.hooked(self, attn, mlp, *norms, *modules, *present, reads=reads):
            return None
        linears = []
        for m in modules:
            handle = fused_linear.fused_linear(kernels, m, quant_rows, reads)
            if handle is None:
                return None
            linears.append(handle)
        return (*linears, self._extras(kernels, extra, reads))

    def _extras(self, kernels: Any, norms: dict[str, Any], reads: fused_linear.Reads | None) -> Any:
        windowed = self._modules["attn"].window is not None
        if (
            not any(n is not None for n in norms.values())
            and self.gate == 0
            and not (self.local_rope or windowed)
        ):
            return None
        weights = {
            k: None if n is None else fused_linear.tensor(n, "weight", reads) for k, n in norms.items()
        }

        def build() -> Any:
            fields = {"gate": self.gate, "local_rope": self.local_rope, "windowed": windowed}
            for name, norm in norms.items():  # the norms the layer has, each with its eps
                if norm is not None:
                    fields[name], fields[_EPS_FIELD[name]] = weights[name], norm.eps
            return kernels.LayerExtras(**fields)

        return fused_linear.held(self, "_compiled_extras", (kernels, *weights.values()), build, reads)

    def forward_fused(
        self,
        kernels: Any,
        linears: tuple[Any, ...],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for decode-sized steps: two compiled calls around the attention (same results).
        ``linears``: what ``fused`` returned."""
        if residual is None:  # x starts the residual stream (a copy: the kernels update it in place)
            residual, x = x.clone(), None
        attn = self.attn
        norm1, norm2 = (self._modules[name] for name in self.stack_norms)
        extras = () if linears[4] is None else (linears[4],)
        q, k, v = kernels.layer_attn_in(
            residual, x, norm1.weight, norm1.eps, linears[0], cos, sin,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, *extras,
        )  # fmt: skip
        out = attention(attn.layer_idx, q, k, v, ctx, window=attn.window)
        h = kernels.layer_attn_out_mlp(
            out, residual, linears[1], norm2.weight, norm2.eps, *linears[2:4], *extras
        )
        return h, residual


def fused_kernels(x: torch.Tensor) -> Any | None:
    """The compiled kernels when this step's layers may run fused: decode-sized (the two calls per layer save
    op dispatches, which only matter when a step's arithmetic is small), CPU float input, no autograd."""
    if not fused_linear.ENABLED or x.dim() != 2 or x.shape[0] > ops.FUSED_MAX_ROWS:
        return None
    return ops.kernels_for(x)


class LlamaForCausalLM(nn.Module):
    """Token ids in, hidden states out; ``compute_logits`` only for the rows that sample."""

    decoder_layer: type[nn.Module] = LlamaDecoderLayer  # a family with its own layer (Gemma 3) names it here

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_rope(config.max_position_embeddings)

    def init_rope(self, max_positions: int) -> None:
        """(Re)build the rotary tables for positions 0 .. max_positions - 1 (loaders cap the config's length)."""
        c = self.config
        self.rope = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling, c.rotary_dim)

    @property
    def max_positions(self) -> int:
        return int(self.rope.cos.shape[0])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext | None = None
    ) -> torch.Tensor:
        # input_ids, positions: (T,) -> hidden (T, H)
        ctx = ctx or ForwardContext()
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope.table(positions, x.dtype)
        residual = None
        kernels = fused_kernels(x)
        stacked, fused = self.compiled_step(kernels, x, ctx, cos, sin)
        if stacked is not None:
            return stacked
        for layer, linears in zip(self.layers, fused):
            if linears is not None:
                x, residual = layer.forward_fused(kernels, linears, x, residual, cos, sin, ctx)
            else:
                x, residual = layer(x, residual, self.rope, cos, sin, ctx)
        return self.norm.add(residual, x)[0]

    def compiled_step(
        self,
        kernels: Any | None,
        x: torch.Tensor,
        ctx: ForwardContext,
        cos: torch.Tensor,
        sin: torch.Tensor,
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, list[Any]]:
        """The step through the compiled layers, as far as they take it: (the final hidden states, when the
        whole decode stack ran the step, else None; each layer's compiled handles, None for a layer that runs
        per op). ``local``: the (cos, sin) of layers with the local rotary table."""
        if kernels is None:
            return None, [None] * len(self.layers)
        # Whether quantized linears take their GEMVs at this row count: one answer for every format because fused
        # steps (<= ops.FUSED_MAX_ROWS rows) are under each format's GEMV row limit (a test holds that).
        quant_rows = gemv_rows(x)
        stacks = self.__dict__.get("_decode_stack")
        if stacks is None:
            stacks = self.__dict__["_decode_stack"] = decode_stack.DecodeStackCache.for_layers(self.layers)
        inputs = stacks.inputs(ctx, x.shape[0])
        if inputs is None:
            return None, [layer.fused(kernels, quant_rows) for layer in self.layers]
        stack, fused = stacks.get(kernels, self.layers, quant_rows)
        if stack is None:
            return None, fused
        x, residual = decode_stack.run(stack, x, cos, sin, inputs, local)
        return self.norm.add(residual, x)[0], fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # A quantized output projection (stored blocks, int8, int4) computes in fp32 whatever the activations'
        # dtype: fed fp32, it hands back its fp32 logits instead of logits rounded to bf16 and widened again.
        head = self.lm_head
        logits = (head(hidden) if isinstance(head, nn.Linear) else head(hidden.float())).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _mistral_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": raw.get("sliding_window")}  # every layer slides; None from Mistral v0.2 on


def _qwen2_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen2 slides only with use_sliding_window, and then only the layers from max_window_layers on."""
    if not raw.get("use_sliding_window") or not raw.get("sliding_window"):
        return {}
    n = int(raw["num_hidden_layers"])
    first = int(raw.get("max_window_layers", n))
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n)
    ]
    return {"sliding_window": int(raw["sliding_window"]), "layer_types": tuple(types)}


# A "llama" GGUF that counts experts is Mixtral (models/moe.py)
FAMILY = ModelFamily(LlamaForCausalLM, gguf_with_experts="MixtralForCausalLM")
MISTRAL_FAMILY = ModelFamily(LlamaForCausalLM, hf_config=_mistral_fields)
# Qwen2 is this decoder with q/k/v biases (a config field); its GGUF q/k rows are stored unpermuted.
QWEN2_FAMILY = ModelFamily(LlamaForCausalLM, gguf_rope_permuted=False, hf_config=_qwen2_fields)
# Qwen3: q/k norms, no biases; GGUF q/k rows unpermuted like Qwen2's
QWEN3_FAMILY = ModelFamily(
    LlamaForCausalLM,
    gguf_rope_permuted=False,
    hf_config=lambda raw: {**_qwen2_fields(raw), "qk_norm": True},
)
