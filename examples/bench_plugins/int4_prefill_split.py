"""QBench plugin: int4 KV prefill with a chunk's own block read apart (the CPU path,
``models.attention._split_staged_attention``) vs in one SDPA call (the path other devices take), and read apart
with torch ops where our kernels merge the own blocks and seal int4 blocks (kernels/staged_merge.cpp,
kv_write.cpp; what a machine without the kernels runs), side by side with an uncompressed cache, all in one
process (``bench.kv_measure.context_speeds``: the engines take turns chunk by
chunk, so machine noise hits them alike).

    mcp2026 bench plugin examples/bench_plugins/int4_prefill_split.py:Int4PrefillSplit --dtype fp32 \
        --param contexts=2048,4096 --param rounds=2

Parameters: contexts (prompt lengths, default 2048,4096), rounds (runs per length, default 2; each seeded
by its round), profile (0; 1 = also one prefill of the first length per engine under cProfile, one engine at
a time: where the time goes, inflated by the profiler alike). Metrics per length and round: prefill tok/s of
each engine and of the int4 paths relative to the uncompressed cache (``apart_vs_fp``, ``one_call_vs_fp``,
``apart_torch_vs_fp``); with profile, per engine (``fp``, ``apart``, ``torch``, ``one_call``):
``profile_<engine>_attention_s`` (attention calls, cumulative), ``_own_block_s`` (the split's time outside
the flash kernel: the own-block merge) and ``_writes_s`` (K/V writes and int4 seals, cumulative).
"""

from __future__ import annotations

import cProfile
import pstats

from mcp2026.bench.plugins import PluginContext


def _seconds(stats: dict, file: str, function: str) -> float:
    """Cumulative seconds of ``function`` in ``file`` in cProfile's stats (a builtin, file "~", by substring)."""
    return sum(
        v[3]
        for (f, _, fn), v in stats.items()
        if f.endswith(file) and (fn == function or (f == "~" and function in fn))
    )


class Int4PrefillSplit:
    def init(self, ctx: PluginContext) -> None:
        self.contexts = [int(c) for c in ctx.param("contexts", "2048,4096").split(",")]
        self.rounds = int(ctx.param("rounds", "2"))
        self.profile = ctx.param("profile", "0") == "1"
        limit = ctx.pipeline.engine.max_model_len
        if min(self.contexts) < 1 or max(self.contexts) + 8 > limit or self.rounds < 1:
            raise ValueError(f"contexts must be in [1, {limit - 8}] and rounds >= 1")

    def _engines(self, ctx: PluginContext, context: int) -> dict:
        from mcp2026.bench.kv_measure import measurement_engine as _engine
        from mcp2026.kv.compressor import KVCompressor
        from mcp2026.models import attention

        int4 = KVCompressor(dtype="int4", policy="none")
        loaded = ctx.pipeline.loaded
        engines = {
            "uncompressed": _engine(loaded, None, context + 8, None),
            "int4 apart": _engine(loaded, int4, context + 8, None),
            "int4 one call": _engine(loaded, int4, context + 8, None),
            "int4 apart, torch ops": _engine(loaded, int4, context + 8, None),
        }
        one_call = engines["int4 one call"]
        step = one_call.step

        def step_in_one_call():  # this engine's steps see no device that reads staged chunks apart
            saved, attention.SPLIT_STAGED_DEVICES = attention.SPLIT_STAGED_DEVICES, ()
            try:
                return step()
            finally:
                attention.SPLIT_STAGED_DEVICES = saved

        one_call.step = step_in_one_call
        torch_ops = engines["int4 apart, torch ops"]
        torch_ops.cache._int4_seal_groups = None  # seals by codec.encode
        torch_step = torch_ops.step

        def step_with_torch_merge():  # the own-block merge by torch ops in this engine's steps
            saved, attention._merge_kernels = attention._merge_kernels, lambda *t: None
            try:
                return torch_step()
            finally:
                attention._merge_kernels = saved

        torch_ops.step = step_with_torch_merge
        return engines

    def run(self, ctx: PluginContext) -> dict[str, float]:
        from mcp2026.bench.kv_measure import context_speeds

        metrics = {}
        for context in self.contexts:
            for r in range(self.rounds):
                prefill = context_speeds(self._engines(ctx, context), context, num_tokens=1, seed=r).prefill
                tag = f"{context}_r{r}"
                metrics[f"fp_tok_s_{tag}"] = prefill["uncompressed"]
                metrics[f"apart_vs_fp_{tag}"] = prefill["int4 apart"] / prefill["uncompressed"]
                metrics[f"one_call_vs_fp_{tag}"] = prefill["int4 one call"] / prefill["uncompressed"]
                metrics[f"apart_torch_vs_fp_{tag}"] = (
                    prefill["int4 apart, torch ops"] / prefill["uncompressed"]
                )
        if self.profile:
            metrics |= self._profile(ctx, self.contexts[0])
        return metrics

    def _profile(self, ctx: PluginContext, context: int) -> dict[str, float]:
        import torch

        from mcp2026.types import SamplingParams

        short = {"uncompressed": "fp", "int4 apart": "apart", "int4 apart, torch ops": "torch"}
        short["int4 one call"] = "one_call"
        metrics = {}
        for name, engine in self._engines(ctx, context).items():
            g = torch.Generator().manual_seed(0)
            prompt = torch.randint(0, engine.model_config.vocab_size, (context,), generator=g).tolist()
            rid = engine.add_request(prompt, SamplingParams(max_tokens=1))
            request = engine.request_state(rid).request
            profiler = cProfile.Profile()
            profiler.enable()
            while not request.num_output_tokens:
                engine.step()
            profiler.disable()
            stats = pstats.Stats(
                profiler
            ).stats  # (file, line, function) -> (calls, ..., tottime, cumtime, ...)

            split = _seconds(stats, "models/attention.py", "_split_staged_attention")
            flash = _seconds(stats, "~", "_scaled_dot_product_flash_attention_for_cpu")
            tag = short[name]
            metrics[f"profile_{tag}_attention_s"] = _seconds(stats, "models/attention.py", "attention")
            metrics[f"profile_{tag}_own_block_s"] = (
                split - flash if split else 0.0
            )  # flash runs in the split only
            metrics[f"profile_{tag}_writes_s"] = _seconds(stats, "kv/paged_cache.py", "write")
        return metrics
