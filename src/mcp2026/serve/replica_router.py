"""Which engine replica serves a prompt: the one that already holds the longest run of its KV blocks
(prefix-aware), unless that replica is saturated; otherwise the least-loaded one. Pure Python, no torch.

Each replica's prefix cache is keyed by chained hashes of full KV blocks (salted per tenant), so the router
keeps an approximate map of the same chains -> the replica it sent them to (bounded, LRU). A multi-turn
conversation repeats its earlier turns as its prefix, so every turn finds the replica that cached them.
A prompt that shares only a small part of its blocks with anything routed before (a common system prompt,
say) is treated as new and balanced, as SGLang's cache-aware router does, so one hot prefix does not pin the
whole traffic on one replica.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16  # tokens per KV block: the engine's, so the router's chains are the cache's
    min_match_ratio: float = 0.5  # share of a prompt's full blocks a replica must hold to win it
    # A replica with more than this many requests waiting, or KV use above max_kv_usage, is saturated:
    # its cached prefix is worth less than the queue in front of it.
    max_waiting: int = 8
    max_kv_usage: float = 0.95
    max_entries: int = 200_000  # block chains remembered (about 100 bytes each)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"RouterConfig.block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.min_match_ratio <= 1.0:
            raise ValueError(f"RouterConfig.min_match_ratio must be in (0, 1], got {self.min_match_ratio}")
        if self.max_waiting < 0:
            raise ValueError(f"RouterConfig.max_waiting must be >= 0, got {self.max_waiting}")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"RouterConfig.max_kv_usage must be in (0, 1], got {self.max_kv_usage}")
        if self.max_entries < 1:
            raise ValueError(f"RouterConfig.max_entries must be >= 1, got {self.max_entries}")


class ReplicaLoad(NamedTuple):
    """What a replica reports (its /metrics gauges): requests waiting and running, KV blocks in use."""

    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0


class Route(NamedTuple):
    replica_id: str
    reason: (
        str  # "prefix": holds the prompt's blocks; "balance": new prefix; "saturated": its holder was full
    )
    num_matched_blocks: int


class PrefixRouter:
    """``route(token_ids, loads)`` picks a replica and remembers the prompt's block chain there.
    Not thread-safe: one router per event loop (the Ray ingress runs one)."""

    def __init__(self, replica_ids: Sequence[str], config: RouterConfig | None = None) -> None:
        if not replica_ids:
            raise ValueError("PrefixRouter needs at least one replica")
        if len(set(replica_ids)) != len(replica_ids):
            raise ValueError(f"replica ids must be distinct, got {list(replica_ids)}")
        self.replica_ids = tuple(replica_ids)
        self.config = config or RouterConfig()
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block-chain hash -> replica, LRU order
        self._next = 0  # round-robin among equally loaded replicas

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str = "") -> list[bytes]:
        """Chained hashes of the prompt's full blocks: hash i covers tokens [0, (i+1) * block_size)."""
        size = self.config.block_size
        h = hashlib.blake2b(cache_salt.encode(), digest_size=16).digest()
        hashes = []
        for start in range(0, len(token_ids) - size + 1, size):
            block = ",".join(map(str, token_ids[start : start + size])).encode()
            h = hashlib.blake2b(h + block, digest_size=16).digest()
            hashes.append(h)
        return hashes

    def route(
        self, token_ids: Sequence[int], loads: Mapping[str, ReplicaLoad], cache_salt: str = ""
    ) -> Route:
        """The replica for this prompt. ``loads``: each replica's current load (missing ones count as idle)."""
        unknown = set(loads) - set(self.replica_ids)
        if unknown:
            raise ValueError(
                f"loads for unknown replicas {sorted(unknown)}; replicas: {list(self.replica_ids)}"
            )
        hashes = self.block_hashes(token_ids, cache_salt)
        holder, num_matched = self._longest_match(hashes)
        is_match = holder is not None and num_matched >= self.config.min_match_ratio * len(hashes)
        if is_match and not self._is_saturated(loads.get(holder, ReplicaLoad())):
            route = Route(holder, "prefix", num_matched)
        else:
            reason = "saturated" if is_match else "balance"
            route = Route(self._least_loaded(loads), reason, num_matched if is_match else 0)
        self._remember(hashes, route.replica_id)
        return route

    def forget(self, replica_id: str) -> None:
        """A replica restarted or left: nothing it cached survives."""
        for key in [k for k, owner in self._owner.items() if owner == replica_id]:
            del self._owner[key]

    def _longest_match(self, hashes: list[bytes]) -> tuple[str | None, int]:
        # Chained hashes: block i's hash implies blocks 0..i, so the deepest known one is the longest match.
        for i in range(len(hashes) - 1, -1, -1):
            owner = self._owner.get(hashes[i])
            if owner is not None:
                return owner, i + 1
        return None, 0

    def _is_saturated(self, load: ReplicaLoad) -> bool:
        return load.num_waiting > self.config.max_waiting or load.kv_usage > self.config.max_kv_usage

    def _least_loaded(self, loads: Mapping[str, ReplicaLoad]) -> str:
        def key(i: int) -> tuple[int, float, int]:
            load = loads.get(self.replica_ids[i], ReplicaLoad())
            # Ties go round-robin from the last pick, so an idle fleet still spreads new prefixes.
            return (
                load.num_waiting + load.num_running,
                load.kv_usage,
                (i - self._next) % len(self.replica_ids),
            )

        best = min(range(len(self.replica_ids)), key=key)
        self._next = best + 1
        return self.replica_ids[best]

    def _remember(self, hashes: list[bytes], replica_id: str) -> None:
        for h in hashes:
            self._owner[h] = replica_id
            self._owner.move_to_end(h)
        while len(self._owner) > self.config.max_entries:
            self._owner.popitem(last=False)
