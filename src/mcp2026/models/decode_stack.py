"""A decode step's whole layer stack as one compiled call.

On a decode-sized step each layer already runs as two compiled calls around its attention (``forward_fused``),
but the loop over layers, the K/V write and the paged attention between the halves still cross from Python into
C++ about five times per layer, with the interpreter work around each crossing. For a small model that overhead
is a large share of a batch-1 step. ``kernels.DecodeStack`` holds every layer's norms and compiled linears and runs
the same entry points in the same order, so a step through it gives the per-layer path's results bit for bit.

It applies where every layer fuses and the step is decode-only over a raw paged cache (``raw_decode_inputs``);
any other step takes the per-layer path. The stack is built once and rebuilt when any layer's compiled linears or
norm weights change (new weights, swapped modules).

Deciding which layers fuse takes hundreds of dictionary lookups over the layers' modules, and in a real step
the weight stream has just evicted those objects from the caches, so the interpreter's walk is a noticeable share
of a small model's step. The walk records each lookup (``fused_linear.Reads``) into a ``kernels.LookupGuard``;
later steps repeat the reads in one compiled call and reuse the decision, walking the layers again only when a
read gives another object (a hook registered, a module swapped, a compiled copy dropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mcp2026.models import fused_linear
from mcp2026.models.attention import ForwardContext

# Off: every decode step takes the per-layer loop (tests compare the two; benchmarks can A/B them).
ENABLED = True


class DecodeStackCache:
    """The compiled stack of one model, what it was built from, the last step's decision and the reads it rested
    on, and whether the model's layers can run as one stack at all (their structure is fixed: checked once, when
    the cache is made)."""

    def __init__(self, stackable: bool, windows: frozenset[int | None]) -> None:
        self.stackable, self.windows = stackable, windows
        self._parts: list[Any] = []
        self._stack: Any = None
        # (stack or None, every layer's handles) as last decided, valid while the guard holds for the same
        # kernels and quant_rows answer
        self._decision: tuple[Any, list] | None = None
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

    def get(self, kernels: Any, layers: Sequence[nn.Module], quant_rows: bool) -> tuple[Any, list]:
        """(stack, linears): every layer's compiled handles (``fused``; None for a layer that cannot fuse this
        step) and the stack over them when all fuse, else None (the step takes the per-layer path)."""
        guard = self._guard
        if guard is not None and self._guarded == (kernels, quant_rows) and guard.holds():
            return self._decision
        reads = fused_linear.Reads()
        linears = [layer.fused(kernels, quant_rows, reads) for layer in layers]
        stack = None
        if all(lin is not None for lin in linears):
            parts = _parts(layers, linears, reads)
            old = self._parts
            if self._stack is None or len(old) != len(parts) or any(a is not b for a, b in zip(old, parts)):
                attn = layers[0].attn
                built = []
                for layer, lin in zip(layers, linears):
                    norm1, norm2 = (layer._modules[name] for name in layer.stack_norms)
                    extras = {} if lin[4] is None else {"extras": lin[4]}
                    built.append(
                        kernels.DecodeLayer(
                            norm1.weight, norm1.eps, lin[0], norm2.weight, norm2.eps, *lin[1:4], **extras
                        )
                    )
                self._stack = kernels.DecodeStack(built, attn.num_heads, attn.num_kv_heads, attn.head_dim)
                self._parts = parts
            stack = self._stack
        self._decision = (stack, linears)
        self._guard = kernels.LookupGuard(reads.reads, reads.empty, fused_linear.MISSING)
        self._guarded = (kernels, quant_rows)
        return self._decision

    def __deepcopy__(self, memo: dict) -> DecodeStackCache:
        # the compiled stack holds the original's tensors: a copy builds its own
        return DecodeStackCache(self.stackable, self.windows)

    def __reduce__(self) -> tuple:
        return DecodeStackCache, (self.stackable, self.windows)


def _parts(
    layers: Sequence[nn.Module], linears: Sequence[tuple[Any, ...]], reads: fused_linear.Reads
) -> list[Any]:
    """What the stack is built from: each layer's norm weights and compiled handles (the reads recorded)."""
    parts = []
    for layer, lin in zip(layers, linears):
        own = layer._modules
        parts += (reads.get(reads.get(own, name)._parameters, "weight") for name in layer.stack_norms)
        parts += lin
    return parts


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
    stack: Any,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inputs: tuple[torch.Tensor, ...],
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) after the last layer; ``inputs`` from ``DecodeStackCache.inputs`` (with the window
    starts of the sliding layers last, where a sequence outgrew their window); ``local``: the (cos, sin) of the
    layers that rotate with the local table (Gemma 3's sliding layers)."""
    cos_local, sin_local = local or (None, None)
    starts = inputs[5] if len(inputs) > 5 else None
    return tuple(stack.run(x, cos, sin, *inputs[:5], cos_local, sin_local, starts))


def raw_decode_inputs(
    ctx: ForwardContext, num_tokens: int, windows: frozenset[int | None]
) -> tuple[torch.Tensor, ...] | None:
    """What a whole decode step needs to run its layers in one compiled call (``kernels.DecodeStack``), where
    ``attention`` would take, for every layer, the raw rows write and the in-place paged decode kernel:
    (k_planes, v_planes, rows, tables, lengths), and the window starts of the sliding layers where a sequence
    outgrew their window; None for any other step. ``windows``: the layers' windows."""
    cache, meta = ctx.cache, ctx.meta
    if cache is None or meta is None or meta.num_decodes != num_tokens or meta.prefills or meta.layered:
        return None
    if meta.decode_mass is not None or meta.decode_tables is None or not cache.reads_in_place:
        return None
    views = [v for w in windows if w is not None and (v := meta.windows.get(w)) is not None]
    cut = [v for v in views if v.decode_starts is not None]
    # the stack gives every sliding layer one set of window starts: a model whose layers slide over two
    # windows takes the per-layer path in a step where either cuts a sequence
    if cut and (len({w for w in windows if w is not None}) > 1 or cut[0].decode_read is not None):
        return None
    plan, planes = meta.write, cache.raw_planes()
    if planes is None or plan.rows is None or plan.is_monitored:
        return None
    starts = (cut[0].decode_starts,) if cut else ()
    return (*planes, plan.rows, meta.decode_tables, meta.decode_lengths, *starts)
