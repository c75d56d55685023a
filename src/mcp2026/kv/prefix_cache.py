"""Prefix cache: full KV blocks found again by a chained hash of their token ids, evicted LRU-2.

A block's key is ``H(parent key, token ids, extra keys)`` where the extra keys carry the tenant's cache salt
and the quantization plan id, so tenants and plans never share. Keys only index; a hit is verified exactly.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

ExtraKeys = tuple[str | None, ...]
HashFn = Callable[[bytes | None, Sequence[int], ExtraKeys], bytes]
NEVER = float("-inf")  # access time of an access that has not happened


def hash_block(parent_key: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys) -> bytes:
    """Stable 128-bit key (blake2b over a length-prefixed encoding; Python's hash() is salted per process)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\x00" if parent_key is None else b"\x01" + parent_key)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        if key is None:
            h.update(b"\x00")
        else:
            data = key.encode()
            h.update(b"\x01" + struct.pack("<I", len(data)) + data)
    return h.digest()


@dataclass(eq=False)
class CacheEntry:
    """One cached block. ``uid`` is never reused, so a child naming its parent's uid proves the whole prefix
    (a parent evicted and its block id recycled gets a new uid)."""

    uid: int
    key: bytes
    block_id: int
    parent_uid: int | None
    token_ids: tuple[int, ...]
    extra_keys: ExtraKeys
    depth: int  # index of the block in its sequence: deeper blocks are evicted first on ties
    last_access: float = NEVER
    second_access: float = NEVER

    def matches(self, parent: CacheEntry | None, token_ids: Sequence[int], extra_keys: ExtraKeys) -> bool:
        parent_uid = None if parent is None else parent.uid
        return (
            self.parent_uid == parent_uid
            and self.token_ids == tuple(token_ids)
            and self.extra_keys == extra_keys
        )


class PrefixCache:
    """Key -> cached block, plus the set of cached blocks no request holds ("evictable").

    Invariants: each key and each block id maps to at most one entry; an evictable block is cached.
    The cache never touches the block pool: the KV manager moves blocks between the two.
    Access times come from a logical clock so eviction order is deterministic.
    """

    def __init__(self, hash_fn: HashFn = hash_block) -> None:
        self.hash_fn = hash_fn
        self._by_key: dict[bytes, CacheEntry] = {}
        self._by_block: dict[int, CacheEntry] = {}
        self._stamps: dict[int, int] = {}  # evictable block id -> stamp of its live heap item
        self._heap: list[tuple[float, float, int, int, int]] = []  # (second, last, -depth, block, stamp)
        self._clock = 0
        self._next_uid = 0
        self._next_stamp = 0
        self.num_queries = 0  # blocks looked up at admissions
        self.num_hits = 0  # of those, blocks found

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_block)

    @property
    def num_evictable(self) -> int:
        return len(self._stamps)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def key(self, parent_key: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys) -> bytes:
        return self.hash_fn(parent_key, token_ids, extra_keys)

    def cached_block_ids(self) -> list[int]:
        return list(self._by_block)

    def evictable_block_ids(self) -> list[int]:
        return list(self._stamps)

    def entry_of(self, block_id: int) -> CacheEntry | None:
        return self._by_block.get(block_id)

    def is_live(self, entry: CacheEntry) -> bool:
        return self._by_key.get(entry.key) is entry

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._stamps

    def lookup(
        self, key: bytes, parent: CacheEntry | None, token_ids: Sequence[int], extra_keys: ExtraKeys
    ) -> CacheEntry | None:
        """The entry for this block if its whole prefix matches exactly; a colliding key is a miss."""
        entry = self._by_key.get(key)
        return entry if entry is not None and entry.matches(parent, token_ids, extra_keys) else None

    def insert(
        self,
        key: bytes,
        block_id: int,
        parent: CacheEntry | None,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys,
    ) -> CacheEntry | None:
        """Register a freshly computed full block. If the same content is already cached (another request
        computed it at the same time) the existing entry is returned and ``block_id`` stays uncached; on a
        key collision with different content, returns None and caches nothing."""
        existing = self._by_key.get(key)
        if existing is not None:
            return existing if existing.matches(parent, token_ids, extra_keys) else None
        if block_id in self._by_block:
            raise AssertionError(f"block {block_id} is already cached under another key")
        depth = 0 if parent is None else parent.depth + 1
        parent_uid = None if parent is None else parent.uid
        entry = CacheEntry(self._next_uid, key, block_id, parent_uid, tuple(token_ids), extra_keys, depth)
        self._next_uid += 1
        self._by_key[key] = entry
        self._by_block[block_id] = entry
        self.touch([block_id])
        return entry

    def touch(self, block_ids: Iterable[int]) -> None:
        """One access (one clock tick) for each listed cached block."""
        self._clock += 1
        for b in block_ids:
            entry = self._by_block[b]
            entry.second_access, entry.last_access = entry.last_access, self._clock
            if b in self._stamps:
                self._push(entry)

    def record(self, num_queries: int, num_hits: int) -> None:
        self.num_queries += num_queries
        self.num_hits += num_hits

    def set_evictable(self, block_id: int) -> None:
        """No request holds this cached block any more."""
        self._push(self._by_block[block_id])

    def set_in_use(self, block_id: int) -> None:
        """A request took this cached block (a prefix hit); stale heap items are skipped lazily."""
        self._stamps.pop(block_id, None)

    def pop_evictable(self) -> int | None:
        """Evict by LRU-2: oldest second-most-recent access (blocks seen once go first), then oldest last
        access, then the deepest block. Returns its id, now uncached, or None when nothing is evictable."""
        while self._heap:
            *_, block_id, stamp = heapq.heappop(self._heap)
            if self._stamps.get(block_id) == stamp:
                self.remove(block_id)
                return block_id
        return None

    def remove(self, block_id: int) -> None:
        """Forget a cached block (evicted, offline, or its owner's KV is about to be rewritten)."""
        entry = self._by_block.pop(block_id)
        del self._by_key[entry.key]
        self._stamps.pop(block_id, None)

    def _push(self, entry: CacheEntry) -> None:
        stamp = self._next_stamp
        self._next_stamp += 1
        self._stamps[entry.block_id] = stamp
        heapq.heappush(
            self._heap, (entry.second_access, entry.last_access, -entry.depth, entry.block_id, stamp)
        )
        if len(self._heap) > 4 * len(self._stamps) + 1024:  # drop stale items left by set_in_use/touch
            self._heap = [item for item in self._heap if self._stamps.get(item[3]) == item[4]]
            heapq.heapify(self._heap)

    def check_integrity(self) -> None:
        assert len(self._by_key) == len(self._by_block), "key and block indexes differ in size"
        for key, entry in self._by_key.items():
            assert entry.key == key and self._by_block.get(entry.block_id) is entry, (
                f"cache entry for block {entry.block_id} is indexed inconsistently"
            )
        stray = [b for b in self._stamps if b not in self._by_block]
        assert not stray, f"evictable blocks {stray[:8]} are not cached"
