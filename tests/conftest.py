"""Shared fixtures: tiny random HF models saved to temp dirs, and the real default model (slow tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, the Triton kernels run under Triton's interpreter (tests/kernels/test_gpu_kernels.py); it is
# chosen when triton is first imported, which any test module may do, so it is set before all of them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def save_tiny_hf(path: Path, arch: str = "llama", tie: bool = False, seed: int = 0, **overrides) -> Path:
    """A random-weight HF folder (config.json + model.safetensors) built with transformers."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
    )
    common.update(overrides)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    elif arch == "phi3":  # its default pad id (32000) lies outside the tiny vocabulary
        fields = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **common}
        model = Phi3ForCausalLM(Phi3Config(**fields))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 16, **common}))
    elif arch == "qwen3_moe":  # 4 experts of width 32, 2 per token, renormalised (as released Qwen3-MoE)
        moe = {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**moe, "norm_topk_prob": True, **common}))
    elif arch == "mixtral":
        model = MixtralForCausalLM(
            MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, **common})
        )
    elif arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**{"head_dim": 16, "query_pre_attn_scalar": 24, **common}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Random init gives tiny logits; scale norms so differences would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + w
                p.uniform_(-0.5, 0.5) if arch == "gemma3" else p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.normal_(0, 0.5)
            elif name.endswith("mlp.gate.weight"):  # routers: clear preferences (no near-ties in the top-k)
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits for one sequence of the model folder at ``path``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


def count_fused_calls(monkeypatch) -> list[int]:
    """A one-element list counting decoder layers run by the compiled decode path: LlamaDecoderLayer.forward_fused
    calls, and the layers of each whole-stack step (models/decode_stack.py)."""
    from mcp2026.models import decode_stack, llama

    calls = [0]
    original = llama.LlamaDecoderLayer.forward_fused
    original_stack = decode_stack.run

    def counting(self, *args):
        calls[0] += 1
        return original(self, *args)

    def counting_stack(stack, x, cos, sin, inputs, *local):
        calls[0] += inputs[0].shape[0]  # k_planes: one plane per layer
        return original_stack(stack, x, cos, sin, inputs, *local)

    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward_fused", counting)
    monkeypatch.setattr(decode_stack, "run", counting_stack)
    return calls


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core CPU idle OpenMP workers make every
    small op wait on a descheduled sibling (milliseconds each). Use with pytest.mark.usefixtures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_hf(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from mcp2026.loading.loader import default_model_path as find

    return find()


def tiny_random_model(vocab_size: int = 320, max_position_embeddings: int = 256, **overrides):
    """A 2-layer random Llama built directly (no transformers import, no files): (model, ModelConfig)."""
    from mcp2026.config import ModelConfig
    from mcp2026.models.registry import build_model

    fields = dict(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
        eos_token_ids=(2,),
    )
    config = ModelConfig(**{**fields, **overrides})
    torch.manual_seed(0)
    return build_model(config).eval().requires_grad_(False), config


@pytest.fixture(scope="module")
def kernels():
    """Our compiled CPU kernels; tests that need them skip (saying why) where they cannot be built."""
    from mcp2026.kernels import cpu

    module = cpu.load()
    if module is None:
        pytest.skip(f"fused CPU kernels unavailable here: {cpu.unavailable_reason()}")
    return module


@pytest.fixture(scope="module")
def gemm(kernels):
    """The compiled kernels where they were built with the int4 and int8 GEMMs (AVX-512 VNNI); else skip."""
    from mcp2026.kernels import ops

    if not ops.has_vnni_gemm(kernels):
        pytest.skip("the int4 and int8 GEMMs need our kernels built with AVX-512 VNNI")
    return kernels


class _KernelSpy:
    def __init__(self, module, calls: list) -> None:
        self.module, self.calls = module, calls

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        return lambda *a, **k: self.calls.append((name, a[0].shape[0])) or fn(*a, **k)


@pytest.fixture
def gemm_calls(monkeypatch) -> list:
    """(kernel, rows) of every call the quantized layers make through ``ops.vnni_gemm_kernels``."""
    from mcp2026.kernels import ops

    calls: list = []
    real = ops.vnni_gemm_kernels
    monkeypatch.setattr(
        ops, "vnni_gemm_kernels", lambda x: None if real(x) is None else _KernelSpy(real(x), calls)
    )
    return calls


def auto_head_under_int4():
    """The output projection's spec that lm_head_precision="auto" gives under an int4 body on this CPU: int8 in
    groups of 32 (Q8_0's form) where the block GEMM runs, else per channel."""
    from mcp2026.quant.int8_group_linear import Int8GroupLinear
    from mcp2026.quant.plan import LayerQuantSpec

    grouped = Int8GroupLinear.kernel_on(torch.device("cpu")) is not None
    return LayerQuantSpec("int8", 32 if grouped else None)
