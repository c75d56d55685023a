"""A decode step's whole layer stack as one compiled call.

On a decode-sized step each layer already runs as two compiled calls around its attention (``forward_fused``),
but the loop over layers, the K/V write and the paged attention between the halves still cross from Python into
C++ about five times per layer, with the interpreter work around each crossing. For a small model that overhead
is a large share of a batch-1 step. ``kernels.DecodeStack`` holds every layer's norms and compiled linears and runs
the same entry points in the same order, so a step through it gives the per-layer path's results bit for bit.

It applies where every layer fuses and the step is decode-only over a raw paged cache (``raw_decode_inputs``);
any other step takes the per-layer path. The stack is built once and rebuilt when any layer's compiled linears or
norm weights change (new weights, swapped modules).

Deciding that takes hundreds of dictionary lookups over the layers' modules, and in a real step the weight
stream has just evicted those objects from the caches, so the interpreter's walk costs a tenth of a small
model's step. After a step has decided, a second pass records each lookup (``fused_linear.Reads``) into a
``kernels.LookupGuard``; later steps repeat the reads in one compiled call and walk the layers again only when
one of them gives another object (a hook registered, a module swapped, a compiled copy dropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mcp2026.models import fused_linear
from mcp2026.models.attention import ForwardContext, raw_decode_inputs

# Off: every decode step takes the per-layer loop (tests compare the two; benchmarks can A/B them).
ENABLED = True


class DecodeStackCache:
    """The compiled stack of one model, what it was built from, and whether the model's layers can run as one
    stack at all (their structure is fixed: checked once, when the cache is made)."""

    def __init__(self, stackable: bool, windows: frozenset[int | None]) -> None:
        self.stackable, self.windows = stackable, windows
        self._parts: list[Any] = []
        self._stack: Any = None
        # The reads the stack was last decided from (a kernels.LookupGuard), with the kernels and the
        # quant_rows answer of that step: while the guard holds, a step skips every layer's ``fused`` walk.
        self._guard: Any = None
        self._guarded: tuple[Any, bool] | None = None

    @classmethod
    def for_layers(cls, layers: Sequence[nn.Module]) -> DecodeStackCache:
        return cls(stackable(layers), frozenset(layer.attn.window for layer in layers))

    def inputs(self, ctx: ForwardContext, num_tokens: int) -> tuple | None:
        """``raw_decode_inputs`` where this step's attention lets the layers run as one stack, else None."""
        if not ENABLED or not self.stackable:
            return None
        return raw_decode_inputs(ctx, num_tokens, self.windows)

    def get(self, kernels: Any, layers: Sequence[nn.Module], quant_rows: bool) -> Any | None:
        """The stack for these layers and their current compiled linears (built or rebuilt as needed), or None
        when any layer cannot fuse this step (it takes the per-layer path)."""
        guard = self._guard
        if guard is not None and self._guarded == (kernels, quant_rows) and guard.holds():
            return self._stack
        self._guard = None
        linears = [layer.fused(kernels, quant_rows) for layer in layers]
        if any(lin is None for lin in linears):
            return None
        parts = _parts(layers, linears)
        old = self._parts
        if self._stack is None or len(old) != len(parts) or any(a is not b for a, b in zip(old, parts)):
            attn = layers[0].attn
            built = [
                kernels.DecodeLayer(
                    layer.input_layernorm.weight, layer.input_layernorm.eps, lin[0],
                    layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, *lin[1:],
                )
                for layer, lin in zip(layers, linears)
            ]  # fmt: skip
            self._stack = kernels.DecodeStack(built, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            self._parts = parts
        self._guard = _guard(kernels, layers, quant_rows, parts)
        self._guarded = (kernels, quant_rows)
        return self._stack

    def __deepcopy__(self, memo: dict) -> DecodeStackCache:
        # the compiled stack holds the original's tensors: a copy builds its own
        return DecodeStackCache(self.stackable, self.windows)

    def __reduce__(self) -> tuple:
        return DecodeStackCache, (self.stackable, self.windows)


def _parts(layers: Sequence[nn.Module], linears: Sequence[tuple[Any, ...]], reads: Any = None) -> list[Any]:
    get = dict.get if reads is None else reads.get
    parts = []
    for layer, lin in zip(layers, linears):
        own = layer._modules  # straight from _modules: this runs whenever the stack is checked the long way
        parts += (
            get(get(own, "input_layernorm")._parameters, "weight"),
            get(get(own, "post_attention_layernorm")._parameters, "weight"),
        )
        parts += lin
    return parts


def _guard(kernels: Any, layers: Sequence[nn.Module], quant_rows: bool, parts: list[Any]) -> Any | None:
    """A LookupGuard over the reads that decided ``parts``: a second pass over the layers, now that every
    compiled handle is built and cached, records each lookup (None if that pass decides anything else)."""
    reads = fused_linear.Reads()
    linears = [layer.fused(kernels, quant_rows, reads) for layer in layers]
    if any(lin is None for lin in linears):
        return None
    again = _parts(layers, linears, reads)
    if len(again) != len(parts) or any(a is not b for a, b in zip(again, parts)):
        return None
    return kernels.LookupGuard(reads.reads, reads.empty, fused_linear.MISSING)


def stackable(layers: Sequence[nn.Module]) -> bool:
    """Whether one stack can run these layers: the first layer's head counts and sizes in every layer (the stack
    takes them once) and layer ``i`` reading and writing cache layer ``i``."""
    first = layers[0].attn
    shape = (first.num_heads, first.num_kv_heads, first.head_dim)
    return all(
        (layer.attn.num_heads, layer.attn.num_kv_heads, layer.attn.head_dim) == shape
        and layer.attn.layer_idx == i
        for i, layer in enumerate(layers)
    )


def run(
    stack: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) after the last layer; ``inputs`` from ``DecodeStackCache.inputs``."""
    return tuple(stack.run(x, cos, sin, *inputs))
