"""Attention over the paged KV cache for a mixed batch of decode tokens and prefill chunks.

The runner builds one ``AttentionMetadata`` per step (shared by every layer). Tokens are laid out with
all single-token decodes first (batched together: one fused kernel reading the blocks in place when K/V are
stored plain on the CPU, else one block gather and two matmuls per layer), then each
prefill chunk (SDPA; causal over fresh tokens, masked over cached context when the chunk continues).
Each layer writes the new K/V through the cache's codec, then reads whole live blocks back (decoded); blocks
a request evicted are not in its table. Keys carry RoPE from before caching, so reading what eviction kept
never shifts a position. When eviction needs scores, the decode softmax (already explicit) and the
attention of a prefill chunk's last queries are summed per block, per layer and KV head. Sliding-window
layers read their own ``WindowView`` (one per distinct window and step): only the blocks that hold their window,
with the keys before it masked.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mcp2026.kernels import ops
from mcp2026.kv.paged_cache import BlockRead, PagedKVCache
from mcp2026.kv.write_plan import WritePlan


@dataclass
class PrefillSlice:
    """One prefill chunk: tokens [q_start, q_start + q_len) of the batch."""

    q_start: int
    q_len: int
    context: BlockRead | None  # the live blocks incl. the new tokens; None when the chunk starts at 0
    # (q_len, ctx) additive (0 = attend, -inf = not), built once per step (SDPA would convert a bool mask in
    # every layer); None with context None (causal)
    mask: torch.Tensor | None
    num_observed: int = 0  # last queries whose attention is summed per block (eviction scores)
    observe_mask: torch.Tensor | None = None  # (num_observed, ctx) bool
    mass: torch.Tensor | None = None  # (L, nkv, num context blocks) float32
    kv_start: int = 0  # the chunk's first slot: query i sees slots 0 .. kv_start + i (what mask says)
    # a sliding window's slice: ``mask`` is not the causal mask at ``kv_start`` (the context starts later and
    # keys before each query's window are hidden), so SDPA applies it
    windowed: bool = False
    # Staged codecs (int4): each query sees its own block as decode does, staged (rounded to the staging
    # dtype), not sealed: its own block's keys up to itself (none for the token that fills a block, which
    # reads it sealed). The staged keys are the chunk's first block's earlier tokens, from staging entry
    # ``stage_entry`` (``num_prior`` of them), then the chunk's own tokens. ``staged_apart``: the chunk reads
    # them apart (``_split_staged_attention``) and ``mask`` covers the sealed context only; else ``mask``
    # (q_len, ctx + num_prior + q_len) covers both key sets, read in one SDPA call.
    stage_entry: int = 0
    num_prior: int = 0
    staged_apart: bool = False
    # A layered cache (per-layer budgets): each layer's own slice (its pages, slots and masks); this one then
    # holds only the position in the batch and the scores (mass, num_observed)
    per_layer: list[PrefillSlice] | None = None

    def to(self, device: torch.device) -> PrefillSlice:
        if self.per_layer is not None and device.type != "cpu":
            return self._layers_to(device)

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        context = None if self.context is None else self.context.to(device)
        return PrefillSlice(
            self.q_start,
            self.q_len,
            context,
            move(self.mask),
            self.num_observed,
            move(self.observe_mask),
            move(self.mass),
            self.kv_start,
            self.stage_entry,
            self.num_prior,
            self.staged_apart,
            self.windowed,
            None if self.per_layer is None else [p.to(device) for p in self.per_layer],
        )

    def _layers_to(self, device: torch.device) -> PrefillSlice:
        """Per-layer slices moved with what they share moved once: masks (one per slot shift) stay shared, and
        each layer's scores stay a view of the one ``mass`` (what the runner reads back)."""
        moved: dict[int, torch.Tensor] = {}

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if id(t) not in moved:
                moved[id(t)] = t.to(device, non_blocking=True)
            return moved[id(t)]

        mass = move(self.mass)
        layers = []
        for p in self.per_layer:
            layer = dataclasses.replace(
                p,
                context=None if p.context is None else p.context.to(device),
                mask=move(p.mask),
                observe_mask=move(p.observe_mask),
                mass=None if mass is None else mass[:, :, : p.mass.shape[-1]],
            )
            layers.append(layer)
        return dataclasses.replace(self, mass=mass, per_layer=layers)


