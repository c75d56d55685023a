"""KV compression through LLMEngine on a tiny random model: codecs, per-lane eviction with compaction,
positions, pool integrity, the prefix-cache rule, and Pipeline / inject wiring."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from mcp2026.bench.kv_measure import max_concurrent_sequences
from mcp2026.bench.quality import compare_quality
from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.kv.compressor import KVCompressor
from mcp2026.loading.loader import load_model
from mcp2026.types import SamplingParams

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(tiny, kv=None, num_blocks=96, **sched) -> LLMEngine:
    block_size = kv.block_size if kv is not None else 16
    config = EngineConfig(
        KVConfig(block_size=block_size, num_blocks=num_blocks), SchedulerConfig(**sched), kv_compressor=kv
    )
    return LLMEngine(tiny.model, tiny.config, None, config)


def prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 320, (int(k),), generator=g).tolist()
        for k in torch.randint(20, 90, (n,), generator=g)
    ]


def run(engine: LLMEngine, ps, params=PARAMS, check=False) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in ps]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.output.token_ids
        if check:
            engine.kv_manager.check_integrity()
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def reference(tiny):
    return run(make_engine(tiny, max_num_batched_tokens=32), prompts())


@pytest.mark.parametrize(
    "kv",
    [
        KVCompressor(dtype="fp32", policy="none"),
        KVCompressor(dtype="fp32", policy="heavy_hitter", sparsity_ratio=0.0),
        KVCompressor(dtype="fp32", policy="sink_window", sparsity_ratio=0.0),
        KVCompressor(dtype="fp32", policy="snap", sparsity_ratio=0.0),
    ],
)
def test_lossless_and_zero_sparsity_equal_uncompressed(tiny, reference, kv):
    engine = make_engine(tiny, kv, max_num_batched_tokens=32)  # chunked prefill reads the cache too
    assert run(engine, prompts()) == reference
    assert engine.kv_debug_report()["pool"]["num_evicted_blocks"] == 0


def test_quantized_kv_stays_close(tiny, reference):
    tokens = torch.randint(3, 320, (160,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = make_engine(tiny)
    results = {
        dtype: compare_quality(
            ref, make_engine(tiny, KVCompressor(dtype=dtype, policy="none", block_size=16)), tokens, 64, 32, 8
        )
        for dtype in ("int8", "fp8", "int4")
    }
    assert results["int8"].kld < 1e-5 and results["int8"].top1_agreement > 0.98
    assert results["int8"].kld < results["fp8"].kld < results["int4"].kld < 1e-3
    assert abs(results["int4"].delta_ppl) < 0.01
    engine = make_engine(tiny, KVCompressor(dtype="int8", policy="none"))
    out = run(engine, prompts())
    assert sum(a[:8] == b[:8] for a, b in zip(out, reference)) >= 2  # greedy: mostly equal
    report = engine.kv_debug_report()
    assert report["codec"] == "int8" and report["num_error_checks"] > 0
    assert max(report["k_error_max"] + report["v_error_max"]) < 0.02 and not report["layers_over_max_error"]


def test_int4_staging_through_the_engine(tiny, caplog):
    kv = KVCompressor(dtype="int4", policy="none", block_size=16)
    engine = make_engine(tiny, kv, max_num_batched_tokens=16)
    with caplog.at_level(logging.WARNING, logger="mcp2026.kv.debug"):
        out = run(engine, prompts(4, seed=1), check=True)
    assert all(len(o) == PARAMS.max_tokens for o in out)
    report = engine.kv_debug_report()
    assert report["num_shape_checks"] > 0 and report["layers_over_max_error"]  # int4 > 2% is reported
    # ... every layer and kind over it in the report, one line in the log
    assert len(report["layers_over_max_error"]) > 1
    (warning,) = [r for r in caplog.records if r.name == "mcp2026.kv.debug"]
    assert "exceeds max_error 0.0200 (logged once" in warning.getMessage()
    engine.step()  # the next step releases the last finished requests' staging blocks
    assert engine.cache.num_staged == 0
    assert engine.kv_manager.num_free_blocks == 96


@pytest.mark.parametrize(("dtype", "atol"), [("fp32", 1e-4), ("int8", 0.02), ("int4", 0.1)])
def test_eviction_keeps_positions(tiny, monkeypatch, dtype, atol):
    """Each layer and KV head drops a different block; the survivors, and the partly filled last block, are
    compacted into fewer slots. Decoding afterwards == full fp32 attention that masks exactly what each
    (layer, head) dropped (within the codec's error; int4 keeps its unfilled block in staging)."""
    from mcp2026.models import llama

    kv = None if dtype == "fp32" else KVCompressor(dtype=dtype, policy="none", block_size=16)
    engine = make_engine(tiny, kv)
    prompt = torch.randint(3, 320, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0))
    engine.step()  # the prompt (3 full blocks and 12 tokens), then the first token
    nkv, num_layers = tiny.config.num_kv_heads, tiny.config.num_layers
    lanes = num_layers * nkv
    dropped = [1 + lane % 2 for lane in range(lanes)]  # block 1 (positions 16..31) or 2 (32..47)
    source = torch.tensor([[s for s in range(4) if s != d] for d in dropped])
    tables = engine.kv_manager.drop_slots(rid, 4, 1, 1)
    assert tables is not None and len(tables[1]) == len(tables[0]) - 1
    assert engine.cache.compact(*tables, source) > 0
    assert engine.kv_manager.num_dropped_tokens(rid) == 16
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.finished), final)
    out = final.output
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    seq = torch.tensor(prompt + out.token_ids[:-1])
    n = len(seq)
    group = tiny.config.num_heads // nkv
    masks = []
    for layer in range(num_layers):
        m = torch.ones(nkv, n, n).tril().bool()
        for h in range(nkv):
            d = dropped[layer * nkv + h]
            m[h, 60:, d * 16 : (d + 1) * 16] = False  # queries after the eviction never see those keys
        masks.append(m.repeat_interleave(group, 0))  # (nh, n, n)

    def masked_attention(layer, q, k, v, ctx, window=None):
        assert window is None  # full attention: the masks below are the whole story
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1).repeat_interleave(group, 0),
            v.transpose(0, 1).repeat_interleave(group, 0),
            attn_mask=masks[layer],
            scale=1.0,
        )
        return o.transpose(0, 1)

    monkeypatch.setattr(llama, "attention", masked_attention)
    with torch.inference_mode():
        logits = tiny.model.compute_logits(tiny.model(seq, torch.arange(n)))[59:]
    logprobs = torch.log_softmax(logits, -1)
    assert logits.argmax(-1).tolist() == out.token_ids
    err = (got - logprobs[torch.arange(6), out.token_ids]).abs().max()
    assert err < atol, f"{dtype}: logprobs off by {err:.3g}"


