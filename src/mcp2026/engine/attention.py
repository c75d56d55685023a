"""Attention over the paged KV cache for a mixed batch of decode tokens and prefill chunks.

The runner builds one ``AttentionMetadata`` per step (shared by every layer). Tokens are laid out with
all single-token decodes first (batched together: one gather and two matmuls per layer), then each
prefill chunk (SDPA; causal over fresh tokens, masked over cached context when the chunk continues).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mcp2026.kv.paged_cache import PagedKVCache


@dataclass
class PrefillSlice:
    """One prefill chunk: tokens [q_start, q_start + q_len) of the batch."""

    q_start: int
    q_len: int
    context_slots: torch.Tensor | None  # (ctx,) slots incl. the new ones; None when the chunk starts at 0
    mask: torch.Tensor | None  # (q_len, ctx) bool, True = attend; None with context_slots None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) where each new token's K/V is written
    num_decodes: int = 0  # the first num_decodes tokens are decodes, one per sequence
    decode_slots: torch.Tensor | None = None  # (B, Lmax) context slots per decode sequence (padded)
    decode_bias: torch.Tensor | None = None  # (B, 1, 1, Lmax) 0 / -inf for padding; None if no padding
    prefills: list[PrefillSlice] = field(default_factory=list)

    def to(self, device: torch.device) -> AttentionMetadata:
        """Built on the CPU (small index tensors), moved once per step to the model's device."""
        if device.type == "cpu":
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        prefills = [
            PrefillSlice(p.q_start, p.q_len, move(p.context_slots), move(p.mask)) for p in self.prefills
        ]
        return AttentionMetadata(
            move(self.slot_mapping),
            self.num_decodes,
            move(self.decode_slots),
            move(self.decode_bias),
            prefills,
        )


@dataclass
class ForwardContext:
    """What a forward pass needs besides the tokens: the metadata and where K/V live.

    ``cache is None`` runs one fresh sequence with plain causal attention (scoring, reference tests).
    """

    meta: AttentionMetadata | None = None
    cache: PagedKVCache | None = None


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # q: (B, nh, hd) pre-scaled; k, v: (B, L, nkv, hd)
    b, nh, hd = q.shape
    nkv = k.shape[2]
    qg = q.view(b, nkv, nh // nkv, hd)  # (B, nkv, g, hd)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1))  # (B, nkv, g, L)
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.transpose(1, 2))  # (B, nkv, g, hd)
    return out.reshape(b, nh, hd)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    # q: (T, nh, hd) pre-scaled; k, v: (S, nkv, hd); causal when mask is None (S == T)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=1.0,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def attention(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
) -> torch.Tensor:
    """q: (T, nh, hd) already scaled by 1/sqrt(hd); k, v: (T, nkv, hd) -> (T, nh, hd)."""
    if ctx.cache is None:
        return _prefill_attention(q, k, v, None)
    meta, cache = ctx.meta, ctx.cache
    cache.write(layer, meta.slot_mapping, k, v)
    parts = []
    if meta.num_decodes:
        kc, vc = cache.gather(layer, meta.decode_slots)
        parts.append(_decode_attention(q[: meta.num_decodes], kc, vc, meta.decode_bias))
    for p in meta.prefills:
        qs = q[p.q_start : p.q_start + p.q_len]
        if p.context_slots is None:
            ks, vs = k[p.q_start : p.q_start + p.q_len], v[p.q_start : p.q_start + p.q_len]
            parts.append(_prefill_attention(qs, ks.to(q.dtype), vs.to(q.dtype), None))
        else:
            kc, vc = cache.gather(layer, p.context_slots)
            parts.append(_prefill_attention(qs, kc.to(q.dtype), vc.to(q.dtype), p.mask))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
