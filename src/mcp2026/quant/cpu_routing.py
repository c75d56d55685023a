"""Which CPU kernel a quantized linear runs for a given number of input rows (docs/quantization.md, "Which
kernel runs a linear"): our GEMVs at decode sizes, our int4 / int8 GEMMs on AVX-512 VNNI CPUs, dequantize +
GEMM or torch's int kernels above the GEMV's limits. The limits were set from measurements of each path.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from mcp2026.hardware import default_activation_dtype

# Our GEMVs take at most this many rows on every CPU.
GEMV_MAX_ROWS = 8
# On CPUs without fast bf16 (where torch's int kernels compute in slow bf16) the GEMVs also take batched decode
# and mixed steps up to these limits; larger inputs dequantize and run an fp32 GEMM. Above them the GEMV buys
# nothing, and the int4 GEMV quantizes activations to int8, so prefill chunks stay on float activations.
GEMV_BATCH_MAX_ROWS = 128  # int8 weights
INT4_GEMV_BATCH_MAX_ROWS = 256
DEQUANT_MIN_ROWS = GEMV_BATCH_MAX_ROWS + 1
INT4_DEQUANT_MIN_ROWS = INT4_GEMV_BATCH_MAX_ROWS + 1
# On AVX512-BF16 CPUs torch's int4 kernel computes in bf16; from this many rows a dequantize to bf16 (into a
# reused buffer) and one bf16 GEMM is faster. A row's last bits can change where its step crosses this limit.
INT4_BF16_DEQUANT_MIN_ROWS = 20

# torch's AVX-512 `_weight_int8pack_mm` uses aligned 16-byte loads on every row of the activations and the
# weights: a row start off a 16-byte boundary is a segfault (or garbage), e.g. with K = 8 or 168, or with weights
# mmapped from an artifact at an 8-byte offset. So such layers (K not a multiple of 16) dequantize instead, and
# the operands are realigned where needed.
INT8PACK_K_MULTIPLE = 16
INT8PACK_ALIGN = 64


def aligned(t: Tensor) -> Tensor:
    """``t``, copied when its data does not start on an ``INT8PACK_ALIGN`` boundary."""
    return t if t.data_ptr() % INT8PACK_ALIGN == 0 else t.clone()


def gemv_rows(x2: Tensor, batch_max_rows: int = GEMV_BATCH_MAX_ROWS) -> bool:
    """Whether our GEMV takes the (rows, K) input ``x2``."""
    rows = x2.shape[0]
    return rows <= GEMV_MAX_ROWS or (rows <= batch_max_rows and bf16_int_kernels_slow(x2))


def bf16_int_kernels_slow(x: Tensor) -> bool:
    """fp32 activations on a CPU where bf16 GEMMs are slow (the int kernels' compute dtype): our GEMVs or
    dequantize + fp32 GEMM beat torch's int kernels there, for batched decode and prefill alike."""
    return x.dtype == torch.float32 and x.is_cpu and not cpu_has_fast_bf16()


@functools.cache
def cpu_has_fast_bf16() -> bool:
    return default_activation_dtype("cpu") == torch.bfloat16