@pytest.mark.parametrize("layer_weights", [None, (1.0, 3.0)])
@pytest.mark.parametrize("policy", ["sink_window", "heavy_hitter", "dynamic_window", "snap"])
def test_evictor_lanes_match_what_the_model_attends_to(tiny, monkeypatch, policy, layer_weights):
    """The evictor's own record of which block each slot holds in each lane (``lane_origins``, read before
    every step) is what the engine attends to: full fp32 attention masked to exactly those blocks per (layer,
    KV head), plus the step's own tokens, gives the engine's logprobs. Chunked prefill, eviction mid-prompt
    (sink_window, dynamic_window) and at the prompt end, and during decode; with per-layer budgets the layers
    keep different numbers of blocks, packed into each other's pages."""
    from mcp2026.models import llama

    bs = 8
    kv = KVCompressor(
        dtype="fp32",
        policy=policy,
        sparsity_ratio=0.6,
        recent_window=8,
        num_sink_tokens=4,
        block_size=bs,
        layer_weights=layer_weights,
    )
    engine = make_engine(tiny, kv, num_blocks=64, long_prefill_token_threshold=24)
    prompt = torch.randint(3, 320, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0))
    request = engine.request_state(rid).request
    num_layers, nkv = tiny.config.num_layers, tiny.config.num_kv_heads
    history = []  # (first position the step computes, origins of the cached slots before it)
    final = None
    while engine.has_unfinished():
        start = request.num_computed_tokens
        cached = start - engine.kv_manager.num_dropped_tokens(rid)
        history.append((start, engine.evictor.lane_origins(rid, -(-cached // bs))))
        final = next((o for o in engine.step() if o.finished), final)
        engine.kv_manager.check_integrity()
        if layer_weights is not None and engine.has_unfinished():
            engine.evictor.layer_pages.check_integrity(rid, engine.kv_manager.block_table(rid))
    assert engine.evictor.counters.num_evicted_blocks > 0
    if layer_weights is not None:  # layer 1 keeps more than layer 0
        final_lanes = history[-1][1]
        assert len(final_lanes[-1]) > len(final_lanes[0])
    out = final.output
    seq = torch.tensor(prompt + out.token_ids[:-1])
    n = len(seq)
    masks = torch.zeros(num_layers, nkv, n, n, dtype=torch.bool)
    ends = [h[0] for h in history[1:]] + [n]
    for (start, origins), end in zip(history, ends):
        for lane, blocks in enumerate(origins):
            layer, head = divmod(lane, nkv)
            for p in range(start, min(end, n)):
                for b in blocks:
                    masks[layer, head, p, b * bs : min((b + 1) * bs, start)] = True
                masks[layer, head, p, start : p + 1] = True
    group = tiny.config.num_heads // nkv

    def masked_attention(layer, q, k, v, ctx, window=None):
        assert window is None  # full attention: the masks below are the whole story
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1).repeat_interleave(group, 0),
            v.transpose(0, 1).repeat_interleave(group, 0),
            attn_mask=masks[layer].repeat_interleave(group, 0),
            scale=1.0,
        )
        return o.transpose(0, 1)

    monkeypatch.setattr(llama, "attention", masked_attention)
    with torch.inference_mode():
        logits = tiny.model.compute_logits(tiny.model(seq, torch.arange(n)))[len(prompt) - 1 :]
    logprobs = torch.log_softmax(logits, -1)[torch.arange(40), out.token_ids]
    assert logits.argmax(-1).tolist() == out.token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.logprobs]), logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("dtype", "policy", "fused"),
    [
        ("fp32", "heavy_hitter", True),
        ("fp32", "heavy_hitter", False),
        ("int8", "sink_window", True),
        ("int4", "heavy_hitter", True),
        ("int4", "dynamic_window", False),
        ("fp32", "snap", True),
    ],
)
def test_equal_layer_weights_give_the_uniform_engine(tiny, monkeypatch, dtype, policy, fused):
    """Per-layer budgets with equal weights keep what uniform eviction keeps: the layered cache's per-layer
    tables, packing and reads give the same tokens and logprobs, with the decode kernel and without it."""
    from mcp2026.engine import runner

    if not fused:
        monkeypatch.setattr(runner.ops, "decode_kernel_available", lambda *a: False)
    kv = KVCompressor(
        dtype=dtype,
        policy=policy,
        sparsity_ratio=0.5,
        recent_window=16,
        block_size=32 if dtype == "int4" else 16,
    )
    params = SamplingParams(max_tokens=60, ignore_eos=True, logprobs=0)
    ps = prompts(3, seed=7)

    def outputs(compressor):
        engine = make_engine(tiny, compressor, max_num_batched_tokens=32)
        ids = [engine.add_request(p, params) for p in ps]
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.output
            engine.kv_manager.check_integrity()
        assert engine.evictor.counters.num_evicted_blocks > 0
        assert engine.runner.fused_decode == fused
        return [done[i] for i in ids]

    uniform = outputs(kv)
    layered = outputs(dataclasses.replace(kv, layer_weights=(2.0, 2.0)))
    assert [o.token_ids for o in layered] == [o.token_ids for o in uniform]
    for a, b in zip(layered, uniform):
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]


