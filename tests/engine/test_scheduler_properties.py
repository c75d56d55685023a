"""Property test: random add / step / abort / finish / shard sequences keep every invariant and leak nothing."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcp2026.config import SchedulerConfig
from mcp2026.engine.output import SchedulerOutput
from mcp2026.engine.request import Request, RequestStatus
from mcp2026.engine.scheduler import Scheduler
from mcp2026.kv.manager import KVCacheManager
from mcp2026.types import SamplingParams

BS = 4
NUM_SHARDS = 2
PREFIXES = [[], list(range(900, 908)), list(range(800, 811))]  # shared system prompts: prefix hits


def fake_run(output: SchedulerOutput, slots: dict[tuple[int, int], int]) -> dict[str, int]:
    """Paged-KV stand-in: store tokens by (block, slot), sample a function of the sequence read back."""
    sampled = {}
    for c in output.chunks:
        for i, token in enumerate(c.token_ids):
            pos = c.start_pos + i
            slots[(c.block_table[pos // BS], pos % BS)] = token
        if c.samples:
            end = c.start_pos + len(c.token_ids)
            seq = tuple(slots[(c.block_table[p // BS], p % BS)] for p in range(end))
            sampled[c.request_id] = next_token(seq)
    return sampled


def next_token(seq: tuple[int, ...]) -> int:
    return hash(seq) % 50


def expected_outputs(prompt: list[int], num_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(next_token(tuple(seq)))
    return seq[len(prompt) :]


configs = st.fixed_dictionaries(
    {
        "max_num_batched_tokens": st.integers(16, 48),
        "max_num_seqs": st.integers(1, 6),
        "policy": st.sampled_from(["fcfs", "priority", "deadline", "sjf"]),
        "enable_chunked_prefill": st.booleans(),
        "long_prefill_token_threshold": st.integers(1, 32),
    }
)
add_op = st.tuples(
    st.just("add"),
    st.integers(0, len(PREFIXES) - 1),  # shared prefix
    st.integers(1, 14),  # own tokens
    st.sampled_from([None, "tenant-a"]),
    st.integers(0, 2),  # priority, also picks a deadline
    st.integers(1, 8),  # max_tokens
)
ops = st.lists(
    st.one_of(
        add_op,
        add_op,  # listed twice: busy pools preempt and share more
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("release"), st.integers(0, 1)),
        st.tuples(st.just("grow"), st.integers(0, 1)),
    ),
    min_size=4,
    max_size=40,
)


class Harness:
    def __init__(self, config: dict, num_blocks: int) -> None:
        self.sched = Scheduler(SchedulerConfig(**config), KVCacheManager(BS, num_blocks, NUM_SHARDS), 48)
        self.slots: dict[tuple[int, int], int] = {}
        self.requests: list[Request] = []

    def add(self, prefix: int, num_own: int, salt: str | None, priority: int, max_tokens: int) -> None:
        i = len(self.requests)
        prompt = PREFIXES[prefix] + [(i * 7 + j) % 30 for j in range(num_own)]
        if not self.sched.config.enable_chunked_prefill:
            prompt = prompt[: self.sched.config.max_num_batched_tokens]
        deadline = None if priority == 2 else float(10 * priority + i)
        r = Request(
            f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), priority, float(i), deadline, salt
        )
        self.requests.append(r)
        self.sched.add_request(r)

    def step(self) -> None:
        sched = self.sched
        out = sched.schedule()
        assert out.num_batched_tokens == sum(len(c.token_ids) for c in out.chunks)
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(out.chunks) <= sched.config.max_num_seqs
        for c in out.chunks:
            r = sched.get_request(c.request_id)
            assert c.start_pos == r.num_computed_tokens and c.samples == (
                c.start_pos + len(c.token_ids) == r.num_tokens
            )
            assert c.token_ids == r.all_token_ids[c.start_pos : c.start_pos + len(c.token_ids)]
        for r in sched.update(out, fake_run(out, self.slots)):
            if not r.is_finished and r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish_request(r.request_id, "length")

    def check(self) -> None:
        sched, kv = self.sched, self.sched.kv
        kv.check_integrity()
        assert sched.num_running <= sched.config.max_num_seqs
        for r in self.requests:
            table = kv.block_table(r.request_id)
            if r.status is RequestStatus.RUNNING:
                assert len(table) * BS >= r.num_computed_tokens
            else:
                assert table == [], f"{r.request_id} ({r.status}) holds blocks"
            assert r.num_output_tokens <= r.sampling_params.max_tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, num_blocks=st.integers(4, 16), operations=ops)
def test_random_operations_keep_invariants_and_return_every_block(config, num_blocks, operations):
    h = Harness(config, num_blocks)
    sched = h.sched
    for op in operations:
        kind = op[0]
        if kind == "add":
            h.add(*op[1:])
        elif kind == "step":
            for _ in range(op[1]):
                h.step()
                h.check()
        elif kind in ("abort", "finish") and h.requests:
            rid = h.requests[op[1] % len(h.requests)].request_id
            if kind == "abort":
                sched.abort(rid)
            else:
                sched.finish_request(rid, "stop")
        elif kind == "release" and sched.kv.pool.num_online_shards > op[1]:
            sched.release_kv_shards(op[1])
        elif kind == "grow":
            sched.grow_kv_shards(min(op[1], NUM_SHARDS - sched.kv.pool.num_online_shards))
        h.check()

    # Liveness: with no new arrivals everything finishes (tokens, length, or a too-large error).
    for _ in range(400):
        if not sched.has_unfinished():
            break
        h.step()
        h.check()
    assert not sched.has_unfinished(), "deadlock: requests left unfinished"
    for r in h.requests:
        assert r.is_finished
        # Whatever was preempted, shared or evicted on the way, each token read back the right KV.
        assert r.output_token_ids == expected_outputs(r.prompt_token_ids, r.num_output_tokens)
        if r.status is RequestStatus.FINISHED_ERROR:
            assert "KV blocks" in r.error

    sched.grow_kv_shards(NUM_SHARDS - sched.kv.pool.num_online_shards)
    kv = sched.kv
    assert kv.pool.num_used_blocks == 0
    assert kv.pool.num_free_blocks + kv.num_evictable_blocks == kv.pool.num_blocks
    kv.check_integrity()