@dataclass
class WindowView:
    """What the layers sliding over one window read in a step where some sequence outgrew it. For the decodes
    (None when every decode fits in the window): each sequence's first position in the window (B,); where the
    step's decodes read the cache in place, the paged kernel starts there, else (``decode_read``) the blocks
    holding each sequence's last ``window`` positions (B, nb) are gathered with a bias hiding the keys before the
    window and past the length. For each prefill chunk, its slice over the same span (None: no query of that
    chunk sees past the window, the full slice is exact)."""

    decode_read: BlockRead | None = None
    decode_bias: torch.Tensor | None = None  # (B, 1, 1, nb * bs) 0 / -inf
    prefills: list[PrefillSlice | None] = field(default_factory=list)
    decode_starts: torch.Tensor | None = None  # (B,) int64

    def to(self, device: torch.device) -> WindowView:
        return WindowView(
            None if self.decode_read is None else self.decode_read.to(device),
            None if self.decode_bias is None else self.decode_bias.to(device, non_blocking=True),
            [None if p is None else p.to(device) for p in self.prefills],
            None if self.decode_starts is None else self.decode_starts.to(device),
        )


@dataclass
class AttentionMetadata:
    write: WritePlan  # where each new token's K/V goes
    block_size: int = 16
    num_decodes: int = 0  # the first num_decodes tokens are decodes, one per sequence
    decode_read: BlockRead | list[BlockRead] | None = (
        None  # (B, nb) live blocks, each sequence's padded to nb
    )
    decode_bias: torch.Tensor | None = None  # (B, 1, 1, nb * bs) 0 / -inf past each length; None if none
    decode_mass: torch.Tensor | None = None  # (L, B, nkv, nb) float32 attention mass per block (scoring)
    # Fused path (plain K/V storage): block ids (B, nb) and lengths (B,) for the kernel that
    # reads the blocks in place; decode_read is None then.
    decode_tables: torch.Tensor | None = None
    decode_lengths: torch.Tensor | None = None
    prefills: list[PrefillSlice] = field(default_factory=list)
    # A layered cache (per-layer budgets): decode_read is one read per layer, and decode_bias, decode_tables
    # and decode_lengths have a leading layer dimension
    layered: bool = False
    # sliding-window layers: their view per window; a window missing here changes nothing this step (every
    # sequence fits in it), so those layers read what full-attention layers read
    windows: dict[int, WindowView] = field(default_factory=dict)

    def decode_inputs(
        self, layer: int
    ) -> tuple[BlockRead | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """What ``layer``'s decode reads: (read, bias, tables, lengths)."""
        if not self.layered:
            return self.decode_read, self.decode_bias, self.decode_tables, self.decode_lengths

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[layer]

        read = None if self.decode_read is None else self.decode_read[layer]
        return read, pick(self.decode_bias), pick(self.decode_tables), pick(self.decode_lengths)

    def to(self, device: torch.device) -> AttentionMetadata:
        """Built on the CPU (small index tensors), moved once per step to the model's device."""
        if device.type == "cpu":
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        read = self.decode_read
        if isinstance(read, list):
            read = [r.to(device) for r in read]
        elif read is not None:
            read = read.to(device)
        return AttentionMetadata(
            self.write.to(device),
            self.block_size,
            self.num_decodes,
            read,
            move(self.decode_bias),
            move(self.decode_mass),
            move(self.decode_tables),
            move(self.decode_lengths),
            [p.to(device) for p in self.prefills],
            self.layered,
            {w: view.to(device) for w, view in self.windows.items()},
        )


@dataclass
class ForwardContext:
    """What a forward pass needs besides the tokens: the metadata and where K/V live.

    ``cache is None`` runs fresh sequences with plain causal attention (embeddings, reference tests): the
    tokens are ``seq_lens`` sequences laid one after another, each attending only to itself (None: one).
    """

    meta: AttentionMetadata | None = None
    cache: PagedKVCache | None = None
    seq_lens: tuple[int, ...] | None = None


def _block_sums(per_pos: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    # per_pos: (..., L) -> (..., num_blocks), L <= num_blocks * block_size
    padded = F.pad(per_pos.float(), (0, num_blocks * block_size - per_pos.shape[-1]))
    return padded.unflatten(-1, (num_blocks, block_size)).sum(-1)


def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mass: torch.Tensor | None,
    block_size: int,
) -> torch.Tensor:
    # q: (B, nh, hd) pre-scaled; k, v: (B, nkv, L, hd)
    b, nh, hd = q.shape
    nkv = k.shape[1]
    qg = q.view(b, nkv, nh // nkv, hd)  # (B, nkv, g, hd)
    scores = torch.matmul(qg, k.transpose(-1, -2))  # (B, nkv, g, L)
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1)
    if mass is not None:  # (B, nkv, nb)
        mass += _block_sums(probs.sum(dim=2), mass.shape[-1], block_size)
    out = torch.matmul(probs, v)  # (B, nkv, g, hd)
    return out.reshape(b, nh, hd)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, offset: int | None = 0
) -> torch.Tensor:
    # q: (T, nh, hd) pre-scaled; k, v: (nkv, S, hd); causal when mask is None (S == T). ``mask`` is the causal
    # mask at ``offset`` (query i sees keys 0 .. offset + i), which our kernel applies without it; offset None:
    # any other mask (SDPA applies it).
    out = None if offset is None else ops.prefill_attention(q, k, v, offset)
    if out is not None:
        return out
    gqa = True
    if q.is_cuda and k.shape[0] != q.shape[1]:  # CUDA's flash kernel takes equal head counts only (GQA: math)
        group = q.shape[1] // k.shape[0]
        k, v, gqa = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), False
    # 4-D inputs on purpose: with 3-D ones PyTorch's CPU dispatcher falls back to the math kernel
    # (materialised scores, several times slower at prefill lengths); with a batch dim it takes the flash kernel.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[None],
        v[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=1.0,
        enable_gqa=gqa,
    )
    return out[0].transpose(0, 1)


