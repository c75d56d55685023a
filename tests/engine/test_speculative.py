"""Speculative decoding in the engine: exactly plain decoding's output, greedy and sampled, whatever the drafts."""

from __future__ import annotations

import pytest
import torch

from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig, SpeculativeConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.kv.compressor import KVCompressor
from mcp2026.loading.loader import load_model
from mcp2026.types import SamplingParams

from conftest import save_tiny_hf

OFF = SpeculativeConfig(method="off")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(save_tiny_hf(tmp_path_factory.mktemp("tiny_spec"), max_position_embeddings=256))


def make_engine(tiny, spec: SpeculativeConfig | None = None, kv=None, **sched) -> LLMEngine:
    config = EngineConfig(
        KVConfig(block_size=kv.block_size if kv else 16, num_blocks=96),
        SchedulerConfig(**sched),
        kv_compressor=kv,
        speculative=spec or SpeculativeConfig(),
    )
    return LLMEngine(tiny.model, tiny.config, None, config)


def grounded_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """A random 'text' followed by a repeat of its start: the model's continuation often copies it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        text = torch.randint(3, 320, (int(torch.randint(20, 50, (1,), generator=g)),), generator=g).tolist()
        out.append(text + text[: int(torch.randint(3, 8, (1,), generator=g))])
    return out


def force_drafts(engine: LLMEngine, drafts_for) -> None:
    """Replace the n-gram guesses with ``drafts_for(request_id, tokens, limit)`` (the policy still caps k)."""
    engine.drafter.propose = lambda rid, tokens, limit, n: drafts_for(rid, tokens, limit)[:limit]


def test_greedy_output_is_plain_decoding_and_drafts_were_kept(tiny):
    ps = grounded_prompts(6)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [o.token_ids for o in make_engine(tiny, OFF).generate(ps, params)]
    engine = make_engine(tiny)
    assert [o.token_ids for o in engine.generate(ps, params)] == plain
    stats = engine.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # the drafts did run, and some held
    assert engine.stats.num_decode_tokens == sum(len(t) - 1 for t in plain)
    engine.kv_manager.check_integrity()


def test_wrong_and_right_drafts_give_the_same_tokens(tiny):
    """Drafts that always fail, and drafts that are the plain output itself (all kept): same tokens."""
    ps = grounded_prompts(4, seed=1)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    off = make_engine(tiny, OFF)
    plain = {f"r{i}": o.token_ids for i, o in enumerate(off.generate(ps, params))}

    wrong = make_engine(tiny)
    force_drafts(wrong, lambda rid, tokens, limit: [(t + 1) % 320 for t in tokens[-4:]])
    ids = [wrong.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(ps)]
    got = run(wrong)
    assert [got[i] for i in ids] == [plain[i] for i in ids]
    assert wrong.stats.num_accepted_tokens == 0 and wrong.stats.num_drafts > 0

    right = make_engine(tiny)
    prompt_len = {f"r{i}": len(p) for i, p in enumerate(ps)}
    force_drafts(right, lambda rid, tokens, limit: plain[rid][len(tokens) - prompt_len[rid] :][:4])
    ids = [right.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(ps)]
    steps_before = right.stats.num_steps
    got = run(right)
    assert [got[i] for i in ids] == [plain[i] for i in ids]
    stats = right.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert right.stats.num_steps - steps_before < 30 / 2  # 5 tokens per decode step, not 1
    right.kv_manager.check_integrity()


def run(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.output.token_ids
    return done


@pytest.mark.parametrize("kv", [None, "int8"])
def test_seeded_sampling_gives_plain_decodings_tokens(tiny, kv):
    """Every token comes from the sampler on the row plain decoding would use, drawing from the same seeded
    generator in the same order: a seeded request gets the very same tokens, with penalties and logprobs."""
    ps = grounded_prompts(4, seed=2)
    params = [
        SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=s, ignore_eos=True, logprobs=2)
        for s in range(len(ps))
    ]
    params[1] = SamplingParams(
        max_tokens=30, temperature=0.5, seed=9, repetition_penalty=1.2, ignore_eos=True
    )
    compressor = KVCompressor(dtype=kv) if kv else None
    plain = make_engine(tiny, OFF, kv=compressor).generate(ps, params)
    engine = make_engine(tiny, kv=compressor)
    prompt_len = [len(p) for p in ps]
    by_rid = {}

    def oracle(rid, tokens, limit):  # drafts that hold until plain decoding's own choice differs
        i = by_rid[rid]
        return plain[i].token_ids[len(tokens) - prompt_len[i] :][:3] + [5]

    force_drafts(engine, oracle)
    for i, (p, sp) in enumerate(zip(ps, params)):
        by_rid[engine.add_request(p, sp)] = i
    got = run(engine)
    outputs = {by_rid[r]: t for r, t in got.items()}
    assert [outputs[i] for i in range(len(ps))] == [o.token_ids for o in plain]
    assert engine.stats.num_accepted_tokens > 0


def test_sampled_tokens_follow_the_models_distribution(tiny):
    """Unseeded: after the first token ``a``, the draft ``d`` is offered. Over many requests, the share of
    those with ``a`` that keep ``d`` is the model's probability of ``d`` after ``a``, and what follows a kept
    ``d`` is distributed as the model's next-token distribution after it (a wrong row would shift both)."""
    prompt = grounded_prompts(1, seed=3)[0]
    engine = make_engine(tiny, max_num_seqs=64)

    def last_logits(tokens):
        return torch.cat([c.logits for c in engine.score(tokens)])[-1]

    first = int(last_logits(prompt).argmax())
    logits = last_logits(prompt + [first])
    lo, hi = 1e-4, 10.0  # the temperature at which the most likely token after ``first`` has probability 1/2
    for _ in range(60):
        temperature = (lo * hi) ** 0.5
        lo, hi = (
            (temperature, hi) if torch.softmax(logits / temperature, -1).max() > 0.5 else (lo, temperature)
        )
    draft = int(logits.argmax())
    p_draft = float(torch.softmax(logits / temperature, -1)[draft])
    probs_after = torch.softmax(last_logits(prompt + [first, draft]) / temperature, -1)
    force_drafts(engine, lambda rid, tokens, limit: [draft] if len(tokens) == len(prompt) + 1 else [])
    n = 2000
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for _ in range(n)]
    got = run(engine)
    outputs = [got[i] for i in ids if got[i][0] == first]
    assert len(outputs) > 300, "the prompt's first token must be likely enough to condition on"
    kept = [o for o in outputs if o[1] == draft]
    share = len(kept) / len(outputs)
    sigma = (p_draft * (1 - p_draft) / len(outputs)) ** 0.5
    assert abs(share - p_draft) < 4 * sigma
    counts = torch.bincount(torch.tensor([o[2] for o in kept]), minlength=probs_after.numel()).float()
    total_variation = 0.5 * (counts / len(kept) - probs_after).abs().sum()
    assert total_variation < 0.12
    assert engine.stats.num_drafts == n