def test_layer_weights_share_the_same_memory_unevenly(tiny):
    """Uneven weights: the request holds the uniform budget's blocks; its layers keep slots in proportion."""
    bs = 8
    kv = KVCompressor(
        dtype="int8",
        policy="sink_window",
        sparsity_ratio=0.6,
        recent_window=8,
        block_size=bs,
        layer_weights="1/3",
    )
    engine = make_engine(tiny, kv)
    rid = engine.add_request(prompts(1, seed=3)[0], SamplingParams(max_tokens=120, ignore_eos=True))
    request = engine.request_state(rid).request
    while engine.has_unfinished():
        engine.step()
        engine.kv_manager.check_integrity()
        state = engine.request_state(rid)
        if state is None:
            break
        n = request.num_computed_tokens
        table = engine.kv_manager.block_table(rid)
        engine.evictor.layer_pages.check_integrity(rid, table)
        if engine.evictor.layer_pages.is_packed(rid):
            assert len(table) <= kv.budget().num_keep_blocks(n) + 1
            slots = [len(p) for p in engine.evictor.layer_pages.pages(rid, table)]
            assert slots[1] >= slots[0]  # layer 1 grows one slot per block towards its share
            layers = engine.kv_debug_report()["eviction"]["layer_budgets"]
            assert layers["num_packed_requests"] == 1
            assert layers["num_idle_pages"] == 2 * len(table) - sum(slots) < 2  # fewer than one block's pages
    assert slots[1] > 2 * slots[0]
    assert engine.evictor.report()["num_dropped_pages"] > 0
    assert engine.kv_manager.num_free_blocks == 96


