"""The decode step's fused ops, each with its plain-torch fallback (used off the CPU, with autograd, or when the
compiled kernels are unavailable). Both paths compute the same function; tests compare them.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import torch
import torch.nn.functional as F

from mcp2026.kernels import cpu, gpu

# Decode steps of at most this many rows run each layer as two compiled calls (models/llama.py). The
# elementwise kernels serve every size: past 64 rows they split rows across threads, and at a 512-token prefill
# they beat torch's ops (measured with a throwaway script, 2 threads, per layer: add + RMSNorm 1.5 vs 2.5 ms,
# SiLU * up 0.5 vs 4.7 ms, RoPE 0.06 ms vs torch's cat/neg/mul/add chain).
FUSED_MAX_ROWS = 64
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernels_for(*tensors: torch.Tensor) -> Any | None:
    """The compiled kernels when every tensor suits them (CPU, fp32/bf16) and no gradient is being recorded.
    Called several times per layer and step: plain attribute checks only (``t.device`` allocates)."""
    grad = torch.is_grad_enabled()
    for t in tensors:  # checked first: a GPU process never builds the CPU kernels
        if not t.is_cpu or t.dtype not in _KERNEL_DTYPES or (grad and t.requires_grad):
            return None
    return cpu.load()


def vnni_gemm_kernels(x: torch.Tensor) -> Any | None:
    """The compiled kernels when they have the int4 and int8 GEMMs (AVX-512 VNNI builds) and suit ``x``;
    else None."""
    module = kernels_for(x)
    return module if module is not None and has_vnni_gemm(module) else None


@functools.cache
def has_vnni_gemm(module: Any) -> bool:
    """Whether the compiled kernels were built with the int4 and int8 GEMMs (AVX-512 VNNI)."""
    return bool(module.vnni_gemm_available())


_scratch = threading.local()


def scratch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer of the calling thread, reused by the next call, for a weight dequantized just before its GEMM.
    A fresh allocation that large gets new pages from the OS on every call, and their page faults outweighed
    the dequantization itself (576 -> 49152: 20 ms, measured with a throwaway script); the GEMM has consumed
    the buffer before its thread asks again. Per thread, as each engine steps on its own thread."""
    numel = math.prod(shape)
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


# Prefill-sized fp32 GEMMs through oneDNN (bundled with torch; the op torch.compile's CPU backend emits) on
# the plain (N, K) weight, no packed copy: measured with a throwaway script (2 threads, AVX2, 512 rows) 28.7 vs
# MKL's 32.7 ms for one layer's four linears (SiLU-MLP's 576x3072 14.2 vs 17.4). Off: F.linear (A/B scripts).
ONEDNN_PREFILL = True


@functools.cache
def _onednn_linear() -> Any | None:
    op = (
        getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    )
    if op is None:
        return None
    try:  # an op torch may rename: check it once (fixed inputs, with and without bias) before trusting it
        x = torch.arange(16, dtype=torch.float32).reshape(2, 8) / 7
        w = torch.arange(24, dtype=torch.float32).reshape(3, 8).cos()
        b = torch.tensor([0.5, -1.0, 2.0])
        ok = all(
            torch.allclose(op(x, w, bias, "none", [], ""), F.linear(x, w, bias), rtol=1e-4, atol=1e-5)
            for bias in (b, None)
        )
    except (RuntimeError, TypeError):
        return None
    return op if ok else None