def test_staged_codecs_and_eviction_turn_it_off_and_say_why(tiny):
    assert make_engine(tiny).speculation["enabled"]
    info = make_engine(tiny, kv=KVCompressor(dtype="int4", block_size=32)).speculation
    assert not info["enabled"] and "stages" in info["reason"]
    info = make_engine(tiny, kv=KVCompressor(policy="heavy_hitter")).speculation
    assert not info["enabled"] and "eviction" in info["reason"]
    assert "off" in make_engine(tiny, OFF).speculation["reason"]


def test_stops_and_lengths_inside_a_kept_draft(tiny):
    """A stop token, max_tokens or max_model_len reached part-way through the kept drafts ends the request there."""
    ps = grounded_prompts(3, seed=4)
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    plain = [o.token_ids for o in make_engine(tiny, OFF).generate(ps, params)]
    stop_at = plain[0][7]
    stop = SamplingParams(max_tokens=25, ignore_eos=True, stop_token_ids=(stop_at,))
    expected = [make_engine(tiny, OFF).generate([p], stop)[0].token_ids for p in ps]
    engine = make_engine(tiny)
    prompt_len = [len(p) for p in ps]
    order = {}
    force_drafts(
        engine, lambda rid, tokens, limit: plain[order[rid]][len(tokens) - prompt_len[order[rid]] :][:4]
    )
    for i, p in enumerate(ps):
        order[engine.add_request(p, stop)] = i
    got = run(engine)
    assert [got[r] for r in order] == expected
    short = make_engine(tiny, max_model_len=len(ps[0]) + 9)
    force_drafts(short, lambda rid, tokens, limit: plain[0][len(tokens) - prompt_len[0] :][:4])
    out = short.generate([ps[0]], params)[0]
    assert out.token_ids == plain[0][:9] and out.finish_reason == "length"