def test_auto_layer_weights_take_the_models_calibrated_preset(tiny, monkeypatch):
    """``layer_weights="auto"`` (the default) gives a model whose fingerprint has a calibration that preset, for
    the policies it was calibrated with, exactly as if it were asked for by name; others stay uniform."""
    from mcp2026.kv import layer_weights

    calibration = layer_weights.Calibration(layer_weights.fingerprint(tiny.config), ("sink_window",))
    monkeypatch.setitem(layer_weights.CALIBRATIONS, "tiny", calibration)
    monkeypatch.setitem(layer_weights.PRESETS, "tiny", (1.0, 3.0))
    kv = KVCompressor(dtype="int8", policy="sink_window", sparsity_ratio=0.6, recent_window=8, block_size=8)
    ps, params = prompts(2, seed=3), SamplingParams(max_tokens=80, ignore_eos=True)

    auto = make_engine(tiny, kv)
    assert auto.config.kv_compressor.layer_weights == (1.0, 3.0) and auto.cache.layered
    named = make_engine(tiny, dataclasses.replace(kv, layer_weights="tiny"))
    assert run(auto, ps, params) == run(named, ps, params)
    assert auto.kv_debug_report()["eviction"]["layer_budgets"]["preset"] == "tiny"
    assert auto.evictor.report()["num_dropped_pages"] > 0  # the layers did keep unevenly

    uniform = make_engine(tiny, dataclasses.replace(kv, layer_weights="uniform"))
    other_policy = make_engine(tiny, dataclasses.replace(kv, policy="heavy_hitter"))
    for engine in (uniform, other_policy):
        assert engine.config.kv_compressor.layer_weights is None and not engine.cache.layered


def test_layer_weights_errors(tiny):
    with pytest.raises(ValueError, match="one per layer"):
        make_engine(tiny, KVCompressor(dtype="fp32", policy="heavy_hitter", layer_weights=(1.0, 2.0, 3.0)))
    with pytest.raises(ValueError, match="positive"):
        KVCompressor(policy="heavy_hitter", layer_weights=(1.0, 0.0))
    with pytest.raises(ValueError, match="must be 'auto', 'uniform', a preset"):
        KVCompressor(policy="heavy_hitter", layer_weights="1/x")
    with pytest.raises(ValueError, match="policy='none'"):
        KVCompressor(dtype="int8", policy="none", layer_weights=(1.0, 1.0))
    assert KVCompressor(policy="heavy_hitter", layer_weights="1/2.5").layer_weights == (1.0, 2.5)
    assert KVCompressor.from_dict({"policy": "snap", "layer_weights": [1, 2]}).layer_weights == (1.0, 2.0)


