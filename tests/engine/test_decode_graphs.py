"""DecodeGraphs' buffers and padding, run eagerly on the CPU (``capture=False``: the same inputs, buckets and
padded batches a CUDA graph replays; the capture itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig, SpeculativeConfig
from mcp2026.engine.decode_graphs import DecodeGraphs, buckets_up_to, graphable
from mcp2026.engine.engine import LLMEngine
from mcp2026.kv.compressor import KVCompressor
from mcp2026.loading.loader import load_model
from mcp2026.types import SamplingParams

from conftest import save_tiny_hf

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(save_tiny_hf(tmp_path_factory.mktemp("tiny_graphs"), max_position_embeddings=256))


def make_engine(tiny, graphs: bool, max_num_seqs: int = 8, kv: KVCompressor | None = None) -> LLMEngine:
    config = EngineConfig(  # one token per decode step: the steps counted here are the graph's
        KVConfig(block_size=16, num_blocks=64),
        SchedulerConfig(max_num_seqs=max_num_seqs),
        kv_compressor=kv,
        speculative=SpeculativeConfig(method="off"),
    )
    engine = LLMEngine(tiny.model, tiny.config, None, config)
    if graphs:
        assert engine.runner.enable_decode_graphs(max_num_seqs, engine.max_model_len, capture=False) is None
    return engine


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 320, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def test_buckets_cover_every_batch_size():
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(64)[-1] == 64 and buckets_up_to(70)[-2:] == (64, 70)
    graphs_buckets = buckets_up_to(256)
    assert all(any(b >= n for b in graphs_buckets) for n in range(1, 257))


@pytest.mark.parametrize("num_prompts", [1, 3, 7])  # 3 and 7 pad to buckets 4 and 8
def test_padded_buckets_generate_what_eager_steps_do(tiny, num_prompts):
    ps = prompts(num_prompts, seed=num_prompts)
    eager = make_engine(tiny, graphs=False)
    expected = [o.token_ids for o in eager.generate(ps, GREEDY)]
    engine = make_engine(tiny, graphs=True)
    got = [o.token_ids for o in engine.generate(ps, GREEDY)]
    assert got == expected
    # the decode steps went through the graph buffers (and, padded, still generated the eager tokens)
    assert engine.runner.graphs.num_runs == GREEDY.max_tokens - 1


def test_graph_logits_equal_eager_logits_with_padding(tiny):
    """The logits of a padded step equal an eager step's, row for row, and the padding wrote nothing else."""
    ps = prompts(3, seed=5)
    engines = [make_engine(tiny, graphs=False), make_engine(tiny, graphs=True)]
    for e in engines:
        for p in ps:
            e.add_request(p, GREEDY)
        e.step()  # the prompts' prefill
    outs = [e.scheduler.schedule() for e in engines]
    assert all(len(c.token_ids) == 1 for c in outs[1].chunks)
    ids_a, logits_a = engines[0].runner.execute(outs[0])
    ids_b, logits_b = engines[1].runner.execute(outs[1])
    assert ids_a == ids_b and logits_b.shape == logits_a.shape == (3, tiny.config.vocab_size)
    torch.testing.assert_close(logits_b, logits_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engines[1].cache.k, engines[0].cache.k, rtol=0, atol=0)
    torch.testing.assert_close(engines[1].cache.v, engines[0].cache.v, rtol=0, atol=0)


def test_prefill_steps_run_eagerly(tiny):
    engine = make_engine(tiny, graphs=True, max_num_seqs=4)
    graphs = engine.runner.graphs
    engine.add_request([5, 6, 7], GREEDY)
    prefill = engine.scheduler.schedule()
    assert not graphs.accepts(prefill.chunks)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_int8_and_fp8_caches_run_through_the_graph_buffers(tiny, dtype):
    """Per-token int8 / fp8 rows are encoded on the device and read in place by the decode kernel: their
    steps are graphed, padding included, and generate what eager steps over the same codec do."""
    ps = prompts(3, seed=7)
    eager = make_engine(tiny, graphs=False, kv=KVCompressor(dtype=dtype))
    expected = [o.token_ids for o in eager.generate(ps, GREEDY)]
    engine = make_engine(tiny, graphs=True, kv=KVCompressor(dtype=dtype))
    assert graphable(engine.cache)
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == expected
    assert engine.runner.graphs.num_runs == GREEDY.max_tokens - 1


def test_staged_int4_caches_are_not_graphed(tiny):
    engine = make_engine(tiny, graphs=False, kv=KVCompressor(dtype="int4", block_size=16))
    assert not graphable(engine.cache)
    assert "staged" in engine.runner.enable_decode_graphs(8, engine.max_model_len, capture=False)
    with pytest.raises(ValueError, match="per-token K/V rows"):
        DecodeGraphs(tiny.model, engine.cache, 8, engine.max_model_len, capture=False)


def test_graphs_turn_drafting_off(tiny):
    """A drafted step is not decode-only, so it would run eagerly beside the graphs: with graphs the engine
    does not draft, and says so."""
    config = EngineConfig(KVConfig(block_size=16, num_blocks=64), SchedulerConfig(max_num_seqs=4))
    engine = LLMEngine(tiny.model, tiny.config, None, config)
    assert engine.speculation["enabled"]
    assert engine.use_decode_graphs(4, capture=False) is None
    assert not engine.speculation["enabled"] and "CUDA graphs" in engine.speculation["reason"]
    assert engine.scheduler.draft is None and engine.timer.on_decode is None  # nothing left costing drafts
    repeating = [7, 8, 9, 10] * 8  # prompt lookup would draft here
    out = engine.generate([repeating], GREEDY)[0].token_ids
    assert out == make_engine(tiny, graphs=False).generate([repeating], GREEDY)[0].token_ids
    assert engine.runner.graphs.num_runs == GREEDY.max_tokens - 1  # every decode step a graph step