def _observe(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, mass: torch.Tensor, block_size: int
) -> None:
    """Add the attention mass the queries q (W, nh, hd) give each block of k (nkv, S, hd) to mass (nkv, nb)."""
    w, nh, hd = q.shape
    nkv = k.shape[0]
    qg = q.view(w, nkv, nh // nkv, hd).permute(1, 2, 0, 3)  # (nkv, g, W, hd)
    scores = torch.matmul(qg, k.transpose(-1, -2).unsqueeze(1))  # (nkv, g, W, S)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    mass += _block_sums(probs.sum(dim=(1, 2)), mass.shape[-1], block_size)


# Devices whose prefill reads a staged codec's own blocks apart from the sealed context (the CPU flash kernel
# returns the log-sum-exps that merging needs); elsewhere one SDPA call over both key sets.
SPLIT_STAGED_DEVICES = ("cpu",)


@functools.cache
def _cpu_flash_merges() -> bool:
    """Whether this torch's CPU flash kernel returns log-sum-exps and maps query heads onto fewer KV heads
    (older builds read KV head j for query head j): checked once on a tiny case against plain math, the KV
    heads being views into a larger buffer so that a wrong read is wrong numbers, not a bad address."""
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, 3, 8, generator=g)
        k_all, v_all = torch.randn(2, 1, 4, 5, 8, generator=g)
        k, v = k_all[:, :2], v_all[:, :2]  # 2 KV heads for 4 query heads
        mask = torch.zeros(3, 5).masked_fill_(torch.ones(3, 5, dtype=torch.bool).triu(3), float("-inf"))
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash(q, k, v, 0.0, False, attn_mask=mask, scale=1.0)
        scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) + mask
        expected = torch.softmax(scores, dim=-1) @ v.repeat_interleave(2, dim=1)
        return torch.allclose(out, expected, atol=1e-5) and torch.allclose(
            lse.reshape(scores.shape[:-1]), torch.logsumexp(scores, dim=-1), atol=1e-5
        )
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False


def reads_staged_apart(device: torch.device) -> bool:
    """Whether a staged codec's prefill chunks on ``device`` read their own blocks apart
    (``_split_staged_attention``); the runner builds their masks to match."""
    return device.type in SPLIT_STAGED_DEVICES and _cpu_flash_merges()


