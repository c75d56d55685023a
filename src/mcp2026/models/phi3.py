"""Phi-3 and Phi-4-mini: the Llama-family decoder, loaded from checkpoints that store q/k/v and gate/up fused.

Every layer slides over ``sliding_window`` when config.json sets one (as transformers' Phi3 does), and
Phi-4-mini rotates only the first ``partial_rotary_factor`` of each head. llama.cpp runs Phi-3 with NeoX
rotary, so its GGUF q/k rows are stored unpermuted; its ``ffn_up`` holds gate then up, as ``gate_up_proj`` does.
A GGUF's ``attention.sliding_window`` is not applied: llama.cpp runs Phi-3 files without it, and transformers'
GGUF reader drops it.
"""

from __future__ import annotations

import logging
from typing import Any

from mcp2026.models.family import ModelFamily
from mcp2026.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def _phi3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported for Phi-3 (only silu)")
    # transformers >= 5 keeps the factor in rope_parameters; older config.json files at the top level
    factor = float(
        (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    )
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    rotary_dim = int(head_dim * factor)  # transformers' rounding
    return {
        "sliding_window": raw.get("sliding_window"),
        "rotary_dim": rotary_dim if rotary_dim != head_dim else None,
    }


def _gguf_fields(get: Any) -> dict[str, Any]:
    window = get("attention.sliding_window")
    if window:
        log.warning(
            "this Phi-3 GGUF sets attention.sliding_window=%s; it runs with full attention on every layer, as "
            "llama.cpp and transformers run Phi-3 GGUFs (the HF checkpoint applies the window)",
            window,
        )
    return {}


FAMILY = ModelFamily(
    LlamaForCausalLM,
    gguf_rope_permuted=False,
    hf_config=_phi3_fields,
    gguf_config=_gguf_fields,
    hf_layer_names={"self_attn.qkv_proj.weight": "qkv.weight", "mlp.gate_up_proj.weight": "gate_up.weight"},
    gguf_layer_names={"attn_qkv.weight": "qkv.weight", "ffn_up.weight": "gate_up.weight"},
)