@pytest.mark.parametrize("policy", ["sink_window", "heavy_hitter", "dynamic_window"])
def test_eviction_frees_blocks_and_keeps_the_pool_whole(tiny, policy):
    kv = KVCompressor(
        dtype="int8", policy=policy, sparsity_ratio=0.6, recent_window=16, num_sink_tokens=4, block_size=8
    )
    engine = make_engine(tiny, kv)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    ps = prompts(3, seed=2)
    ids = [engine.add_request(p, params) for p in ps]
    max_dropped = 0
    while engine.has_unfinished():
        engine.step()
        engine.kv_manager.check_integrity()
        max_dropped = max(max_dropped, sum(engine.kv_manager.num_dropped_tokens(i) // 8 for i in ids))
        for rid in ids:
            state = engine.request_state(rid)
            if state is not None and state.request.num_computed_tokens > 40:  # the budget holds
                n = state.request.num_computed_tokens
                table = engine.kv_manager.block_table(rid)
                assert len(table) <= kv.budget().num_keep_blocks(n) + 1
                # the table covers exactly the tokens that were not evicted
                assert len(table) == -(-(n - engine.kv_manager.num_dropped_tokens(rid)) // 8)
    report = engine.kv_debug_report()
    assert max_dropped > 0 and report["eviction"]["num_evicted_blocks"] >= max_dropped
    assert engine.kv_manager.num_free_blocks == 96  # every block back (free or cached)
    if policy != "sink_window":
        assert engine.evictor.counters.score_ms > 0


def test_batched_equals_alone_under_eviction(tiny):
    kv = KVCompressor(dtype="fp32", policy="sink_window", sparsity_ratio=0.5, recent_window=16, block_size=8)
    ps = prompts(3, seed=5)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    batched = run(make_engine(tiny, kv), ps, params)
    alone = [run(make_engine(tiny, kv), [p], params)[0] for p in ps]
    assert batched == alone


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_lossy_caches_do_not_depend_on_prefill_chunking(tiny, codec):
    """Every prefill chunk, the first too, attends to the K/V the cache stores (a staged codec's query reads its
    own block staged, as decode does): prompts chunked three ways, and batched vs one at a time, give the same
    logprobs."""
    kv = KVCompressor(dtype=codec, policy="none")
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    ps = [p * 3 for p in prompts(3, seed=1)]  # 60-270 tokens: several blocks and chunks
    runs = [
        make_engine(
            tiny, kv, num_blocks=128, long_prefill_token_threshold=chunk, long_prefill_ms=None
        ).generate(ps, params)
        for chunk in (16, 40, 2048)  # 40: not a block multiple
    ]
    alone = [
        make_engine(tiny, kv, num_blocks=128, long_prefill_token_threshold=40).generate([p], params)[0]
        for p in ps
    ]
    for other in (*runs[1:], alone):
        for a, b in zip(runs[0], other, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_prefill_reads_the_same_apart_or_in_one_call(tiny, tiny_dir, monkeypatch, dtype):
    """On the CPU an int4 chunk reads the sealed context and each query's own staged block apart (merged by
    log-sum-exp); other devices take both key sets in one SDPA call under one mask. Same results (bf16
    activations: within their rounding)."""
    from mcp2026.models import attention

    model = tiny if dtype == torch.float32 else load_model(tiny_dir, dtype=dtype)
    kv = KVCompressor(dtype="int4", policy="none")
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    ps = [p * 3 for p in prompts(3, seed=2)]
    sched = dict(num_blocks=128, long_prefill_token_threshold=40, long_prefill_ms=None)
    apart = make_engine(model, kv, **sched).generate(ps, params)
    monkeypatch.setattr(attention, "SPLIT_STAGED_DEVICES", ())
    joint = make_engine(model, kv, **sched).generate(ps, params)
    tol = 1e-5 if dtype == torch.float32 else 0.02  # bf16: 0.004 measured (8-bit mantissas per layer)
    for a, b in zip(apart, joint, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < tol


@pytest.mark.parametrize(("block_size", "threshold"), [(16, 15), (16, 31), (16, 47), (32, 31), (32, 63)])
def test_int4_chunks_ending_anywhere_in_a_block(tiny, block_size, threshold):
    """Chunk boundaries next to a block's end: a 1-token chunk that fills a block runs as a decode step, which
    seals the block before attending, so a prefill query that fills a block must read it sealed too."""
    kv = KVCompressor(dtype="int4", policy="none", block_size=block_size)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    two, three = 2 * block_size, 3 * block_size
    ps = [list(range(10, 10 + two)), list(range(50, 50 + three))]  # whole blocks
    sched = dict(num_blocks=64, long_prefill_ms=None)
    whole = make_engine(tiny, kv, long_prefill_token_threshold=2048, **sched).generate(ps, params)
    chunked = make_engine(tiny, kv, long_prefill_token_threshold=threshold, **sched).generate(ps, params)
    for a, b in zip(whole, chunked, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_int4_batched_equals_alone_when_decodes_share_a_tight_budget(tiny):
    """Five prompts behind a 64-token budget that decodes share (chunks start mid-block wherever the budget
    ends): int4 results equal one-at-a-time runs."""
    kv = KVCompressor(dtype="int4", policy="none")
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    ps = prompts(5, seed=3)
    sched = dict(
        num_blocks=128, max_num_batched_tokens=64, long_prefill_token_threshold=64, long_prefill_ms=None
    )
    batched = make_engine(tiny, kv, **sched).generate(ps, params)
    alone = [make_engine(tiny, kv, **sched).generate([p], params)[0] for p in ps]
    for a, b in zip(batched, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.parametrize("block_size", [16, 32])
def test_generated_int4_blocks_hold_what_a_prefill_stores(tiny, block_size):
    """The prefix rule for int4 (blocks of generated tokens are offered to a later turn): a decode step reads its
    still-filling block from staging, so a prefill query reads its own block staged too (the token that fills a
    block reads it sealed, as its decode step does), and a sealed block encodes the staged (rounded) numbers
    whichever step seals it. Then the blocks a generation filled and those a fresh prefill of the same tokens
    fills hold the same bytes (all of them here; the bound leaves room for float summation order moving a value
    across a rounding boundary on another CPU). Without the seal rounding 9.3% of the bytes differ, without the
    staged view 5.6%, with the block-filling token reading its block staged 0.8%."""
    kv = KVCompressor(dtype="int4", policy="none", block_size=block_size)
    prompt = torch.randint(3, 320, (37,), generator=torch.Generator().manual_seed(6)).tolist()
    end = 80 if block_size == 16 else 96  # blocks from position 32 to end: the prompt's last 5 tokens, then
    blocks = slice(32 // block_size, end // block_size)  # generated ones (sealed by decode steps)
    gen_engine, fresh_engine = make_engine(tiny, kv, num_blocks=64), make_engine(tiny, kv, num_blocks=64)
    rid = gen_engine.add_request(prompt, SamplingParams(max_tokens=end - 37 + 12, ignore_eos=True))
    state = gen_engine.request_state(rid)
    while state.request.num_output_tokens < end - 37 + 11:
        gen_engine.step()
    fresh = fresh_engine.add_request(
        prompt + state.request.output_token_ids[: end - 37], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    while fresh_engine.request_state(fresh).request.num_output_tokens == 0:
        fresh_engine.step()
    gen_ids = gen_engine.kv_manager.block_table(rid)[blocks]
    fresh_ids = fresh_engine.kv_manager.block_table(fresh)[blocks]
    differ, total = 0, 0
    for gen_planes, fresh_planes in (
        (gen_engine.cache.k_planes, fresh_engine.cache.k_planes),
        (gen_engine.cache.v_planes, fresh_engine.cache.v_planes),
    ):
        for name, plane in gen_planes.items():
            a, b = plane[:, gen_ids], fresh_planes[name][:, fresh_ids]
            differ, total = differ + int((a != b).sum()), total + a.numel()
    assert differ / total < 0.002


def test_an_fp32_cache_under_a_bf16_model(tiny_dir):
    """K/V stored wider than the activations: decode reads them in place like any float cache."""
    model = load_model(tiny_dir, dtype=torch.bfloat16)
    engine = make_engine(model, KVCompressor(dtype="fp32", policy="none"))
    assert not engine.cache.stores_exactly  # written as fp32 from bf16: exact, but not the activation dtype
    outs = run(engine, prompts(2))
    assert all(len(o) == PARAMS.max_tokens for o in outs)


def test_context_speeds_take_turns(tiny):
    """The kv bench's speed columns: engines prefill the same prompt chunk by chunk and then decode, side by
    side, one step each in rotating order; one prefill and one decode speed per engine."""
    from mcp2026.bench.kv_measure import context_speeds

    sched = dict(long_prefill_token_threshold=16, long_prefill_ms=None)  # 40 tokens: chunks of 16, 16, 8
    engines = {
        "a": make_engine(tiny, **sched),
        "b": make_engine(tiny, KVCompressor(dtype="int8", policy="none"), **sched),
    }
    order = []
    for name, engine in engines.items():
        step = engine.step

        def logged(step=step, name=name):
            order.append(name)
            return step()

        engine.step = logged
    speeds = context_speeds(engines, context_len=40, num_tokens=4)
    assert set(speeds.decode) == set(speeds.prefill) == {"a", "b"}
    assert all(s > 0 for s in (*speeds.decode.values(), *speeds.prefill.values()))
    assert order == ["a", "b", "b", "a", "a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert all(not e.has_unfinished() for e in engines.values())


def test_snap_compresses_once_after_the_prompt(tiny):
    kv = KVCompressor(dtype="fp32", policy="snap", sparsity_ratio=0.5, recent_window=16, block_size=8)
    engine = make_engine(tiny, kv)
    rid = engine.add_request(list(range(10, 90)), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert (
        engine.kv_manager.num_dropped_tokens(rid) == 5 * 8
    )  # 10 blocks -> keep 5 (sink 1 + recent 2 + 2 best)
    while engine.has_unfinished():
        engine.step()
    assert engine.evictor.counters.num_eviction_events == 1


@pytest.mark.parametrize("layer_weights", [None, (1.0, 3.0)])
def test_compressed_blocks_are_not_prefix_hits(tiny, layer_weights):
    kv = KVCompressor(
        dtype="int8", policy="sink_window", sparsity_ratio=0.5, recent_window=16, layer_weights=layer_weights
    )
    engine = make_engine(tiny, kv)
    prompt = torch.randint(3, 320, (64,), generator=torch.Generator().manual_seed(6)).tolist()
    first = run(engine, [prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    # A continuation of the compressed request: only the prompt blocks (a fresh prefill's bytes) hit.
    follow = prompt + first[:36]
    rid = engine.add_request(follow, SamplingParams(max_tokens=8, ignore_eos=True))
    state = engine.request_state(rid)
    while engine.has_unfinished():
        engine.step()
    assert state.request.num_cached_tokens == 64
    fresh = make_engine(tiny, kv)
    again = fresh.add_request(follow, SamplingParams(max_tokens=8, ignore_eos=True))
    fresh_state = fresh.request_state(again)
    while fresh.has_unfinished():
        fresh.step()
    assert state.request.output_token_ids == fresh_state.request.output_token_ids
    engine.kv_manager.check_integrity()


@pytest.mark.parametrize("layer_weights", [None, (1.0, 3.0), (3.0, 1.0)])
def test_compaction_never_rewrites_blocks_another_request_reads(tiny, layer_weights):
    """B hits A's prompt blocks (prefix cache) while A still holds them; both then compact (snap, at their
    prompt ends, in the same step). Outputs equal each run alone: shared blocks were copied, not rewritten
    (per-layer budgets pack slots into other layers' pages of any block: those blocks are copied first)."""
    kv = KVCompressor(
        dtype="fp32",
        policy="snap",
        sparsity_ratio=0.5,
        recent_window=16,
        block_size=8,
        layer_weights=layer_weights,
    )
    g = torch.Generator().manual_seed(8)
    prefix = torch.randint(3, 320, (64,), generator=g).tolist()
    a = prefix + torch.randint(3, 320, (24,), generator=g).tolist()
    b = prefix + torch.randint(3, 320, (16,), generator=g).tolist()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = make_engine(tiny, kv, long_prefill_token_threshold=32)
    ra = engine.add_request(a, params)
    engine.step()
    engine.step()  # A's first 64 tokens are computed and registered
    rb = engine.add_request(b, params)
    state_b = engine.request_state(rb)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.output.token_ids
        engine.kv_manager.check_integrity()
    assert state_b.request.num_cached_tokens == 64
    assert engine.kv_manager.num_dropped_tokens(ra) == 0  # freed
    assert engine.evictor.counters.num_eviction_events == 2
    alone = [run(make_engine(tiny, kv, long_prefill_token_threshold=32), [p], params)[0] for p in (a, b)]
    assert [out[ra], out[rb]] == alone


@pytest.mark.parametrize("policy", ["heavy_hitter", "sink_window"])
@pytest.mark.parametrize("layer_weights", [None, (1.0, 3.0)])
def test_recompute_after_preemption_fits_what_the_scheduler_admitted(tiny, policy, layer_weights):
    """A preempted request recomputes prompt + output in chunks that run past the prompt end. heavy_hitter's
    keep-the-prompt-whole rule must follow what the scheduler admitted (prompt + output here, which does not
    fit the 8-block pool): it streams instead, and the request finishes (it used to preempt itself forever)."""
    kv = KVCompressor(
        dtype="fp32",
        policy=policy,
        sparsity_ratio=0.6,
        recent_window=8,
        num_sink_tokens=4,
        block_size=8,
        layer_weights=layer_weights,
    )
    config = EngineConfig(
        KVConfig(block_size=8, num_blocks=8, enable_prefix_caching=False),
        SchedulerConfig(long_prefill_token_threshold=24),
        kv_compressor=kv,
    )
    engine = LLMEngine(tiny.model, tiny.config, None, config)
    prompt = torch.randint(3, 320, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    request = engine.request_state(rid).request
    final = None
    for _ in range(200):
        if request.num_tokens >= 66 and request.num_preemptions == 0:
            engine.scheduler._preempt(request, None)  # as memory pressure would
        final = next((o for o in engine.step() if o.finished), final)
        engine.kv_manager.check_integrity()
        if not engine.has_unfinished():
            break
    assert final is not None and final.finish_reason == "length" and len(final.output.token_ids) == 24
    assert request.num_preemptions == 1


def test_pipeline_kv_and_inject(tiny_dir, tiny):
    from mcp2026 import Pipeline

    pipe = Pipeline(model=tiny_dir, dtype="fp32", kv=KVCompressor(dtype="int8", policy="sink_window"))
    assert pipe.engine.cache.codec.name == "int8" and pipe.engine.evictor is not None
    out = pipe.engine.generate([prompts(1)[0]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8
    report = pipe.engine.kv_debug_report()
    assert report["compressor"]["policy"] == "sink_window" and "internal_fragmentation" in report["pool"]
    plain = Pipeline(model=tiny_dir, dtype="fp32", kv={"dtype": "int4", "policy": "none", "block_size": 32})
    assert plain.engine.cache.block_size == 32 and plain.engine.evictor is None
    assert KVCompressor(dtype="fp8", policy="none").inject(plain) is plain
    assert plain.engine.cache.codec.name == "fp8" and plain.engine.cache.block_size == 16
    assert len(plain.engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].token_ids) == 4
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(KVConfig(block_size=32), kv_compressor=KVCompressor())
    # int4's default block is its 32-token key group; the engine's blocks follow the compressor's
    default = Pipeline(model=tiny_dir, dtype="fp32", kv={"dtype": "int4", "policy": "none"})
    assert default.engine.cache.block_size == 32 and default.engine.kv_manager.block_size == 32
    with pytest.raises(ValueError, match="leave KVConfig.block_size"):
        EngineConfig(KVConfig(block_size=16), kv_compressor=KVCompressor(dtype="int4"))
    assert EngineConfig(KVConfig(), kv_compressor=None).block_size == 16
    # an unset KVConfig block size stays unset: a compressor given later still decides
    later = dataclasses.replace(EngineConfig(KVConfig(memory_gb=1)), kv_compressor=KVCompressor(dtype="int4"))
    assert later.block_size == 32 and later.resolved_kv.block_size == 32
    int4 = max_concurrent_sequences(tiny.config, KVCompressor(dtype="int4", policy="none"), 10**7, 2048)
    bf16 = max_concurrent_sequences(tiny.config, KVCompressor(dtype="bf16", policy="none"), 10**7, 2048)
    assert int4 > 2.5 * bf16


@pytest.mark.parametrize(
    ("kv", "streams"),
    [
        (KVCompressor(policy="sink_window", max_kv_tokens=64, recent_window=32), True),
        (KVCompressor(policy="heavy_hitter", max_kv_tokens=64, recent_window=32), True),
        (KVCompressor(policy="snap", max_kv_tokens=64, recent_window=32), False),  # waits for the prompt
        (None, False),
    ],
    ids=["sink_window", "heavy_hitter", "snap", "no-eviction"],
)
def test_prompt_longer_than_the_pool_streams_through_eviction(tiny, kv, streams):
    # 16 blocks of 16 tokens = 256 tokens of pool; a 400-token prompt prefilled in 64-token chunks
    engine = make_engine(tiny, kv, num_blocks=16, long_prefill_token_threshold=64)
    prompt = torch.randint(3, 320, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            final = o if o.finished else final
        engine.kv_manager.check_integrity()
    assert final is not None and final.request_id == request_id
    if streams:
        assert final.finish_reason == "length" and len(final.output.token_ids) == 8
    else:
        assert final.finish_reason == "error" and "KV blocks" in final.error