def _staged_keys(
    cache: PagedKVCache,
    layer: int,
    p: PrefillSlice,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's first block as staging holds it, then the rest of the chunk (nkv, num_prior + T, hd): the
    block's earlier tokens from the request's staging entry, then the chunk's new tokens (T, nkv, hd) rounded
    to the staging dtype. A decode step reads a block that is still filling from staging, so a prefill query
    reading its own block the same way computes what decode would, however the prompt was chunked."""
    parts_k, parts_v = [], []
    if p.num_prior:
        ks, vs = cache.staged_rows(layer, p.stage_entry, p.num_prior)
        parts_k.append(ks.to(dtype))
        parts_v.append(vs.to(dtype))
    parts_k.append(k_new.transpose(0, 1).to(cache.stage_dtype).to(dtype))
    parts_v.append(v_new.transpose(0, 1).to(cache.stage_dtype).to(dtype))
    return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)


def _merge_kernels(*tensors: torch.Tensor) -> Any | None:
    """The compiled kernels for the own-block merge (a seam: the int4 prefill plugin times the torch ops too)."""
    return ops.kernels_for(*tensors)


@functools.cache
def _own_block_mask(bs: int) -> torch.Tensor:
    """(bs, bs) additive: the query at row r of a block sees the block's keys 0 .. r, except the block's last
    query (it fills the block and reads it sealed). Built once per block size (read only)."""
    attend = torch.ones(bs, bs, dtype=torch.bool).tril()
    attend[-1] = False
    return torch.zeros(bs, bs).masked_fill_(~attend, float("-inf"))


def _split_staged_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    mask: torch.Tensor,
    num_prior: int,
    bs: int,
) -> torch.Tensor:
    """A staged codec's prefill chunk on the CPU (the same numbers as SDPA over the sealed and staged keys
    together, without reading the chunk's keys twice): the sealed context by the flash kernel, which returns
    each row's log-sum-exp, and each query's own staged block by a small batched softmax per block; the two
    are merged by their log-sum-exps. q (T, nh, hd) pre-scaled; kc, vc (nkv, ctx, hd) with ``mask`` (T, ctx)
    additive, a prefix of each row visible; ks, vs (nkv, num_prior + T, hd) starting at a block's start."""
    t, nh, hd = q.shape
    nkv = kc.shape[0]
    g = nh // nkv
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out_a, lse_a = flash(q.transpose(0, 1)[None], kc[None], vc[None], 0.0, False, attn_mask=mask, scale=1.0)
    # such a row gets lse 0 from the kernel, not -inf (a sliding window may hide a row's first keys, not all)
    no_sealed = (mask == float("-inf")).all(dim=-1)
    kernels = _merge_kernels(q, ks, vs)
    if kernels is not None:  # the same formulas in one pass (kernels/staged_merge.cpp)
        return kernels.merge_own_blocks(out_a[0], lse_a[0].float(), q, ks, vs, no_sealed, num_prior, bs)
    out_a, lse_a = out_a[0].float(), lse_a[0].float()  # (nh, T, hd), (nh, T)
    lse_a = lse_a.masked_fill(no_sealed, float("-inf"))
    # own blocks: rows and keys laid out from the first block's start, padded to whole blocks
    nb = -(-ks.shape[1] // bs)
    pad = nb * bs - ks.shape[1]
    kb = F.pad(ks.float(), (0, 0, 0, pad)).view(nkv, nb, 1, bs, hd)
    vb = F.pad(vs.float(), (0, 0, 0, pad)).view(nkv, nb, 1, bs, hd)
    qb = F.pad(q.float(), (0, 0, 0, 0, num_prior, pad)).view(nb, bs, nkv, g, hd).permute(2, 0, 3, 1, 4)
    scores = torch.matmul(qb, kb.transpose(-1, -2)).add_(_own_block_mask(bs))  # (nkv, nb, g, bs, bs)
    lse_b = torch.logsumexp(scores, dim=-1)  # -inf for the block-filling rows
    out_b = torch.matmul(scores.sub_(lse_b.unsqueeze(-1)).exp_(), vb)  # (nkv, nb, g, bs, hd)
    rows = slice(num_prior, num_prior + t)
    out_b = out_b.permute(0, 2, 1, 3, 4).reshape(nh, nb * bs, hd)[:, rows].nan_to_num(0.0)
    lse_b = lse_b.permute(0, 2, 1, 3).reshape(nh, nb * bs)[:, rows]
    top = torch.maximum(lse_a, lse_b)  # every row sees at least itself, sealed or staged
    wa, wb = torch.exp(lse_a - top).unsqueeze(-1), torch.exp(lse_b - top).unsqueeze(-1)
    out = (wa * out_a + wb * out_b) / (wa + wb)
    return out.transpose(0, 1).to(q.dtype)


def _sliding_mask(num_queries: int, num_keys: int, window: int, device: torch.device) -> torch.Tensor:
    """(T, S) additive: query i (at key position S - T + i) sees the ``window`` keys ending at itself."""
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))