def _records_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for fp32 x on the CPU (bf16 weights widened to fp32): oneDNN past a fused decode
    step's rows, ``F.linear`` for fewer rows, under autograd, or where torch has no oneDNN."""
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.is_cpu:
        weight = weight.float()
        bias = None if bias is None else bias.float()
    op = _onednn_linear() if ONEDNN_PREFILL else None
    if (
        op is None
        or x.dim() != 2
        or x.shape[0] <= FUSED_MAX_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or not x.is_cpu
        or _records_grad(x, weight, bias)
    ):
        return F.linear(x, weight, bias)
    return op(x.contiguous(), weight, bias, "none", [], "")


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for float weights, in x's dtype. On the CPU fp32 x computes in fp32 (bf16 weights
    widened), other activations in the weight's dtype (x cast to it, as before any kernel). Decode-sized CPU
    inputs take our GEMV (gemv.cpp ``dense_linear``: 2-3x MKL at 1-16 rows; the fused decode layers
    call the same compiled function, so both paths agree), prefill-sized fp32 ones ``prefill_linear``."""
    # Up to a fused step's rows, the compiled function (the fused layers call it too: same bits either way).
    k = kernels_for(x, weight, *(() if bias is None else (bias,))) if x.dim() == 2 else None
    if k is not None and x.shape[0] <= FUSED_MAX_ROWS:
        return k.dense_linear(x, weight, bias)
    if x.is_cpu and x.dtype == torch.float32 and weight.dtype in _KERNEL_DTYPES:
        return prefill_linear(x, weight, bias)  # widens bf16 weights, as the compiled one does
    y = F.linear(x if x.dtype == weight.dtype else x.to(weight.dtype), weight, bias)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- residual + x (in place when fused), then (RMSNorm(residual) * weight, residual)."""
    fusable = residual.dim() == 2 and residual.is_contiguous()
    k = kernels_for(residual, weight, *(() if x is None else (x,))) if fusable else None
    if k is not None:
        return k.add_rms_norm(residual, x, weight, eps, residual.dtype), residual
    g = gpu.kernels_for(residual, weight) if fusable and residual.is_cuda else None
    if g is not None and (x is None or (x.is_cuda and x.dim() == 2 and x.stride(-1) == 1)):
        return g.add_rms_norm(residual, x, weight, eps), residual
    if x is not None:
        residual = residual + x
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[gate | up] (T, 2I) -> SiLU(gate) * up (T, I)."""
    k = kernels_for(gate_up) if gate_up.dim() == 2 else None
    if k is not None:
        return k.silu_mul(gate_up, gate_up.dtype)
    g = (
        gpu.kernels_for(gate_up)
        if gate_up.is_cuda and gate_up.dim() == 2 and gate_up.stride(-1) == 1
        else None
    )
    if g is not None:
        return g.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight over the last dim: the residual-add kernel without the add for (T, H) CPU rows (the
    compiled layers call it for Gemma 3's output norms), F.rms_norm otherwise."""
    k = kernels_for(x, weight) if x.dim() == 2 and x.is_contiguous() else None
    if k is not None:
        return k.add_rms_norm(x, None, weight, eps, x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm_heads_(
    qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int, eps: float
) -> torch.Tensor | None:
    """Per-head RMSNorm of qk (T, q heads + k heads, hd) in place, the q heads by ``q_weight``, the k heads by
    ``k_weight``; None when not fusable, so the caller runs its torch version."""
    if qk.dim() != 3 or qk.stride(-1) != 1 or qk.stride(-2) != qk.shape[-1]:
        return None
    k = kernels_for(qk, q_weight, k_weight)
    if k is None:
        return None
    k.rms_norm_heads_(qk, q_weight, k_weight, num_q_heads, eps)
    return qk


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[gate | up] (T, 2I) -> GELU(gate) * up (T, I), GELU's tanh approximation (Gemma's GeGLU)."""
    k = kernels_for(gate_up) if gate_up.dim() == 2 else None
    if k is not None:
        return k.gelu_tanh_mul(gate_up, gate_up.dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate x (T, heads, hd) in place (rotate-half convention) and return it; None when not fusable,
    so the caller runs its torch version."""
    if x.is_cuda:
        g = (
            gpu.kernels_for(x, cos, sin)
            if x.stride(-1) == 1 and cos.stride(-1) == sin.stride(-1) == 1
            else None
        )
        return None if g is None else g.rope_(x, cos, sin)
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        return None
    k = kernels_for(x, cos)
    if k is None:
        return None
    k.rope_(x, cos, sin)
    return x


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    mass: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, nh, hd) pre-scaled; caches (num_blocks, nkv, bs, hd); tables (B, nb) live block ids in order;
    lengths (B,) tokens to attend. ``mass`` (B, nkv, nb) float32: each block's attention per KV head (summed over
    its query heads) is added to it (eviction scores; CPU only). ``starts`` (B,) int64: a sliding window's first
    position per sequence (CPU only; the keys before it get no attention). Only called when
    ``decode_kernel_available`` said yes."""
    if q.is_cuda:
        if mass is not None:
            raise ValueError("the GPU decode kernel does not sum attention per block (eviction scores)")
        if starts is not None:
            raise ValueError("the GPU decode kernel does not start at a window (its steps gather the window)")
        return gpu.load().paged_decode_attention(q, k_cache, v_cache, tables, lengths)
    return cpu.load().paged_decode_attention(q, k_cache, v_cache, tables, lengths, mass, starts)


def paged_decode_attention_quantized(
    q: torch.Tensor,
    kind: int,
    k_planes: list[torch.Tensor],
    v_planes: list[torch.Tensor],
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_decode_attention`` over a quantized pool, blocks decoded as they are read: ``kind`` 1 = int8
    (planes q, scale, zero), 2 = int4 (q, scale and zero codes, meta), 3 = fp8 (q, scale); block ids >= the pool's blocks name
    staging entries of ``stage_k`` / ``stage_v`` (bf16 (entries, nkv, bs, hd), or empty). On the GPU: int8 and
    fp8 where the GPU has it (``gpu.quantized_kv_kinds``), which stage nothing, without per-block scores."""
    if q.is_cuda:
        if mass is not None:
            raise ValueError("the GPU decode kernel does not sum attention per block (eviction scores)")
        if stage_k.numel() or kind not in gpu.quantized_kv_kinds(q.device):
            raise ValueError(
                f"the GPU decode kernel reads int8 (and on sm89+ fp8) KV blocks, not kind {kind} with staging"
            )
        return gpu.load().paged_decode_attention_quantized(q, kind, k_planes, v_planes, tables, lengths)
    return cpu.load().paged_decode_attention_quantized(
        q, kind, k_planes, v_planes, stage_k, stage_v, tables, lengths, mass
    )


