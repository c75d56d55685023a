"""Linear modules as the compiled decode-layer calls see them (``FusedLinear`` in kernels/cpu_kernels.h).

A decode-sized step runs each decoder layer as two compiled calls (norm + qkv + RoPE; o-proj + norm + MLP),
which take the layer's linears as small C++ objects holding the same tensors and kernel choice the Python
modules would use: float weights through ``dense_linear``, int8 and int4 through our GEMVs (through our GEMMs
on AVX-512 VNNI CPUs), a GGUF's stored blocks through the block GEMM. Built on first use
and cached on the module; the quantized modules drop the cache wherever they drop their GEMV layout (new
weights), and every lookup checks the weight and bias are still the tensors it was built from.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from mcp2026.kernels.ops import has_vnni_gemm
from mcp2026.models.layers import Linear
from mcp2026.quant.block_linear import BlockLinear
from mcp2026.quant.dense_linear import DenseLinear
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int8_linear import Int8Linear

# Off: every layer takes the per-op path (tests compare the two; benchmarks can A/B them).
ENABLED = True

DENSE, INT8, INT4, INT4_GEMM, INT8_GEMM, BLOCK_GEMM = 0, 1, 2, 3, 4, 5
# Kinds whose module runs this same kernel at every row count a fused step has: they fuse at any such count.
# The int8 / int4 GEMVs (INT8, INT4) only where the module sends the step's rows to them (``quant_rows``).
ROW_COUNT_FREE = frozenset({DENSE, INT4_GEMM, INT8_GEMM, BLOCK_GEMM})


def _build(kernels: Any, m: nn.Module) -> tuple[int, Any] | None:
    if type(m) in (nn.Linear, Linear):
        return DENSE, kernels.FusedLinear(DENSE, m.weight, m.weight, m.bias)
    if type(m) is DenseLinear and m.inv_act_scale is None:
        return DENSE, kernels.FusedLinear(DENSE, m.weight, m.weight, m.bias)
    if type(m) is Int8Linear:
        if has_vnni_gemm(kernels) and m.gemm_shape_ok():  # what the module itself runs (Int8Linear.forward)
            return INT8_GEMM, kernels.FusedLinear(
                INT8_GEMM, m.gemm_weights(), m.gemv_scales(), m.bias, m.inv_act_scale
            )
        return INT8, kernels.FusedLinear(INT8, m.weight, m.gemv_scales(), m.bias, m.inv_act_scale)
    if type(m) is Int4Linear:
        if has_vnni_gemm(kernels):  # what the module itself runs (Int4Linear.forward)
            wp, so = m.gemm_weights()
            return INT4_GEMM, kernels.FusedLinear(INT4_GEMM, wp, so, m.bias, m.inv_act_scale)
        qs, sz = m.gemv_weights()
        return INT4, kernels.FusedLinear(INT4, qs, sz, m.bias, m.inv_act_scale)
    if type(m) is BlockLinear:  # a file's stored blocks: the GEMM its forward runs, at every row count
        return BLOCK_GEMM, kernels.FusedLinear(BLOCK_GEMM, m.weight, m.scales_offsets, m.bias)
    return None  # fp8 and anything else: the layer takes the per-op path


class _Held:
    """A compiled object and what it was built from, kept on its owner's ``__dict__``. Copies and pickles of the
    owner drop it (it holds a compiled object that cannot be pickled; a copy rebuilds its own on first use)."""

    __slots__ = ("sources", "value")

    def __init__(self, sources: tuple, value: Any) -> None:
        self.sources, self.value = sources, value

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return type(None), ()


def held(owner: nn.Module, name: str, sources: tuple, build: Any, reads: Reads | None = None) -> Any:
    """``build()``'s object, built again when any of ``sources`` is not the object it was built from (compared
    by identity) and kept on ``owner`` under ``name``. ``reads``: record the lookup (the object as it stands
    now, rebuilt or not). Runs for every linear of a per-layer decode step: a plain loop, no generator."""
    h = owner.__dict__.get(name)
    fresh = h is not None and len(h.sources) == len(sources)
    if fresh:
        for old, new in zip(h.sources, sources):
            if old is not new:
                fresh = False
                break
    if not fresh:
        h = owner.__dict__[name] = _Held(sources, build())
    if reads is not None:
        reads.get(owner.__dict__, name)
    return h.value


# A recorded read's value where the key was absent
MISSING = object()


class Reads:
    """The dictionary reads a step's fused handles were decided from, recorded as (dict, key, value) with
    ``MISSING`` for an absent key, and the dicts that had to be empty (hook tables). A ``kernels.LookupGuard``
    repeats them on later steps in one compiled call (models/decode_stack.py)."""

    __slots__ = ("reads", "empty")

    def __init__(self) -> None:
        self.reads: list[tuple[dict, str, Any]] = []
        self.empty: list[dict] = []

    def get(self, d: dict, key: str, default: Any = None) -> Any:
        """``d.get(key, default)``, recorded."""
        value = d.get(key, MISSING)
        self.reads.append((d, key, value))
        return default if value is MISSING else value


def fused_linear(kernels: Any, m: nn.Module, quant_rows: bool, reads: Reads | None = None) -> Any | None:
    """The compiled stand-in for ``m``, or None when ``m`` cannot be fused for this step (``quant_rows``:
    the step's row count is one the quantized modules send to their GEMVs). ``reads``: record the lookups."""
    weight, bias = tensor(m, "weight", reads), tensor(m, "bias", reads)
    if weight is None:  # a split layer (two kernels and a gather): never fused
        return None
    built = held(m, "_fused", (weight, bias), lambda: _build(kernels, m), reads)
    if built is None or (built[0] not in ROW_COUNT_FREE and not quant_rows):
        return None
    return built[1]


def tensor(m: nn.Module, name: str, reads: Reads | None = None) -> Tensor | None:
    """``getattr(m, name, None)`` for a parameter, buffer or plain attribute, without nn.Module's slow
    ``__getattr__`` fallback (this runs for every linear of every decode step)."""
    get = dict.get if reads is None else reads.get
    t = get(m._parameters, name)
    if t is None:
        t = get(m._buffers, name)
    if t is None:
        t = get(m.__dict__, name)
    return t


def submodule(m: nn.Module, name: str, reads: Reads | None = None) -> Any:
    """``getattr(m, name)`` for a submodule, or for an attribute set to None in its place (``q_norm = None``):
    the instance dict, then ``_modules``, as Python and nn.Module look them up."""
    get = dict.get if reads is None else reads.get
    value = get(m.__dict__, name, MISSING)
    if value is MISSING:
        value = get(m._modules, name, MISSING)
    if value is MISSING:
        raise AttributeError(f"{type(m).__name__} has no attribute {name!r}")
    return value


def hooked(*modules: nn.Module, reads: Reads | None = None) -> bool:
    """Whether a forward hook would see any of ``modules`` (calibration and tests capture activations this
    way): the fused calls skip the modules' ``__call__``, so such layers take the per-op path."""
    if reads is not None:
        tables = [torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks]
        for m in modules:
            tables += (reads.get(m.__dict__, "_forward_hooks"), reads.get(m.__dict__, "_forward_pre_hooks"))
        reads.empty += tables
        return any(tables)
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)
