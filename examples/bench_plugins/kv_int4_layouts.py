"""QBench plugin: which 4-bit K/V layouts keep quality, before building one into the pool? Fake quantization
(quantize then dequantize K and V in every layer's attention, full sequence, causal) on the kv bench's 2048-token
text, against the same model with full-precision K/V. docs/kv-cache.md quotes its figures.

    mcp2026 bench plugin examples/bench_plugins/kv_int4_layouts.py:Int4Layouts --dtype fp32

Variants (``--param variants=a,b``; default all): ``kivi16`` / ``kivi64`` keys per channel over 16 / 64-token
groups (a partial last group stays full precision, as the engine's staging), values per token in groups of 32
/ 64 channels (``int4`` / ``int4-g64`` with fp16 scales); ``tok64`` keys and values per token, one group per
head (64 channels: what reaches 3.56x at any block size); ``rot-tok64`` / ``rot-tok32`` the same keys after an
orthonormal Hadamard rotation (QuaRot, arXiv:2404.00456: rotating spreads outlier channels over the head;
queries would be rotated alike, so scores are unchanged) with values per token in groups of 64 / 32;
``rot-kv64`` keys and values both rotated, groups of 64. These: affine int4 with fp16 scale and zero.
``kivi16-v64`` kivi16 with value groups of 64; ``-k8`` keys through the engine's ``int4`` key codec
(per-channel scales and zeros as uint8 codes over fp16 per-(block, head) parameters); ``-v8`` values through
its value codec (per-(token, group) codes over the block); combinations ``kivi16-k8-v64``, ``kivi16-k8-v8``,
``kivi16-k8-v8-v64``.

Metrics: ppl_ref, and delta_ppl_pct_<variant> and kld_<variant> for each variant. ~1 minute.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mcp2026.bench.plugins import PluginContext
from mcp2026.kv.codecs import Int4PerChannel, Int4PerTokenGroup, TensorCodec

VARIANTS = (
    "kivi16", "kivi64", "tok64", "rot-tok64", "rot-tok32", "rot-kv64", "kivi16-v64", "kivi16-k8", "kivi16-k8-v64",
    "kivi16-k8-v8", "kivi16-k8-v8-v64",
)  # fmt: skip


def hadamard(n: int) -> torch.Tensor:
    """(n, n) orthonormal Sylvester Hadamard matrix; n a power of two."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _affine4(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Round trip through 4-bit affine codes over ``dim`` (fp16 scale and zero, as kv/codecs.py)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = lo.half().float()
    scale = ((hi - zero) / 15).clamp_min(2.0**-14).half().float()
    return ((x - zero) / scale).round().clamp(0, 15) * scale + zero


def _engine_round_trip(codec: TensorCodec, x: torch.Tensor, tokens: int = 16) -> torch.Tensor:
    """x (T, heads, hd) through one of the engine's int4 block codecs (8-bit-coded scales and zeros), in
    ``tokens``-token blocks per head; a partial last block stays full precision, as the engine's staging."""
    t, n, hd = x.shape
    full = t - t % tokens
    out = x.clone()
    chunks = x[:full].reshape(-1, tokens, n, hd).transpose(1, 2).reshape(-1, tokens, hd)
    y = codec.decode(codec.encode(chunks), torch.float32)
    out[:full] = y.reshape(-1, n, tokens, hd).transpose(1, 2).reshape(full, n, hd)
    return out


def per_channel_codes(x: torch.Tensor, tokens: int) -> torch.Tensor:
    return _engine_round_trip(Int4PerChannel(), x, tokens)


def per_token_codes(x: torch.Tensor, group: int, tokens: int = 16) -> torch.Tensor:
    """Values per token and group, their scales and zeros 8-bit codes over a block's tokens and groups."""
    return _engine_round_trip(Int4PerTokenGroup(group), x, tokens)


def per_token(x: torch.Tensor, group: int) -> torch.Tensor:
    t, n, hd = x.shape  # (T, heads, hd)
    return _affine4(x.reshape(t, n, hd // group, group), -1).reshape(t, n, hd)


def per_channel(x: torch.Tensor, tokens: int) -> torch.Tensor:
    t, n, hd = x.shape
    full = t - t % tokens  # the partial last group stays full precision
    out = x.clone()
    out[:full] = _affine4(x[:full].reshape(-1, tokens, n, hd), 1).reshape(full, n, hd)
    return out


def _layout(variant: str, head_dim: int) -> tuple[Callable, Callable]:
    """(key round trip, value round trip) for a variant."""
    h = hadamard(head_dim)

    def rotated(group: int) -> Callable:
        return lambda x: per_token(x @ h, group) @ h.T

    if variant.startswith("kivi16-"):
        group = 64 if variant.endswith("v64") else 32
        keys = per_channel_codes if "-k8" in variant else per_channel
        values = per_token_codes if "-v8" in variant else per_token
        return (lambda k: keys(k, 16)), (lambda v: values(v, group))
    if variant.startswith("kivi"):
        tokens = int(variant[4:])
        group = 32 if tokens == 16 else 64
        return (lambda k: per_channel(k, tokens)), (lambda v: per_token(v, group))
    if variant == "tok64":
        return (lambda k: per_token(k, 64)), (lambda v: per_token(v, 64))
    if variant == "rot-kv64":
        return rotated(64), rotated(64)
    group = int(variant.removeprefix("rot-tok"))
    return rotated(64), (lambda v: per_token(v, group))


class Int4Layouts:
    def init(self, ctx: PluginContext) -> None:
        from mcp2026.bench.kv import token_sequences

        loaded = ctx.pipeline.loaded
        if loaded.config.head_dim != 64:
            raise ValueError(f"the layouts here assume 64-channel heads, got {loaded.config.head_dim}")
        self.model = loaded.model
        self.tokens = token_sequences("sharegpt", loaded.tokenizer, loaded.config.vocab_size, 1, 2048, 0)[0]
        self.variants = [v for v in ctx.param("variants", ",".join(VARIANTS)).split(",") if v]
        unknown = sorted(set(self.variants) - set(VARIANTS))
        if unknown:
            raise ValueError(f"variants must be among {', '.join(VARIANTS)}, got {unknown}")

    def _logprobs(self, variant: str | None) -> torch.Tensor:
        from mcp2026.models import llama

        key, value = _layout(variant, 64) if variant else (lambda k: k, lambda v: v)

        def attention(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: object
        ) -> torch.Tensor:
            k, v = key(k.float()), value(v.float())
            out = F.scaled_dot_product_attention(
                *(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=1.0, enable_gqa=True
            )
            return out[0].transpose(0, 1)

        original = llama.attention
        llama.attention = attention
        try:
            with torch.inference_mode():
                ids = torch.tensor(self.tokens)
                logits = self.model.compute_logits(self.model(ids, torch.arange(len(ids))))
                return torch.log_softmax(logits.float()[:-1], -1)
        finally:
            llama.attention = original

    def run(self, ctx: PluginContext) -> dict[str, float]:
        target = torch.tensor(self.tokens[1:])[:, None]
        ref = self._logprobs(None)
        nll_ref = -ref.gather(1, target).mean()
        out = {"ppl_ref": math.exp(float(nll_ref))}
        for variant in self.variants:
            lp = self._logprobs(variant)
            out[f"delta_ppl_pct_{variant}"] = 100.0 * math.expm1(
                float(-lp.gather(1, target).mean() - nll_ref)
            )
            out[f"kld_{variant}"] = float((ref.exp() * (ref - lp)).sum(-1).mean())
        return out
