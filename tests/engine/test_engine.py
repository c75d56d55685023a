"""LLMEngine on a tiny random model: batched == alone, == HF greedy, prefix hits, preemption, isolation."""

from __future__ import annotations

import pytest
import torch

from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.kv.sizing import kv_block_bytes
from mcp2026.loading.loader import load_model
from mcp2026.types import SamplingParams

from conftest import save_tiny_hf

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(save_tiny_hf(tmp_path_factory.mktemp("tiny_engine"), max_position_embeddings=256))


def make_engine(tiny, num_blocks=64, block_size=16, **sched) -> LLMEngine:
    config = EngineConfig(KVConfig(block_size=block_size, num_blocks=num_blocks), SchedulerConfig(**sched))
    return LLMEngine(tiny.model, tiny.config, None, config)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 320, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def test_batched_equals_alone(tiny):
    ps = prompts(8)
    batched = [o.token_ids for o in make_engine(tiny).generate(ps, GREEDY)]
    alone = [make_engine(tiny).generate([p], GREEDY)[0].token_ids for p in ps]
    assert batched == alone


def test_matches_hf_greedy_generate(tiny):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny.source, dtype=torch.float32).eval()
    for p in prompts(3, seed=1):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[
            0, len(p) :
        ]
        ours = make_engine(tiny).generate([p], GREEDY)[0].token_ids
        assert ours == ref.tolist()


def test_chunked_prefill_and_small_budget_same_output(tiny):
    ps = prompts(6, seed=2)
    ref = [o.token_ids for o in make_engine(tiny).generate(ps, GREEDY)]
    chunked = make_engine(tiny, max_num_batched_tokens=16, max_num_seqs=3)
    assert [o.token_ids for o in chunked.generate(ps, GREEDY)] == ref


