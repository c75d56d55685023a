"""Example QBench plugin, a business assertion on prefix caching: requests that share a long system prompt
must reuse its KV blocks after the first request computed them (and get their first token sooner).

    mcp2026 bench plugin examples/bench_plugins/prefix_cache_hit.py:PrefixCacheHitRate \
        --param prefix_len=256 --param num_requests=8

Parameters (``--param KEY=VALUE``): prefix_len (shared tokens, default 256), suffix_len (each request's own
tokens, 16), num_requests (8), output_len (4), min_ratio (0.9: the hit rate must reach this share of what
an ideal block cache can reuse). Token ids are random (seeded), so any model, tokenizer or not, works.

Metrics: hit_rate (cached / prompt tokens of the requests after the first), ideal_hit_rate (the prefix's
full blocks / prompt tokens), ttft_first_ms, ttft_cached_ms (mean of the rest), passed (1.0 or 0.0).
"""

from __future__ import annotations

import random

from mcp2026.bench.plugins import PluginContext
from mcp2026.types import SamplingParams


class PrefixCacheHitRate:
    def init(self, ctx: PluginContext) -> None:
        engine = ctx.pipeline.engine
        self.prefix_len = int(ctx.param("prefix_len", "256"))
        self.suffix_len = int(ctx.param("suffix_len", "16"))
        self.num_requests = int(ctx.param("num_requests", "8"))
        self.output_len = int(ctx.param("output_len", "4"))
        self.min_ratio = float(ctx.param("min_ratio", "0.9"))
        if self.num_requests < 2 or min(self.prefix_len, self.suffix_len, self.output_len) < 1:
            raise ValueError("need num_requests >= 2 and prefix_len, suffix_len, output_len >= 1")
        total = self.prefix_len + self.suffix_len + self.output_len
        if total > engine.max_model_len:
            raise ValueError(
                f"prefix + suffix + output = {total} tokens > the model's {engine.max_model_len}"
            )
        rng = random.Random(ctx.seed)
        vocab = ctx.pipeline.loaded.config.vocab_size
        prefix = [rng.randrange(vocab) for _ in range(self.prefix_len)]
        self.prompts = [
            prefix + [rng.randrange(vocab) for _ in range(self.suffix_len)] for _ in range(self.num_requests)
        ]
        self.block_size = engine.kv_manager.block_size

    def _serve(self, engine, prompts: list[list[int]]) -> list:
        """Run ``prompts`` together to completion; their final outputs in order."""
        params = SamplingParams(max_tokens=self.output_len, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        finals = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[i] for i in ids]

    def run(self, ctx: PluginContext) -> dict[str, float]:
        engine = ctx.pipeline.engine
        (first,) = self._serve(engine, self.prompts[:1])  # computes and caches the shared blocks
        rest = self._serve(engine, self.prompts[1:])
        prompt_tokens = sum(len(p) for p in self.prompts[1:])
        hit_rate = sum(o.num_cached_tokens for o in rest) / prompt_tokens
        reusable = (self.prefix_len // self.block_size) * self.block_size
        ideal = reusable * len(rest) / prompt_tokens
        ttft_rest = [o.first_token_time - o.arrival_time for o in rest]
        return {
            "hit_rate": hit_rate,
            "ideal_hit_rate": ideal,
            "ttft_first_ms": 1e3 * (first.first_token_time - first.arrival_time),
            "ttft_cached_ms": 1e3 * sum(ttft_rest) / len(ttft_rest),
            "passed": float(hit_rate >= self.min_ratio * ideal),
        }