def _fresh_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: tuple[int, ...], window: int | None
) -> torch.Tensor:
    """Sequences without a cache, each causal over itself: q (T, nh, hd), k, v (T, nkv, hd) -> (T, nh, hd)."""
    parts, start = [], 0
    for n in seq_lens:
        qs = q[start : start + n]
        ks, vs = k[start : start + n].transpose(0, 1), v[start : start + n].transpose(0, 1)  # (nkv, n, hd)
        if window is not None and window < n:
            mask = _sliding_mask(n, n, window, q.device).to(q.dtype)
            parts.append(_prefill_attention(qs, ks, vs, mask, None))
        else:
            parts.append(_prefill_attention(qs, ks, vs, None))
        start += n
    if start != q.shape[0]:
        raise ValueError(f"ForwardContext.seq_lens sum to {start} tokens, but the batch has {q.shape[0]}")
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: ForwardContext,
    window: int | None = None,
) -> torch.Tensor:
    """q: (T, nh, hd) already scaled by 1/sqrt(hd); k, v: (T, nkv, hd) -> (T, nh, hd).

    ``window``: a sliding-window layer's span (``ModelConfig.attention_window``): the query at position p sees
    keys p - window + 1 .. p. Over the paged cache such a layer reads ``meta.windows[window]`` (the gather path
    over the window's blocks only) when the step has one."""
    if ctx.cache is None:
        return _fresh_attention(q, k, v, ctx.seq_lens or (q.shape[0],), window)
    meta, cache = ctx.meta, ctx.cache
    cache.write(layer, meta.write, k, v)
    parts = []
    view = None if window is None else meta.windows.get(window)
    if meta.num_decodes:
        b = meta.num_decodes
        mass = None if meta.decode_mass is None else meta.decode_mass[layer]
        read, bias, tables, lengths = meta.decode_inputs(layer)
        if view is not None and view.decode_read is not None:  # no eviction with sliding windows: no scores
            kc, vc = cache.gather(layer, view.decode_read)  # (B, nkv, window's blocks * bs, hd)
            parts.append(_decode_attention(q[:b], kc, vc, view.decode_bias, None, meta.block_size))
        elif view is not None and view.decode_starts is not None:  # in place, from each window's start
            kb, vb = cache.layer_blocks(layer)
            parts.append(ops.paged_decode_attention(q[:b], kb, vb, tables, lengths, None, view.decode_starts))
        elif tables is not None and cache.reads_in_place:
            kb, vb = cache.layer_blocks(layer)
            parts.append(ops.paged_decode_attention(q[:b], kb, vb, tables, lengths, mass))
        elif tables is not None:  # int8 / int4 blocks, decoded as the kernel reads them
            kp, vp, sk, sv = cache.layer_planes(layer)
            kind = cache.quantized_kernel_kind
            parts.append(
                ops.paged_decode_attention_quantized(q[:b], kind, kp, vp, sk, sv, tables, lengths, mass)
            )
        else:
            kc, vc = cache.gather(layer, read)  # (B, nkv, L, hd)
            parts.append(_decode_attention(q[:b], kc, vc, bias, mass, meta.block_size))
    for i, p in enumerate(meta.prefills):
        if p.per_layer is not None:
            p = p.per_layer[layer]
        if view is not None and view.prefills[i] is not None:
            p = view.prefills[i]
        qs = q[p.q_start : p.q_start + p.q_len]
        if p.context is None:
            kc = k[p.q_start : p.q_start + p.q_len].to(q.dtype).transpose(0, 1)  # (nkv, T, hd)
            vc = v[p.q_start : p.q_start + p.q_len].to(q.dtype).transpose(0, 1)
        else:
            kc, vc = cache.gather(layer, p.context)
            kc, vc = kc[0], vc[0]  # (nkv, ctx, hd)
        if p.num_observed:
            _observe(qs[-p.num_observed :], kc, p.observe_mask, p.mass[layer], meta.block_size)
        if cache.codec.is_staged:
            new = slice(p.q_start, p.q_start + p.q_len)
            ks, vs = _staged_keys(cache, layer, p, k[new], v[new], kc.dtype)
            if p.staged_apart:
                parts.append(
                    _split_staged_attention(qs, kc, vc, ks, vs, p.mask, p.num_prior, meta.block_size)
                )
            else:  # no log-sum-exp from SDPA here: both key sets in one call
                kc, vc = torch.cat((kc, ks), dim=1), torch.cat((vc, vs), dim=1)
                parts.append(_prefill_attention(qs, kc, vc, p.mask, None))
        else:
            parts.append(_prefill_attention(qs, kc, vc, p.mask, None if p.windowed else p.kv_start))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
