"""Scheduler with a fake runner that mimics paged KV: budgets, policies, chunking, prefix hits, preemption."""

from __future__ import annotations

import pytest

from mcp2026.config import SchedulerConfig
from mcp2026.engine.output import SchedulerOutput
from mcp2026.engine.request import Request, RequestStatus
from mcp2026.engine.scheduler import Scheduler
from mcp2026.kv.manager import KVCacheManager
from mcp2026.types import SamplingParams

BS = 4


class FakeRunner:
    """Writes every computed token into its (block, slot) and samples a function of the whole sequence read
    back through the block table, so a wrong table or a bad prefix hit changes the outputs."""

    def __init__(self, block_size: int = BS) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def run(self, output: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        sampled = {}
        for c in output.chunks:
            for i, token in enumerate(c.token_ids):
                pos = c.start_pos + i
                self.slots[(c.block_table[pos // bs], pos % bs)] = token
            if c.samples:
                end = c.start_pos + len(c.token_ids)
                seq = tuple(self.slots[(c.block_table[p // bs], p % bs)] for p in range(end))
                sampled[c.request_id] = hash(seq) % 1000
        return sampled


def make(num_blocks=64, max_model_len=256, num_shards=1, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 32)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(BS, num_blocks, num_shards), max_model_len)


def req(rid: str, prompt, max_tokens: int = 4, **kw) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), **kw)


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    out = sched.schedule()
    cfg = sched.config
    assert out.num_batched_tokens == sum(len(c.token_ids) for c in out.chunks) <= cfg.max_num_batched_tokens
    assert len(out.chunks) <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
    assert len({c.request_id for c in out.chunks}) == len(out.chunks)
    for c in out.chunks:
        assert len(c.block_table) * BS >= c.start_pos + len(c.token_ids)
    for r in sched.update(out, runner.run(out)):
        if r.num_output_tokens >= r.sampling_params.max_tokens and not r.is_finished:
            sched.finish_request(r.request_id, "length")
    sched.kv.check_integrity()
    return out


def run_all(sched: Scheduler, requests: list[Request], max_steps: int = 2000) -> dict[str, list[int]]:
    runner = FakeRunner()
    for r in requests:
        sched.add_request(r)
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        step(sched, runner)
    assert not sched.has_unfinished(), "did not finish: deadlock or starvation"
    return {r.request_id: r.output_token_ids for r in requests}


def test_add_request_validation():
    sched = make(max_model_len=32)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(req("a", []))
    with pytest.raises(ValueError, match="32 tokens plus 1 .* max_model_len=32"):
        sched.add_request(req("b", range(32)))
    sched.add_request(req("c", range(31)))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(req("c", range(3)))
    no_chunk = make(enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill is disabled"):
        no_chunk.add_request(req("d", range(40)))


def test_budget_and_max_num_seqs_every_step():
    sched = make(max_num_batched_tokens=16, max_num_seqs=3, long_prefill_token_threshold=8)
    requests = [req(f"r{i}", range(i, i + 5 + 3 * i), max_tokens=3 + i % 4) for i in range(10)]
    outputs = run_all(sched, requests)
    assert all(len(outputs[r.request_id]) == r.sampling_params.max_tokens for r in requests)
    assert sched.kv.num_free_blocks == sched.kv.num_online_blocks


def test_chunked_prefill_splits_with_positions_and_a_single_sampling_chunk():
    sched = make(max_num_batched_tokens=16, long_prefill_token_threshold=16)
    sched.add_request(req("a", range(40)))
    runner = FakeRunner()
    chunks = [step(sched, runner).chunks[0] for _ in range(4)]
    assert [(c.start_pos, len(c.token_ids), c.samples) for c in chunks] == [
        (0, 16, False),
        (16, 16, False),
        (32, 8, True),
        (40, 1, True),
    ]
    assert chunks[1].token_ids == list(range(16, 32))
    assert chunks[3].token_ids == sched.get_request("a").output_token_ids[:1]


def test_long_prefill_threshold_keeps_decodes_first():
    sched = make(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    runner = FakeRunner()
    sched.add_request(req("short", range(3), max_tokens=10))
    step(sched, runner)
    sched.add_request(req("long", range(100, 130)))
    out = step(sched, runner)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("short", 1), ("long", 8)]


def test_prefill_chunks_follow_the_measured_rate_within_the_step_budget():
    sched = make(max_num_batched_tokens=32, long_prefill_token_threshold=8, long_prefill_ms=100.0)
    assert sched.chunk_cap() == 8  # nothing measured yet: the token threshold
    sched.observe_prefill(32, 0.001)  # fewer tokens than a rate needs: ignored
    assert sched.prefill_tokens_per_s is None
    sched.observe_prefill(100, 1.0)  # 100 tokens/s -> 10 tokens in 100 ms: one threshold's worth
    assert sched.prefill_tokens_per_s == 100 and sched.chunk_cap() == 8
    sched.observe_prefill(200, 0.5)  # 400 tokens/s: the average moves 30% of the way, to 19 tokens
    assert sched.prefill_tokens_per_s == pytest.approx(190) and sched.chunk_cap() == 16  # whole multiples
    sched.observe_prefill(1000, 0.1)
    assert sched.chunk_cap() == 32  # never past the step budget
    runner = FakeRunner()
    sched.add_request(req("short", range(3), max_tokens=10))
    step(sched, runner)
    sched.add_request(req("long", range(100, 150)))
    out = step(sched, runner)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("short", 1), ("long", 31)]  # budget
    slow = make(long_prefill_token_threshold=8, long_prefill_ms=100.0)
    slow.observe_prefill(64, 2.0)  # 32 tokens/s: 3 tokens in 100 ms, but never below the threshold
    assert slow.chunk_cap() == 8
    fixed = make(long_prefill_token_threshold=8, long_prefill_ms=None)
    fixed.observe_prefill(1000, 0.1)
    assert fixed.chunk_cap() == 8
    streaming = Scheduler(  # a peak-blocks rule (eviction during prefill) assumes the fixed chunk
        SchedulerConfig(long_prefill_token_threshold=8),
        KVCacheManager(BS, 64, 1),
        256,
        peak_blocks=lambda n: 4,
    )
    streaming.observe_prefill(1000, 0.1)
    assert streaming.chunk_cap() == 8
    with pytest.raises(ValueError, match="long_prefill_ms"):
        SchedulerConfig(long_prefill_ms=0)


def test_without_chunking_the_whole_prompt_is_one_chunk():
    sched = make(max_num_batched_tokens=32, enable_chunked_prefill=False)
    sched.add_request(req("a", range(20)))
    sched.add_request(req("b", range(100, 120)))  # does not fit next to a: waits a step
    out = step(sched, FakeRunner())
    assert [(c.request_id, len(c.token_ids), c.samples) for c in out.chunks] == [("a", 20, True)]


def admission_order(sched: Scheduler, requests: list[Request]) -> list[str]:
    """Add all, then admit one per step (max_num_seqs=1) and record who runs."""
    for r in requests:
        sched.add_request(r)
    order, runner = [], FakeRunner()
    while sched.has_unfinished():
        for c in step(sched, runner).chunks:
            if c.request_id not in order:
                order.append(c.request_id)
    return order


def test_fcfs_order():
    requests = [req(f"r{i}", range(4), arrival_time=t) for i, t in enumerate([3.0, 1.0, 2.0])]
    assert admission_order(make(max_num_seqs=1), requests) == ["r1", "r2", "r0"]


def test_priority_order():
    requests = [req(f"r{i}", range(4), priority=p, arrival_time=i) for i, p in enumerate([2, 0, 1, 0])]
    assert admission_order(make(max_num_seqs=1, policy="priority"), requests) == ["r1", "r3", "r2", "r0"]


def test_deadline_order():
    deadlines = [None, 5.0, 2.0, None, 9.0]
    requests = [req(f"r{i}", range(4), ttft_deadline=d, arrival_time=i) for i, d in enumerate(deadlines)]
    order = admission_order(make(max_num_seqs=1, policy="deadline"), requests)
    assert order == ["r2", "r1", "r4", "r0", "r3"]


def test_sjf_runs_a_burst_shortest_prompt_first():
    lengths = [12, 3, 30, 7, 3]
    requests = [req(f"r{i}", range(n), arrival_time=0.0) for i, n in enumerate(lengths)]
    order = admission_order(make(max_num_seqs=1, policy="sjf"), requests)
    assert order == ["r1", "r4", "r3", "r0", "r2"]  # equal lengths keep arrival order


def test_sjf_ages_a_long_prompt_ahead_of_later_short_ones():
    # 100 tokens/s of aging: the 40-token prompt (key 0.4 s) goes before a 4-token prompt arriving after 0.36 s
    requests = [
        req("long", range(40), arrival_time=0.0),
        req("early-short", range(4), arrival_time=0.3),  # key 0.34
        req("late-short", range(4), arrival_time=0.37),  # key 0.41
    ]
    sched = make(max_num_seqs=1, policy="sjf", aging_tokens_per_s=100.0)
    assert admission_order(sched, requests) == ["early-short", "long", "late-short"]


def _first_chunk_then(policy: str, later: list[Request], **config) -> list[tuple[str, int]]:
    """A 40-token prompt's first 16-token chunk runs alone; ``later`` arrive during it; the next step's chunks."""
    sched = make(policy=policy, max_num_batched_tokens=16, **config)
    runner = FakeRunner()
    sched.add_request(req("long", range(40), arrival_time=0.0))
    assert [(c.request_id, c.num_tokens) for c in step(sched, runner).chunks] == [("long", 16)]
    for r in later:
        sched.add_request(r)
    out = step(sched, runner)
    assert sched.num_preemptions == 0
    return [(c.request_id, c.num_tokens) for c in out.chunks]


@pytest.mark.parametrize("policy", ["sjf", "fcfs", "priority", "deadline"])
def test_a_part_prefilled_prompt_yields_to_a_waiting_one_only_under_sjf(policy):
    # sjf: the short prompt's key (0.01 + 4/1000) is below the long one's (0 + 40/1000): it takes the budget
    # first and the long prompt gets what is left. The other policies keep the part-prefilled prompt first
    # (priority and deadline have no aging to bound how long it could be passed over).
    chunks = _first_chunk_then(policy, [req("short", range(100, 104), arrival_time=0.01)])
    assert chunks == ([("short", 4), ("long", 12)] if policy == "sjf" else [("long", 16)])


def test_a_yielding_prompt_still_goes_before_waiting_prompts_that_sort_after_it():
    # "mid" (30 tokens at 0.02 s: key 0.05) sorts after the long prompt (0.04): it waits for the long one
    later = [req("short", range(100, 104), arrival_time=0.01), req("mid", range(200, 230), arrival_time=0.02)]
    assert _first_chunk_then("sjf", later) == [("short", 4), ("long", 12)]


def test_a_yielding_prompt_that_finds_no_blocks_waits_instead_of_preempting():
    # 10 blocks of 4 tokens, chunks of at most 16: the long prompt holds 4 blocks after its first chunk; the
    # 16-token prompt that sorts first takes 4 more; the long prompt's next chunk needs 4 and 2 are free. It
    # skips this step (keeping its 16 computed tokens) rather than preempting anyone, itself included.
    sched = make(policy="sjf", num_blocks=10, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    runner = FakeRunner()
    long = req("long", range(40), arrival_time=0.0)
    sched.add_request(long)
    assert [(c.request_id, c.num_tokens) for c in step(sched, runner).chunks] == [("long", 16)]
    sched.add_request(req("other", range(100, 116), arrival_time=0.001))
    assert [(c.request_id, c.num_tokens) for c in step(sched, runner).chunks] == [("other", 16)]
    assert sched.num_preemptions == 0 and long.status is RequestStatus.RUNNING
    assert long.num_computed_tokens == 16


def test_sjf_aging_rate_must_be_positive():
    with pytest.raises(ValueError, match="aging_tokens_per_s must be > 0"):
        SchedulerConfig(policy="sjf", aging_tokens_per_s=0)


def test_priority_arrival_preempts_lower_priority_running_request():
    sched = make(num_blocks=4, policy="priority")
    runner = FakeRunner()
    sched.add_request(req("low", range(12), max_tokens=8, priority=5))
    step(sched, runner)
    sched.add_request(req("high", range(100, 108), priority=0))
    out = step(sched, runner)
    assert [c.request_id for c in out.chunks] == ["high"] and out.preempted_ids == ["low"]
    assert sched.get_request("low").status is RequestStatus.PREEMPTED


def test_fcfs_arrival_does_not_preempt():
    sched = make(num_blocks=4)
    runner = FakeRunner()
    sched.add_request(req("first", range(12), max_tokens=2))
    step(sched, runner)
    sched.add_request(req("second", range(100, 108)))
    out = step(sched, runner)
    assert [c.request_id for c in out.chunks] == ["first"] and sched.num_preemptions == 0


@pytest.mark.parametrize("chunked", [True, False])
def test_no_starvation_of_a_long_prompt_under_a_stream_of_short_ones(chunked):
    # Two short requests arrive every step, more than the tiny pool can serve, so the queue keeps growing.
    config = dict(enable_chunked_prefill=chunked, long_prefill_token_threshold=32, max_num_seqs=16)
    sched = make(num_blocks=20, max_num_batched_tokens=32, **config)
    runner = FakeRunner()
    long = req("long", range(100, 130), max_tokens=2, arrival_time=6.5)
    t = 0
    for i in range(40):
        for _ in range(2):
            sched.add_request(req(f"s{t}", range(t, t + 6), max_tokens=6, arrival_time=float(t)))
            t += 1
        if i == 3:
            sched.add_request(long)
        step(sched, runner)
        if long.is_finished:
            break
    # Letting short ones overtake it whenever it does not fit takes ~80 steps here.
    assert long.is_finished and long.num_output_tokens == 2 and i < 30
    assert sched.num_waiting > 5  # still overloaded


def test_prefix_hit_skips_cached_tokens_and_counts_them():
    sched = make()
    runner = FakeRunner()
    shared = list(range(50, 62))  # 3 full blocks
    sched.add_request(req("a", shared + [1, 2], max_tokens=1))
    while sched.has_unfinished():
        step(sched, runner)
    b = req("b", shared + [3], max_tokens=1)
    sched.add_request(b)
    out = step(sched, runner)
    assert (out.chunks[0].start_pos, out.chunks[0].token_ids) == (12, [3])
    assert b.num_cached_tokens == 12 and sched.stats.num_cached_tokens == 12
    assert sched.stats.num_prefix_hit_blocks == 3


def test_different_salts_never_share():
    sched = make()
    runner = FakeRunner()
    prompt = list(range(13))
    for i, salt in enumerate(["t1", "t2", None]):
        sched.add_request(req(f"r{i}", prompt, max_tokens=1, cache_salt=salt))
        out = step(sched, runner)
        assert out.chunks[0].start_pos == 0
    sched.add_request(req("again", prompt, max_tokens=1, cache_salt="t2"))
    assert step(sched, runner).chunks[0].start_pos == 12


def workload() -> list[Request]:
    """Mixed lengths, a shared system prompt, and a duplicate prompt: exercises hits and duplicates."""
    system = list(range(500, 510))
    prompts = [
        system + [1, 2, 3],
        list(range(20)),
        system + [4],
        [7] * 9,
        list(range(20)),
        list(range(30, 33)),
    ]
    return [req(f"r{i}", p, max_tokens=6 + i) for i, p in enumerate(prompts)]


def test_preemption_in_a_tiny_pool_gives_the_same_outputs_as_an_unconstrained_run():
    expected = run_all(make(num_blocks=256, max_num_batched_tokens=256), workload())
    for policy in ("fcfs", "priority", "deadline", "sjf"):
        sched = make(num_blocks=9, max_num_batched_tokens=16, long_prefill_token_threshold=8, policy=policy)
        assert run_all(sched, workload()) == expected
        assert sched.num_preemptions > 0
        assert sched.kv.pool.num_free_blocks + sched.kv.num_evictable_blocks == sched.kv.num_online_blocks


def test_request_larger_than_the_pool_finishes_with_an_error():
    sched = make(num_blocks=4)
    big = req("big", range(20))
    sched.add_request(big)
    sched.add_request(req("ok", range(5), max_tokens=1))
    out = sched.schedule()
    assert big.status is RequestStatus.FINISHED_ERROR and "needs 5 KV blocks" in big.error
    assert [c.request_id for c in out.chunks] == ["ok"] and out.finished_ids == ["big"]


def test_decode_growth_beyond_the_pool_finishes_with_an_error():
    sched = make(num_blocks=2)
    r = req("grow", range(6), max_tokens=50)
    run_all(sched, [r])
    assert r.status is RequestStatus.FINISHED_ERROR and r.num_tokens == 9


def test_max_model_len_finishes_with_length():
    sched = make(max_model_len=20)
    r = req("a", range(16), max_tokens=100)
    run_all(sched, [r])
    assert r.finish_reason == "length" and r.num_tokens == 20


def test_abort_frees_everything_and_is_reported():
    sched = make(num_blocks=16, max_num_seqs=2)
    runner = FakeRunner()
    for i in range(4):
        sched.add_request(req(f"r{i}", range(i * 10, i * 10 + 9), max_tokens=20))
    step(sched, runner)
    assert sched.num_running == 2 and sched.num_waiting == 2
    assert sched.abort("r0") and sched.abort("r3") and not sched.abort("r3")
    assert sched.finish_request("r1", "stop")
    assert sched.abort("r2")
    assert not sched.has_unfinished()
    assert sorted(sched.schedule().finished_ids) == ["r0", "r1", "r2", "r3"]
    kv = sched.kv
    assert kv.pool.num_free_blocks + kv.num_evictable_blocks == kv.num_online_blocks
    assert kv.pool.num_used_blocks == 0


def test_update_skips_chunks_of_requests_finished_after_schedule():
    sched = make()
    runner = FakeRunner()
    sched.add_request(req("a", range(5)))
    out = sched.schedule()
    sched.abort("a")
    assert sched.update(out, runner.run(out)) == []
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(out, {})


def test_release_kv_shards_preempts_holders_and_outputs_are_unchanged():
    expected = run_all(make(num_blocks=256, max_num_batched_tokens=256), workload())
    sched = make(num_blocks=32, num_shards=4, max_num_batched_tokens=16)
    requests = workload()
    runner = FakeRunner()
    for r in requests:
        sched.add_request(r)
    for _ in range(6):
        step(sched, runner)
    victims = sched.release_kv_shards(2)
    assert victims and all(sched.get_request(v).status is RequestStatus.PREEMPTED for v in victims)
    assert sched.kv.num_online_blocks == 16
    sched.kv.check_integrity()
    for i in range(2000):
        if not sched.has_unfinished():
            break
        if i == 10:
            sched.grow_kv_shards(2)
        step(sched, runner)
    assert {r.request_id: r.output_token_ids for r in requests} == expected