def decode_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention on ``device`` reads the paged blocks in place with one of our kernels (on the
    GPU: float, int8 and fp8 blocks, no per-block scores)."""
    if device.type == "cuda":
        return gpu.decode_available(device, dtype)
    return device.type == "cpu" and dtype in _KERNEL_DTYPES and cpu.load() is not None


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor | None:
    """Causal attention of a chunk q (T, nh, hd) fp32/bf16, pre-scaled, over k, v (nkv, S, hd) fp32/bf16: query i
    sees keys 0 .. offset + i. Our AVX-512 kernel, or None where it does not apply (no AVX-512 build, autograd,
    other dtypes or head shapes): then the caller runs SDPA. Measured with a throwaway script on the Zen 5
    machine (2 threads, SmolLM2's 9 heads on 3 KV heads, hd 64, one layer): 1024 causal 5.9 vs 11.9 ms for
    SDPA, 512 queries over 1024 keys 3.7 vs 8.6 ms, and faster at every size down to one query."""
    if q.dtype not in _KERNEL_DTYPES or k.dtype not in _KERNEL_DTYPES:
        return None
    kernels = kernels_for(q, k, v)
    if kernels is None or not kernels.prefill_attention_available():
        return None
    if q.shape[-1] not in (32, 64, 128, 256) or q.shape[1] // k.shape[0] > 12:
        return None
    if q.dtype == torch.bfloat16:
        # bf16 queries widened (exactly) and the output rounded once, as torch's bf16 flash kernel accumulates
        # in fp32 and rounds its output; that kernel is several times slower here.
        return kernels.prefill_attention(q.float(), k, v, offset).to(torch.bfloat16)
    return kernels.prefill_attention(q, k, v, offset)
