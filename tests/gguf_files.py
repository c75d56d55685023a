"""Tiny GGUF files for tests: a 2-layer Llama written with the ``gguf`` package, its matrices in any block format
(random stored blocks with finite scales), so loaders can be checked per format without a real model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

# fp16 fields (byte offset) of each format's block and the magnitude that keeps its weights around 0.1
SCALE_FIELDS = {
    "Q4_0": ((0, 0.0125),),
    "Q4_1": ((0, 0.01), (2, -0.075)),
    "Q5_0": ((0, 0.006),),
    "Q5_1": ((0, 0.005), (2, -0.08)),
    "Q8_0": ((0, 0.0008),),
    "Q4_K": ((0, 0.0001), (2, 0.0001)),
    "Q5_K": ((0, 0.00005), (2, 0.00005)),
    "Q6_K": ((208, 0.00002),),
    "Q2_K": ((80, 0.002), (82, 0.005)),
    "Q3_K": ((108, 0.001),),
    "IQ4_NL": ((0, 0.0008),),
    "IQ4_XS": ((0, 0.00003),),
    "IQ2_XXS": ((0, 0.001),),  # no exact kernel form: the loaders' error path
}

# byte offset of the first quantized value of a block; llama.cpp's quantizers map each block's extremes onto
# the format's extreme levels (Q4_1: min -> 0, max -> 15; Q4_0: the peak -> 0, i.e. -8 d; Q8_0: the peak -> ±127)
FIRST_VALUE = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}

HIDDEN, FFN, VOCAB, HEADS, KV_HEADS, LAYERS = 256, 512, 320, 4, 2, 2


def random_blocks(
    rng: np.random.Generator, type_name: str, rows: int, cols: int, full_range: bool = False
) -> np.ndarray:
    """(rows, bytes per row) of random blocks of ``type_name`` whose fp16 scales are finite and moderate.
    ``full_range`` (Q4_0 / Q4_1 / Q8_0): every block holds the extreme levels a llama.cpp quantizer gives it."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, type_size), dtype=np.uint8)
    for offset, magnitude in SCALE_FIELDS[type_name]:
        # full range: scales as large as real files' (folding 1 / sqrt(head_dim) = 1/8 into q keeps them fp16 normals)
        magnitude *= 8 if full_range else 1
        values = (magnitude * rng.uniform(0.5, 1.0, size=raw.shape[0])).astype(np.float16)
        raw[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    if full_range:
        first = FIRST_VALUE[type_name]
        if type_name == "Q8_0":  # values -127..127 (never -128), the first at the peak
            values = raw[:, first:]
            values[values == 0x80] = 0x81
            raw[:, first] = 127
        else:  # value 0 (low nibble of the first byte) at level 0, value 1 at level 15
            raw[:, first] &= 0xF0
            raw[:, first + 1] |= 0x0F
    return raw.reshape(rows, cols // block * type_size)


def byte_tokens(count: int) -> list[str]:
    """A byte-level BPE vocabulary of ``count`` tokens: the 256 byte symbols, then pairs of letters."""
    symbols = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(0xA1, 0xAD)]
    symbols += [chr(c) for c in range(0xAE, 0x100)]
    symbols += [chr(0x100 + i) for i in range(256 - len(symbols))]
    extra = [a + b for a in "abcdefgh" for b in "abcdefgh"]
    return (symbols + extra)[:count]


def write_tiny_gguf(
    path: Path,
    weight_type: str,
    tie: bool = True,
    seed: int = 0,
    v_type: str | None = None,
    full_range: bool = False,
) -> Path:
    """A 2-layer Llama GGUF with every matrix stored as ``weight_type`` (the v projections as ``v_type``,
    default the same), norms in F32; ``full_range``: blocks as llama.cpp's quantizers fill them."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "context_length": 256,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "block_count": LAYERS,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(byte_tokens(VOCAB))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(2)

    def matrix(name: str, rows: int, cols: int, type_name: str) -> None:
        qtype = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, random_blocks(rng, type_name, rows, cols, full_range), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, rng.uniform(0.5, 1.5, size=HIDDEN).astype(np.float32))

    matrix("token_embd.weight", VOCAB, HIDDEN, weight_type)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, weight_type)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, weight_type)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN, v_type or weight_type)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, weight_type)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, weight_type)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, weight_type)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, weight_type)
    norm("output_norm.weight")
    if not tie:
        matrix("output.weight", VOCAB, HIDDEN, weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# HF module names -> llama.cpp's per-layer tensor names
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
# Gemma's converter names its four norms after what they do
GEMMA3_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert permute for Llama q/k rows (HF rotate-half -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_converted_gguf(
    hf_dir: Path,
    arch: str,
    heads: int,
    kv_heads: int,
    add_extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> str:
    """The tiny HF model in ``hf_dir`` (save_tiny_hf) written as a GGUF the way llama.cpp's converter writes it
    (``add_extra`` adds the rope scaling keys or tensors a test needs); returns the file's name in ``hf_dir``."""
    from safetensors.torch import load_file  # defer: only the tests that convert need it

    raw = load_file(str(hf_dir / "model.safetensors"))
    path = hf_dir / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    hidden = raw["model.embed_tokens.weight"].shape[1]
    for key, value in {
        "context_length": 512,
        "embedding_length": hidden,
        "feed_forward_length": raw["model.layers.0.mlp.up_proj.weight"].shape[0],
        "block_count": 2,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if "model.layers.0.self_attn.q_norm.weight" in raw:  # Qwen3, Gemma 3: head_dim is not hidden / heads
        writer.add_uint32(
            f"{arch}.attention.key_length", raw["model.layers.0.self_attn.q_norm.weight"].shape[0]
        )
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(byte_tokens(320))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(2)
    if add_extra is not None:
        add_extra(writer)
    for name, t in raw.items():
        a = t.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp's Gemma converter stores the (1 + w) its norms scale by
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", a)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", a)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", a)
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                a = llama_cpp_permute(a, heads if module.endswith("q_proj") else kv_heads)
            names = {**LAYER_NAMES, **GEMMA3_NORMS} if arch == "gemma3" else LAYER_NAMES
            writer.add_tensor(f"blk.{layer}.{names[module]}.{kind}", a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.name


# Mixture-of-experts checkpoints: the router, and each expert's gate / up / down (HF name part -> llama.cpp's)
MOE_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
EXPERT_PARTS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}


def write_moe_gguf(
    hf_dir: Path,
    arch: str,
    heads: int,
    kv_heads: int,
    expert_type: str = "F32",
    stacked: bool = True,
    add_extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> str:
    """A tiny Qwen3-MoE ("qwen3moe") or Mixtral ("llama") HF model written as llama.cpp's converter writes it:
    the experts of each layer stacked as (experts, rows, cols) ``ffn_{gate,up,down}_exps`` tensors stored as
    ``expert_type`` (or, ``stacked=False``, one tensor per expert as older Mixtral files have them), the router as
    ``ffn_gate_inp`` (``add_extra`` adds metadata a test needs); returns the file's name in ``hf_dir``."""
    import json

    from gguf.quants import quantize  # defer: only the MoE tests write quantized experts
    from safetensors.torch import load_file

    raw = load_file(str(hf_dir / "model.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    path = hf_dir / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    for key, value in {
        "context_length": 512,
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "block_count": config["num_hidden_layers"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "attention.key_length": head_dim,
        "expert_count": config["num_local_experts"],
        "expert_used_count": config["num_experts_per_tok"],
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    if "moe_intermediate_size" in config:
        writer.add_uint32(f"{arch}.expert_feed_forward_length", config["moe_intermediate_size"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", config["rope_parameters"]["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(byte_tokens(320))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(2)
    if add_extra is not None:
        add_extra(writer)

    def matrix(name: str, a: np.ndarray) -> None:
        if expert_type == "F32":
            writer.add_tensor(name, a)
        else:
            qtype = gguf.GGMLQuantizationType[expert_type]
            writer.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)

    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # (layer, part) -> expert -> matrix
    for name, t in raw.items():
        a = t.float().numpy()
        if name in GLOBAL_NAMES:
            writer.add_tensor(GLOBAL_NAMES[name], a)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        if rest in MOE_ROUTERS:
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", a)
        elif ".experts." in rest:
            index, part, _ = rest.split(".experts.")[1].split(".")
            experts.setdefault((layer, EXPERT_PARTS[part]), {})[int(index)] = a
        else:
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                a = llama_cpp_permute(a, heads if module.endswith("q_proj") else kv_heads)
            writer.add_tensor(f"blk.{layer}.{LAYER_NAMES[module]}.{kind}", a)
    for (layer, part), per_expert in experts.items():
        if stacked:
            matrix(
                f"blk.{layer}.ffn_{part}_exps.weight", np.stack([per_expert[e] for e in sorted(per_expert)])
            )
        else:
            for e, a in per_expert.items():
                matrix(f"blk.{layer}.ffn_{part}.{e}.weight", a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.name


GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def save_tiny_tokenizer(folder: Path) -> Path:
    """The tiny GGUF's byte-level BPE tokenizer (smollm pre-tokenizer, 320 tokens) saved into an HF ``folder`` as
    tokenizer.json + tokenizer_config.json, with a chat template."""
    from mcp2026.loading.tokenizer import Tokenizer  # defer: only the tests that need a tokenizer import it
    from mcp2026.quant.artifact import save_tokenizer

    source = write_tiny_gguf(folder / "vocab.gguf", "Q8_0")
    tokenizer = Tokenizer.from_gguf(source)
    tokenizer.chat_template = CHAT_TEMPLATE
    save_tokenizer(tokenizer, folder)
    source.unlink()
    return folder
