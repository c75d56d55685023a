"""DTSS (dynamic tensor slicing scheduler): under host/GPU memory pressure the
engine takes whole KV shards offline (preempting the requests whose blocks live there and returning the
shard's memory to the OS), and brings them back when the pressure passes. Hysteresis avoids flapping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mcp2026.config import KVConfig


@dataclass
class DTSSController:
    """Decides, every ``interval`` steps, whether to release (-1) or re-grow (+1) one shard, or hold (0)."""

    low_free_bytes: int
    high_free_bytes: int
    available_bytes: Callable[[], int]
    interval: int = 8
    num_releases: int = 0
    num_grows: int = 0
    _steps: int = 0

    @classmethod
    def from_config(
        cls, kv: KVConfig, total_bytes: int, available_bytes: Callable[[], int]
    ) -> DTSSController:
        return cls(
            int(kv.dtss_low_free_fraction * total_bytes),
            int(kv.dtss_high_free_fraction * total_bytes),
            available_bytes,
            kv.dtss_check_interval_steps,
        )

    def decide(self, num_online: int, num_shards: int) -> int:
        self._steps += 1
        if self._steps % self.interval:
            return 0
        free = self.available_bytes()
        if free < self.low_free_bytes and num_online > 1:
            self.num_releases += 1
            return -1
        if free > self.high_free_bytes and num_online < num_shards:
            self.num_grows += 1
            return 1
        return 0
