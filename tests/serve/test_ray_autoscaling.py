"""The engine-load autoscaling policy Ray Serve calls with its AutoscalingContext (here a stand-in with the
same fields): up at once to meet the targets, down one replica at a time after the calm period."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mcp2026.serve.ray_autoscaling import EngineLoadPolicy


def context(waiting, kv_usage, target=2, now=1000.0, last_change=0.0, low=1, high=8):
    return SimpleNamespace(
        aggregated_metrics={
            "num_waiting": {f"r{i}": w for i, w in enumerate(waiting)},
            "kv_usage": {f"r{i}": k for i, k in enumerate(kv_usage)},
        },
        target_num_replicas=target,
        capacity_adjusted_min_replicas=low,
        capacity_adjusted_max_replicas=high,
        last_scale_up_time=last_change,
        last_scale_down_time=None,
        current_time=now,
        policy_state={"kept": True},
    )


def test_scales_up_at_once_on_either_signal():
    policy = EngineLoadPolicy(target_waiting=4, target_kv_usage=0.8)
    assert policy(context([12, 12], [0.1, 0.1])) == (6, {"kept": True})  # 24 waiting / 4 per replica
    assert policy(context([0, 0], [0.96, 0.96]))[0] == 3  # KV use 1.2x its target
    assert policy(context([40, 40], [0.5, 0.5], high=5))[0] == 5  # never above the cluster's capacity


def test_scales_down_one_replica_after_the_calm_period_only():
    policy = EngineLoadPolicy(downscale_delay_s=300)
    idle = ([0, 0, 0, 0], [0.0] * 4)
    assert policy(context(*idle, target=4, now=1000.0, last_change=900.0))[0] == 4  # changed 100 s ago
    assert policy(context(*idle, target=4, now=1000.0, last_change=600.0))[0] == 3
    assert policy(context([2, 2], [0.5, 0.5], target=2, now=10**6))[0] == 2  # at its targets: stays


def test_holds_before_any_report_and_refuses_bad_targets():
    ctx = context([], [], target=3)
    ctx.aggregated_metrics = None
    assert EngineLoadPolicy()(ctx)[0] == 3
    with pytest.raises(ValueError, match="target_waiting"):
        EngineLoadPolicy(target_waiting=0)
    with pytest.raises(ValueError, match="target_kv_usage"):
        EngineLoadPolicy(target_kv_usage=1.5)
