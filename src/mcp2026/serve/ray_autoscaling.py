"""How many replicas an engine deployment wants on Ray Serve, from the engines' own load signals: requests
waiting for their first token and KV-cache use, which each replica reports through
``EngineReplica.record_autoscaling_stats``. The same rule as the Kubernetes HPA (deploy/k8s/base/hpa.yaml):
scale up at once to meet the targets, scale down one replica at a time after a calm period, since a new
replica costs a model load. No Ray import: Ray instantiates the class from ``autoscaling_config.policy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineLoadPolicy:
    target_waiting: float = 4.0  # average requests waiting per replica
    target_kv_usage: float = 0.8  # average share of KV blocks in use per replica
    downscale_delay_s: float = 300.0  # no scale-down until this long after the last change

    def __post_init__(self) -> None:
        if not self.target_waiting > 0:
            raise ValueError(f"EngineLoadPolicy.target_waiting must be > 0, got {self.target_waiting}")
        if not 0 < self.target_kv_usage <= 1:
            raise ValueError(
                f"EngineLoadPolicy.target_kv_usage must be in (0, 1], got {self.target_kv_usage}"
            )
        if self.downscale_delay_s < 0:
            raise ValueError(f"EngineLoadPolicy.downscale_delay_s must be >= 0, got {self.downscale_delay_s}")

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """``ctx``: Ray Serve's AutoscalingContext. Returns (replicas wanted, policy state)."""
        metrics = ctx.aggregated_metrics or {}
        waiting = metrics.get("num_waiting") or {}
        kv_usage = metrics.get("kv_usage") or {}
        current = ctx.target_num_replicas
        if not waiting and not kv_usage:  # no reports yet (replicas starting): hold
            return current, ctx.policy_state
        num_reporting = max(len(waiting), len(kv_usage), 1)
        pressure = max(
            sum(waiting.values()) / num_reporting / self.target_waiting,
            sum(kv_usage.values()) / num_reporting / self.target_kv_usage,
        )
        wanted = math.ceil(num_reporting * pressure) if pressure > 0 else ctx.capacity_adjusted_min_replicas
        if wanted < current:
            last_change = max(ctx.last_scale_up_time or 0.0, ctx.last_scale_down_time or 0.0)
            is_calm = ctx.current_time is None or ctx.current_time - last_change >= self.downscale_delay_s
            wanted = current - 1 if is_calm else current
        wanted = min(max(wanted, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        return wanted, ctx.policy_state
