"""Our GPU kernels (Triton, ``gpu_fused.py`` and ``gpu_attention.py``): optional, imported on first use.

``kernels_for`` hands them out for CUDA tensors they suit, as ``cpu.load`` does for the CPU ones; where Triton
is missing, or with ``MCP2026_KERNELS=0``, the callers in ``kernels.ops`` run the plain torch ops and the
runner reads the KV cache through a gather instead (same results within float rounding). ``status()`` says
which, for ``mcp2026 doctor`` and ``mcp2026 info``.
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace
from typing import Any

import torch

from mcp2026.kernels import cpu

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def load() -> Any | None:
    """The kernels, or None where Triton is not installed or MCP2026_KERNELS=0."""
    if not cpu.enabled_by_env() or importlib.util.find_spec("triton") is None:
        return None
    # optional: these modules import Triton (the cuda extra), found above
    from mcp2026.kernels import gpu_attention, gpu_fused, gpu_int8

    return SimpleNamespace(
        int8_matmul=gpu_int8.int8_matmul,
        add_rms_norm=gpu_fused.add_rms_norm,
        silu_mul=gpu_fused.silu_mul,
        rope_=gpu_fused.rope_,
        write_kv_rows=gpu_fused.write_kv_rows,
        paged_decode_attention=gpu_attention.paged_decode_attention,
        paged_decode_attention_quantized=gpu_attention.paged_decode_attention_quantized,
    )


def status() -> str:
    """One line for reports: which GPU kernels run."""
    if not cpu.enabled_by_env():
        return "off (MCP2026_KERNELS=0): torch ops"
    if importlib.util.find_spec("triton") is None:
        return "unavailable (triton is not installed: pip install triton): torch ops"
    import triton  # optional dependency (the cuda extra), found above

    return f"triton {triton.__version__}"


def kernels_for(*tensors: torch.Tensor) -> Any | None:
    """The kernels when every tensor is a CUDA float tensor and no gradient is being recorded. Called several
    times per layer: plain attribute checks. (Tests run the kernels on CPU tensors under Triton's interpreter,
    TRITON_INTERPRET=1, calling them directly.)"""
    module = load()
    if module is None:
        return None
    grad = torch.is_grad_enabled()
    for t in tensors:
        if not t.is_cuda or t.dtype not in _DTYPES or (grad and t.requires_grad):
            return None
    return module


@functools.cache
def quantized_kv_kinds(device: torch.device) -> tuple[int, ...]:
    """The quantized KV layouts (``PagedKVCache.quantized_kernel_kind``) the GPU decode kernel reads in place on
    ``device``: int8 per (token, head), and fp8 where the GPU converts e4m3 (sm89 and later); int4's per-channel
    keys with their staged tails are not among them."""
    if device.type != "cuda":
        return ()
    return (1, 3) if torch.cuda.get_device_capability(device) >= (8, 9) else (1,)


def decode_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention on ``device`` reads paged blocks in place with our kernel (float blocks, or
    quantized ones of ``quantized_kv_kinds``)."""
    return device.type == "cuda" and dtype in _DTYPES and load() is not None