def test_prefill_steps_feed_the_schedulers_rate_and_the_chunks_follow_it(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=256, long_prefill_token_threshold=64)
    assert engine.scheduler.prefill_tokens_per_s is None
    engine.generate([list(range(5, 200))], SamplingParams(max_tokens=2))
    rate = engine.scheduler.prefill_tokens_per_s
    assert rate is not None and rate > 0
    assert engine.scheduler.chunk_cap() == min(256, 64 * max(1, int(rate // 64)))  # 1000 ms of prefill


def test_prefix_hit_skips_tokens_and_keeps_output(tiny):
    engine = make_engine(tiny)
    shared = list(range(10, 50))  # 40 tokens: two full 16-token blocks are cacheable
    first = engine.generate([shared + [5, 6]], GREEDY)[0]
    rid = engine.add_request(shared + [5, 6], GREEDY)
    state = engine.request_state(rid)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].output.token_ids == first.token_ids
    assert state.request.num_cached_tokens == 32
    assert outs[0].num_cached_tokens == 32
    assert engine.kv_manager.cache.num_hits >= 2


def test_tenant_salts_do_not_share(tiny):
    engine = make_engine(tiny)
    p = list(range(10, 50))
    engine.add_request(p, GREEDY, cache_salt="tenant-a")
    while engine.has_unfinished():
        engine.step()
    rid = engine.add_request(p, GREEDY, cache_salt="tenant-b")
    state = engine.request_state(rid)
    while engine.has_unfinished():
        engine.step()
    assert state.request.num_cached_tokens == 0


def test_preemption_keeps_outputs_identical(tiny):
    ps = prompts(8, seed=5)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in make_engine(tiny).generate(ps, params)]
    small = make_engine(tiny, num_blocks=14, block_size=8)  # 112 tokens: one request of <= 100 fits
    outs = small.generate(ps, params)
    assert small.scheduler.stats.num_preemptions > 0
    assert [o.finish_reason for o in outs] == ["length"] * len(ps)
    assert [o.token_ids for o in outs] == ref
    small.kv_manager.check_integrity()


def test_failure_of_one_request_spares_the_others(tiny):
    engine = make_engine(tiny)
    ps = prompts(4, seed=6)
    ref = [o.token_ids for o in make_engine(tiny).generate(ps, GREEDY)]
    ids = [engine.add_request(p, GREEDY) for p in ps]

    def boom(chunk):
        if chunk.request_id == ids[1]:
            raise RuntimeError("injected")

    engine.fault_hook = boom
    finals = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    assert finals[ids[1]].finish_reason == "error" and "injected" in finals[ids[1]].error
    assert [finals[i].output.token_ids for i in (ids[0], ids[2], ids[3])] == [ref[0], ref[2], ref[3]]
    assert engine.kv_manager.num_free_blocks == 64  # free + evictable cached blocks
    engine.kv_manager.check_integrity()


def test_bad_requests_rejected_at_add(tiny):
    engine = make_engine(tiny)
    with pytest.raises(ValueError, match="context"):
        engine.add_request([5] * 300, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([999999], GREEDY)
    vocab = engine.model_config.vocab_size
    for params in (SamplingParams(logit_bias={vocab: 1.0}), SamplingParams(stop_token_ids=(vocab,))):
        with pytest.raises(ValueError, match="vocabulary size"):
            engine.add_request([5, 6], params)
    assert not engine.has_unfinished()


def test_abort_frees_blocks(tiny):
    engine = make_engine(tiny)
    rid = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.kv_manager.num_free_blocks == 64  # free + evictable cached blocks
    engine.kv_manager.check_integrity()


def test_dtss_releases_shards_under_pressure_and_regrows(tiny):
    ps = prompts(6, seed=7)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in make_engine(tiny).generate(ps, params)]
    kv = KVConfig(
        block_size=8, num_blocks=64, max_kv_cache_shards=4, enable_dtss=True, dtss_check_interval_steps=1
    )
    engine = LLMEngine(tiny.model, tiny.config, None, EngineConfig(kv, SchedulerConfig()))
    free = {"bytes": 0}  # simulated free memory: starts under pressure
    engine.dtss.available_bytes = lambda: free["bytes"]
    ids = [engine.add_request(p, params) for p in ps]
    finals, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        if steps == 6:
            free["bytes"] = 1 << 62  # pressure passes
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o.output.token_ids
        engine.kv_manager.check_integrity()
    assert engine.dtss.num_releases >= 3 and engine.dtss.num_grows >= 1
    assert engine.kv_manager.pool.num_online_shards == 4
    assert engine.stats.kv_bytes_released > 0
    assert [finals[i] for i in ids] == ref


def test_kv_cache_release_returns_memory_and_zeroes(tiny):
    from mcp2026.kv.paged_cache import PagedKVCache

    cache = PagedKVCache(2, 64, 16, 2, 64)
    cache.k.fill_(1.0)
    released = cache.release_blocks(32, 64)
    assert released >= 2 * 2 * 32 * 16 * 2 * 64 * 4 * 0.9
    assert cache.k[:, 32 * 16 :].abs().sum() == 0 and cache.k[:, : 32 * 16].min() == 1.0


def test_a_context_longer_than_the_kv_budget_runs_within_the_budget(tiny, caplog):
    """The model's 256 positions do not fit a budget of 8 blocks of 16: without an explicit max_model_len the
    engine runs sequences up to what the pool holds, and says so; asked for the full length, it refuses."""
    eight_blocks = KVConfig(block_size=16, memory_gb=8 * kv_block_bytes(tiny.config, 16, torch.float32) / 1e9)
    with caplog.at_level("WARNING"):
        engine = LLMEngine(tiny.model, tiny.config, None, EngineConfig(eight_blocks))
    assert engine.max_model_len == 128
    assert "sequences are capped at 128" in caplog.text
    engine.add_request(prompts(1)[0], GREEDY)
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="fewer than one 256-token sequence"):
        LLMEngine(
            tiny.model, tiny.config, None, EngineConfig(eight_blocks, SchedulerConfig(max_model_len=256))
        )


def test_idle_release_hands_back_the_free_top_of_the_pool_and_keeps_cached_prefixes(tiny):
    engine = make_engine(tiny, num_blocks=64)
    ps = prompts(8, seed=3)
    first = [o.token_ids for o in engine.generate(ps, GREEDY)]
    pool = engine.kv_manager.pool
    held = max(b for b in range(pool.num_blocks) if pool.ref_count(b) > 0 or pool.is_parked(b))
    released = engine.release_idle_memory()
    assert released > 0 and engine.stats.kv_bytes_released == released
    top = (held + 2) * engine.cache.block_size  # the block after the highest held may share its page
    assert engine.cache.k[:, top:].abs().sum() == 0
    assert engine.release_idle_memory() == 0  # nothing written since
    # cached prefixes survive the release (their prefix hits give the same tokens), released blocks are reused
    again = [o.token_ids for o in engine.generate(ps + prompts(8, seed=4), GREEDY)][:8]
    assert again == first
    engine.kv_manager.check_integrity()
