"""Weighted fair scheduling across tenants (FairShare inside the Scheduler), with the fake paged runner."""

from __future__ import annotations

import itertools

import pytest
from test_scheduler import FakeRunner, make, req, step

from mcp2026.engine.fair_share import FairShare
from mcp2026.engine.request import Request
from mcp2026.engine.scheduler import Scheduler


def saturate(sched: Scheduler, weights: dict[str, float], prompt_len: int, max_tokens: int, num_steps: int):
    """Keep every tenant's queue full for ``num_steps``; returns tokens processed per tenant over the last
    three quarters of the run (after the start-up transient)."""
    for tenant, weight in weights.items():
        sched.fair_share.set_weight(tenant, weight)
    ids = itertools.count()
    runner = FakeRunner()
    start: dict = {}
    for i in range(num_steps):
        for tenant in weights:  # top up: each tenant always has more waiting work than the engine can take
            while sum(r.tenant == tenant for r in sched._waiting) < 2 * sched.config.max_num_seqs:
                n = next(ids)
                sched.add_request(req(f"{tenant}-{n}", range(n, n + prompt_len), max_tokens, tenant=tenant))
        step(sched, runner)
        if i == num_steps // 4:
            start = dict(sched.fair_share.num_processed)
    return {t: sched.fair_share.num_processed.get(t, 0) - start.get(t, 0) for t in weights}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_decode_bound_shares_follow_weights(policy):
    # Slots (max_num_seqs) are the bottleneck: fairness comes from who is admitted when a slot frees.
    sched = make(num_blocks=512, max_num_batched_tokens=64, max_num_seqs=8, policy=policy)
    tokens = saturate(sched, {"a": 3.0, "b": 1.0}, prompt_len=8, max_tokens=24, num_steps=600)
    assert tokens["a"] / tokens["b"] == pytest.approx(3.0, rel=0.1), tokens


def test_budget_bound_shares_follow_weights():
    # The token budget is the bottleneck: long chunked prompts, one output token each.
    sched = make(num_blocks=512, max_num_batched_tokens=32, max_num_seqs=64, long_prefill_token_threshold=16)
    tokens = saturate(sched, {"a": 3.0, "b": 1.0}, prompt_len=48, max_tokens=1, num_steps=400)
    assert tokens["a"] / tokens["b"] == pytest.approx(3.0, rel=0.1), tokens


def test_three_tenants_and_equal_weights():
    sched = make(num_blocks=512, max_num_batched_tokens=64, max_num_seqs=6)
    tokens = saturate(sched, {"x": 1.0, "y": 1.0, "z": 2.0}, prompt_len=4, max_tokens=12, num_steps=600)
    assert tokens["x"] / tokens["y"] == pytest.approx(1.0, rel=0.1), tokens
    assert tokens["z"] / tokens["x"] == pytest.approx(2.0, rel=0.1), tokens


def test_idle_tenant_banks_no_credit():
    # "a" runs alone for a while; when "b" arrives it must not monopolise the engine to "catch up".
    sched = make(num_blocks=512, max_num_batched_tokens=64, max_num_seqs=4)
    runner = FakeRunner()
    for i in range(200):
        sched.add_request(req(f"a{i}", range(i, i + 4), 8, tenant="a"))
    for _ in range(60):
        step(sched, runner)
    for i in range(40):
        sched.add_request(req(f"b{i}", range(100 + i, 104 + i), 8, tenant="b"))
    before = dict(sched.fair_share.num_processed)
    for _ in range(60):
        step(sched, runner)
    a = sched.fair_share.num_processed["a"] - before["a"]
    b = sched.fair_share.num_processed["b"]
    assert a / b == pytest.approx(1.0, rel=0.25), (a, b)


def test_one_tenant_keeps_the_policy_order():
    fair = FairShare()
    requests = [Request(f"r{i}", [1], priority=p, arrival_time=float(i)) for i, p in enumerate([2, 0, 1])]

    def key(r):
        return (r.priority, r.arrival_time)

    assert fair.order(requests, key, lambda r: 1) == sorted(requests, key=key)


def test_order_interleaves_by_weight_and_keeps_order_inside_a_tenant():
    fair = FairShare()
    fair.set_weight("a", 3.0)
    requests = [Request(f"{t}{i}", [1], tenant=t, arrival_time=float(i)) for t in "ab" for i in range(4)]
    ordered = [r.request_id for r in fair.order(requests, lambda r: (r.arrival_time,), lambda r: 3)]
    assert ordered == ["a0", "b0", "a1", "a2", "b1", "a3", "b2", "b3"]  # ties: the policy key
    with pytest.raises(ValueError, match="weight"):
        fair.set_weight("c", 0.0)


def test_preemption_takes_from_the_tenant_furthest_ahead():
    # A pool so small that "a"'s decodes force preemptions: victims must come from the tenant over its share.
    sched = make(num_blocks=6, max_num_batched_tokens=64, max_num_seqs=8)
    runner = FakeRunner()
    sched.add_request(req("a0", range(8), 12, tenant="a"))
    sched.add_request(req("a1", range(10, 18), 12, tenant="a"))
    step(sched, runner)
    sched.fair_share.charge({"a": 1000})  # "a" has had far more than its share
    sched.add_request(req("b0", range(20, 28), 12, tenant="b"))
    preempted = []
    for _ in range(40):
        preempted += step(sched, runner).preempted_ids
        if not sched.has_unfinished():
            break
    assert preempted and all(rid.startswith("a") for rid in preempted)
