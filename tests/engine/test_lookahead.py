"""Lookahead drafts (engine.lookahead) on a tiny random model: they leave no trace (tables, pool, staged int4
tails, outputs) and return each request's draft attention per slot."""

from __future__ import annotations

import pytest
import torch
from test_kv_compression import run as run_checked

from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.engine.output import ScheduledChunk, SchedulerOutput
from mcp2026.engine.request import Request
from mcp2026.kv.compressor import KVCompressor
from mcp2026.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from mcp2026.loading.loader import load_model

    return load_model(tiny_llama_dir)


def make_engine(tiny, kv: KVCompressor) -> LLMEngine:
    config = EngineConfig(
        KVConfig(block_size=kv.block_size, num_blocks=96, enable_prefix_caching=True),
        SchedulerConfig(max_num_batched_tokens=32),
        kv_compressor=kv,
    )
    return LLMEngine(tiny.model, tiny.config, None, config)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(
        3, 320, (40,), generator=g
    ).tolist()  # two prompts share 2 full blocks: prefix hits
    return [
        shared + torch.randint(3, 320, (13,), generator=g).tolist(),
        shared + torch.randint(3, 320, (29,), generator=g).tolist(),
        torch.randint(3, 320, (64,), generator=g).tolist(),  # ends on a block boundary
    ]


def run(engine: LLMEngine) -> list[list[int]]:
    outputs = run_checked(engine, prompts(), PARAMS, check=True)  # pool integrity after every step
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_online_blocks  # cached ones too
    return outputs


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int4"])
def test_drafts_roll_back_exactly(tiny, dtype):
    """Nothing evicted (sparsity 0): outputs with 20-token drafts (crossing blocks, sealing int4 tails, after
    prefix hits) equal those without, token for token."""
    kv = KVCompressor(dtype=dtype, policy="heavy_hitter", sparsity_ratio=0.0, lookahead_tokens=0)
    reference = run(make_engine(tiny, kv))
    engine = make_engine(tiny, KVCompressor(**{**kv.to_dict(), "lookahead_tokens": 20}))
    assert run(engine) == reference
    report = engine.kv_debug_report()["eviction"]
    assert report["num_lookahead_drafts"] == 3 and report["lookahead_ms"] > 0


def prefill(engine: LLMEngine, request_id: str, prompt: list[int]) -> Request:
    request = Request(request_id, prompt, output_token_ids=[7])
    assert engine.kv_manager.allocate_slots(request, len(prompt))
    chunk = ScheduledChunk(request_id, prompt, 0, engine.kv_manager.block_table(request_id), True)
    engine.runner.execute(SchedulerOutput([chunk], len(prompt)))
    engine.runner.take_scores()
    request.num_computed_tokens = len(prompt)
    return request


def cached_kv(engine: LLMEngine, request: Request) -> list[torch.Tensor]:
    """Per layer, the request's cached K and V as attention reads them (staged tail included)."""
    cache, n = engine.cache, request.num_computed_tokens
    ids = engine.kv_manager.block_table(request.request_id)[: -(-n // cache.block_size)]
    staged = cache.stage_index(request.request_id)
    if staged is not None:
        ids[-1] = cache.num_blocks + staged
    read = cache.block_read(torch.tensor([ids]))
    return [kv[..., :n, :].clone() for layer in range(cache.num_layers) for kv in cache.gather(layer, read)]


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int4"])
def test_drafts_leave_the_cached_kv_as_it_was(tiny, dtype):
    """Two requests draft together 24 tokens each, crossing and sealing blocks (int4: a seal frees a staged
    tail's entry, which the other request's draft may take): every cached token reads back bit for bit."""
    engine = make_engine(tiny, KVCompressor(dtype=dtype, policy="heavy_hitter", sparsity_ratio=0.0))
    requests = [prefill(engine, "a", prompts()[0]), prefill(engine, "b", prompts()[1])]
    before = [cached_kv(engine, r) for r in requests]
    tables = [list(engine.kv_manager.block_table(r.request_id)) for r in requests]
    assert set(engine.lookahead_attention(requests, 24)) == {"a", "b"}
    for r, kv, table in zip(requests, before, tables):
        assert engine.kv_manager.block_table(r.request_id) == table
        assert all(torch.equal(x, y) for x, y in zip(cached_kv(engine, r), kv))
    engine.kv_manager.check_integrity()


@pytest.mark.parametrize("policy", ["heavy_hitter", "snap"])  # snap scores no decode step of its own
def test_draft_attention_covers_the_requests_slots(tiny, policy):
    engine = make_engine(tiny, KVCompressor(dtype="fp32", policy=policy, sparsity_ratio=0.0))
    prompt = prompts()[2]
    request = prefill(engine, "r", prompt)
    table = list(engine.kv_manager.block_table("r"))
    drafts = engine.lookahead_attention([request], 8)
    lanes = tiny.config.num_layers * tiny.config.num_kv_heads
    assert drafts["r"].shape == (lanes, 4)  # the prompt's 4 blocks (the drafts' own slots are not returned)
    assert bool((drafts["r"] > 0).all())
    assert engine.kv_manager.block_table("r") == table
    assert engine.runner.scoring == engine.evictor.scoring  # the drafts' scoring switch is put back
    finishing = Request("f", prompt, sampling_params=SamplingParams(max_tokens=1), output_token_ids=[7])
    finishing.num_computed_tokens = len(prompt)
    assert engine.lookahead_attention([finishing], 8) == {}  # it finishes with the token it has


def test_drafts_never_evict_cached_prefixes(tiny):
    """A draft takes only free blocks: a prefix another request left in the cache stays a hit (a draft that
    reclaimed it, then gave the block back to the free list, lost the prefix for good)."""
    kv = KVCompressor(dtype="fp32", policy="heavy_hitter", sparsity_ratio=0.0, lookahead_tokens=24)
    config = EngineConfig(
        KVConfig(block_size=16, num_blocks=12, enable_prefix_caching=True),
        SchedulerConfig(max_num_batched_tokens=128),
        kv_compressor=kv,
    )
    engine = LLMEngine(tiny.model, tiny.config, None, config)
    g = torch.Generator().manual_seed(3)
    cached = torch.randint(3, 320, (64,), generator=g).tolist()
    engine.generate([cached], SamplingParams(max_tokens=1))  # leaves 4 cached blocks nobody holds
    engine.generate([torch.randint(3, 320, (110,), generator=g).tolist()], SamplingParams(max_tokens=2))
    assert engine.kv_debug_report()["eviction"]["num_lookahead_drafts"] == 1
    _, num_hit = engine.kv_manager.get_computed_blocks(Request("again", cached + [5]))
    assert num_hit == 64
    engine.kv_manager.check_integrity()
