"""KV cache manager: per-request block tables over the block pool, with prefix caching.

The scheduler's only view of KV memory. Pure Python: block ids and counts, never tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from mcp2026.kv.block_pool import BlockPool
from mcp2026.kv.prefix_cache import CacheEntry, ExtraKeys, HashFn, PrefixCache, hash_block


class KVRequest(Protocol):
    """What the manager reads from a request (``engine.request.Request`` satisfies it)."""

    request_id: str
    num_computed_tokens: int
    cache_salt: str | None
    plan_id: str | None

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> list[int]: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every block reference: a request's block table holds one reference per block.

    A request's table covers at least its computed tokens; block ``i`` holds token positions
    ``[i*block_size, (i+1)*block_size)``. Full computed blocks are registered in the prefix cache; when their
    last holder frees them they stay cached ("evictable") until an allocation needs the space.
    Failed allocations change nothing. After KV eviction (``drop_slots``) a table is a list of *slots*: it
    covers the computed tokens minus ``num_dropped_tokens``, and which positions a slot holds is the
    evictor's bookkeeping (it differs per layer and head).
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        num_shards: int = 1,
        enable_prefix_caching: bool = True,
        *,
        hash_fn: HashFn = hash_block,
        max_parked_blocks: int | None = None,
    ) -> None:
        """``max_parked_blocks``: cached blocks no request holds kept at most (None: until the pool runs out);
        past it the least recently used are evicted to the free list (``KVConfig.prefix_cache_gb`` says why)."""
        if block_size < 1:
            raise ValueError(f"KVCacheManager.block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_parked_blocks = max_parked_blocks
        self.pool = BlockPool(num_blocks, num_shards)
        self.cache = PrefixCache(hash_fn)
        self._tables: dict[str, list[int]] = {}
        self._chains: dict[str, list[CacheEntry]] = {}  # verified cache entries for a table's first blocks
        self._keys: dict[str, list[bytes]] = {}  # memo of each request's chained block keys
        self._uncacheable: set[str] = set()
        # Hit a key collision, or evicted blocks (later KV differs from a fresh prefill): stop registering.
        self._broken: set[str] = set()
        self._dropped: dict[str, int] = {}  # blocks of KV a request evicted (kv.eviction)

    # --- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now: free ones plus evictable cached ones."""
        return self.pool.num_free_blocks + self.cache.num_evictable

    @property
    def num_evictable_blocks(self) -> int:
        return self.cache.num_evictable

    @property
    def num_online_blocks(self) -> int:
        return self.pool.num_online_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def num_dropped_tokens(self, request_id: str) -> int:
        """Tokens of KV the request evicted: its table covers ``num_computed_tokens`` minus these."""
        return self._dropped.get(request_id, 0) * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens fits the online pool with nothing else in it."""
        return self.num_blocks_for(num_tokens) <= self.pool.num_online_blocks

    def request_ids_holding(self, block_ids: Iterable[int]) -> list[str]:
        wanted = set(block_ids)
        return [rid for rid, table in self._tables.items() if wanted.intersection(table)]

    # --- prefix hits ---------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: KVRequest) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks: (block ids, tokens they cover). Read-only; pass the ids to
        ``allocate_slots`` to take them. The last token is never covered, so its logits get computed."""
        if not self._is_cacheable(request.request_id) or request.request_id in self._tables:
            return [], 0
        num_lookup = (request.num_tokens - 1) // self.block_size
        keys = self._block_keys(request, num_lookup)
        tokens = request.all_token_ids
        extra = _extra_keys(request)
        block_ids: list[int] = []
        parent: CacheEntry | None = None
        for i in range(num_lookup):
            entry = self.cache.lookup(
                keys[i], parent, tokens[i * self.block_size : (i + 1) * self.block_size], extra
            )
            if entry is None:
                break
            block_ids.append(entry.block_id)
            parent = entry
        return block_ids, len(block_ids) * self.block_size

    # --- allocation ----------------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        computed_block_ids: Sequence[int] = (),
        *,
        evict_cached: bool = True,
    ) -> bool:
        """Grow the request's table to cover ``num_computed_tokens`` minus ``num_dropped_tokens`` (plus the
        tokens of ``computed_block_ids``, prefix hits from ``get_computed_blocks`` for a request without blocks)
        plus ``num_new_tokens``, evicting cached blocks if needed (not with ``evict_cached=False``: a lookahead draft
        must not cost cached prefixes). False, with nothing changed, if it cannot."""
        rid = request.request_id
        table = self._tables.get(rid)
        if table is not None and not computed_block_ids:  # the common decode step: its blocks already hold it
            num_covered = request.num_computed_tokens + num_new_tokens - self.num_dropped_tokens(rid)
            if num_covered <= len(table) * self.block_size:
                return True
        if computed_block_ids and (table or request.num_computed_tokens):
            raise ValueError(f"request {rid}: prefix hits can only seed a request with no blocks")
        if any(self.cache.entry_of(b) is None for b in computed_block_ids):
            raise ValueError(
                f"request {rid}: stale prefix hit (a block was evicted since get_computed_blocks)"
            )
        num_covered = (
            request.num_computed_tokens
            + len(computed_block_ids) * self.block_size
            + num_new_tokens
            - self.num_dropped_tokens(rid)
        )
        num_held = len(table or ()) + len(computed_block_ids)
        num_needed = max(0, self.num_blocks_for(num_covered) - num_held)
        num_revived = sum(1 for b in computed_block_ids if self.pool.ref_count(b) == 0)
        free = self.num_free_blocks if evict_cached else self.pool.num_free_blocks
        if num_needed > free - num_revived:
            return False
        if table is None:
            table = self._tables[rid] = []
            if self._is_cacheable(rid):
                self.cache.record((request.num_tokens - 1) // self.block_size, len(computed_block_ids))
        if computed_block_ids:
            self.pool.incref(computed_block_ids)
            for b in computed_block_ids:
                self.cache.set_in_use(b)
            self.cache.touch(computed_block_ids)
            self._chains[rid] = [self.cache.entry_of(b) for b in computed_block_ids]
            table.extend(computed_block_ids)
        table.extend(self._allocate(num_needed))
        return True

    def _allocate(self, num_blocks: int) -> list[int]:
        while self.pool.num_free_blocks < num_blocks:
            victim = self.cache.pop_evictable()
            assert victim is not None, "allocate_slots checked capacity; nothing left to evict"
            self.pool.reclaim([victim])
        return self.pool.allocate(num_blocks)

    def free(self, request: KVRequest, *, preempted: bool = False) -> None:
        """Drop the request's references. Cached blocks nobody else holds become evictable. A preempted
        request keeps its memoized keys and uncacheable mark for when it is recomputed."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        self._chains.pop(rid, None)
        self._dropped.pop(rid, None)
        if not preempted:
            self._keys.pop(rid, None)
            self._uncacheable.discard(rid)
            self._broken.discard(rid)
        if table:
            # Tail first: equal-time LRU-2 ties then evict the end of a sequence before its shared head.
            self._release(list(reversed(table)))

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; cached ones nobody holds any more become evictable."""
        cached: list[int] = []
        for b in blocks:
            if self.cache.entry_of(b) is None:
                continue
            if self.pool.is_online(b):
                cached.append(b)
            else:
                self.cache.remove(b)
        for b in self.pool.free(blocks, park=cached):
            self.cache.set_evictable(b)
        if self.max_parked_blocks is not None:
            while self.pool.num_parked_blocks > self.max_parked_blocks:
                victim = self.cache.pop_evictable()
                if victim is None:
                    break
                self.pool.reclaim([victim])

    # --- registration --------------------------------------------------------------------------------------
    def cache_full_blocks(self, request: KVRequest) -> None:
        """Register the request's newly full, computed blocks so later requests can hit them."""
        rid = request.request_id
        table = self._tables.get(rid)
        if not table or not self._is_cacheable(rid) or rid in self._broken:
            return
        chain = self._chains.setdefault(rid, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        if num_full <= len(chain) or (chain and not self.cache.is_live(chain[-1])):
            return
        keys = self._block_keys(request, num_full)
        tokens = request.all_token_ids
        extra = _extra_keys(request)
        parent = chain[-1] if chain else None
        for i in range(len(chain), num_full):
            if not self.pool.is_online(table[i]):
                return
            block_tokens = tokens[i * self.block_size : (i + 1) * self.block_size]
            entry = self.cache.insert(keys[i], table[i], parent, block_tokens, extra)
            if entry is None:
                self._broken.add(rid)
                return
            chain.append(entry)
            parent = entry

    def drop_slots(
        self, request_id: str, num_live: int, num_dropped: int, rewrite_from: int
    ) -> tuple[list[int], list[int]] | None:
        """KV eviction with compaction: the evictor moves what each layer and head keeps of slots
        ``[rewrite_from, num_live)`` down into ``[rewrite_from, num_live - num_dropped)``, and slots
        ``[num_live - num_dropped, num_live)`` leave the table (later slots move down).

        Slots about to be rewritten must not change KV that someone else reads or may hit: a block shared with
        another request, or registered in the prefix cache, is replaced by a fresh one (the original keeps its
        bytes, so it stays a prefix hit); when the pool has no block to spare for a registered one, that
        block leaves the prefix cache and is rewritten in place. The request registers nothing from now on
        (its later KV attends to a partial context). Returns (table before, table after): the caller copies
        the KV before the next allocation (the released blocks' contents are intact until then). None, with
        nothing changed, when a shared block has no fresh block to go to."""
        table = self._tables[request_id]
        if not 0 < num_dropped <= num_live - rewrite_from or num_live > len(table):
            raise ValueError(
                f"request {request_id}: cannot drop {num_dropped} of slots [{rewrite_from}, {num_live}) "
                f"(table of {len(table)})"
            )
        kept_end = num_live - num_dropped
        rewritten = self._rewrite(request_id, range(rewrite_from, kept_end))
        if rewritten is None:
            return None
        before, released = rewritten
        vacated = table[kept_end:num_live]
        del table[kept_end:num_live]
        self._dropped[request_id] = self._dropped.get(request_id, 0) + num_dropped
        self._release(released + vacated)
        return before, list(table)

    def privatize(
        self, request_id: str, indices: Iterable[int] | None = None
    ) -> tuple[list[int], list[int]] | None:
        """Before KV eviction rewrites table entries ``indices`` (all when None) of a request in no fixed order
        (per-layer budgets move a layer's slots into pages of other blocks, ``kv.layer_pages``): ``drop_slots``'
        rules for rewritten slots. Returns (table before, table after); the caller copies every replaced block's
        KV before the next allocation. None, with nothing changed, when a shared block has no fresh block to go
        to."""
        table = self._tables[request_id]
        rewritten = self._rewrite(request_id, range(len(table)) if indices is None else indices)
        if rewritten is None:
            return None
        before, released = rewritten
        self._release(released)
        return before, list(self._tables[request_id])

    def release_slots(self, request_id: str, indices: Sequence[int]) -> None:
        """KV eviction freed these table entries (blocks the evictor emptied; ``privatize`` was called since
        the request last took a prefix hit): they leave the table and go back to the pool."""
        table = self._tables[request_id]
        gone = set(indices)
        if not gone <= set(range(len(table))):
            raise ValueError(f"request {request_id}: no table entries {sorted(gone)} (table of {len(table)})")
        vacated = [table[i] for i in sorted(gone)]
        table[:] = [b for i, b in enumerate(table) if i not in gone]
        self._dropped[request_id] = self._dropped.get(request_id, 0) + len(vacated)
        self._broken.add(request_id)
        self._chains.pop(request_id, None)
        self._release(vacated)

    def release_before(self, request_id: str, position: int) -> int:
        """Sliding-window attention in every layer: the blocks wholly before token ``position`` hold KV that no
        query reads again; they leave the table (``num_dropped_tokens`` grows by whole blocks) and go back to
        the pool, or stay cached for prefix hits. Returns the number of blocks released."""
        num_gone = position // self.block_size - self._dropped.get(request_id, 0)
        table = self._tables.get(request_id)
        if num_gone <= 0 or not table:
            return 0
        self.release_slots(request_id, range(min(num_gone, len(table) - 1)))
        return min(num_gone, len(table) - 1)

    def _rewrite(self, request_id: str, indices: Iterable[int]) -> tuple[list[int], list[int]] | None:
        """Make table entries ``indices`` safe to rewrite: shared ones move to fresh blocks, registered ones too
        while the pool has spare blocks (the original stays a prefix hit), else they leave the prefix cache. The
        request registers nothing from now on. Returns (table before, the blocks it let go, to ``_release``)."""
        table = self._tables[request_id]
        indices = list(indices)
        shared = [i for i in indices if self.pool.ref_count(table[i]) > 1]
        registered = [
            i
            for i in indices
            if self.pool.ref_count(table[i]) == 1 and self.cache.entry_of(table[i]) is not None
        ]
        spare = self.num_free_blocks - len(shared)
        if spare < 0:
            return None
        copied = shared + registered[:spare]
        before = list(table)
        for i, b in zip(copied, self._allocate(len(copied))):
            table[i] = b
        for i in registered[spare:]:
            self.cache.remove(table[i])
        self._broken.add(request_id)
        self._chains.pop(request_id, None)
        return before, [before[i] for i in copied]

    def truncate(self, request_id: str, num_blocks: int) -> None:
        """Roll a table back to its first ``num_blocks`` blocks (a lookahead draft's KV is discarded); the rest go
        back to the pool. Only blocks taken after the table had ``num_blocks`` may go: they were never shared."""
        table = self._tables[request_id]
        extra = table[num_blocks:]
        if not extra:
            return
        assert all(self.pool.ref_count(b) == 1 for b in extra), (
            f"request {request_id}: a draft block is shared"
        )
        del table[num_blocks:]
        self._release(list(reversed(extra)))

    def mark_uncacheable(self, request_id: str) -> None:
        """The request's KV will be rewritten (compression): never offer its blocks as prefix hits, and
        stop offering any it already registered. Blocks shared with others (``pool.ref_count > 1``) must
        not be rewritten in place. Lasts until the request is freed without ``preempted``."""
        self._uncacheable.add(request_id)
        self._chains.pop(request_id, None)
        for b in self._tables.get(request_id, ()):
            if self.cache.entry_of(b) is not None:
                self.cache.remove(b)

    def _is_cacheable(self, request_id: str) -> bool:
        return self.enable_prefix_caching and request_id not in self._uncacheable

    def _block_keys(self, request: KVRequest, num_blocks: int) -> list[bytes]:
        keys = self._keys.setdefault(request.request_id, [])
        if len(keys) < num_blocks:
            tokens = request.all_token_ids
            extra = _extra_keys(request)
            bs = self.block_size
            for i in range(len(keys), num_blocks):
                keys.append(self.cache.key(keys[-1] if keys else None, tokens[i * bs : (i + 1) * bs], extra))
        return keys

    # --- DTSS ----------------------------------------------------------------------------------------------
    def release_shards(self, num_shards: int) -> list[int]:
        """Take the highest shards offline. Returns the block ids still held there; the caller must free
        (preempt) every request in ``request_ids_holding`` them."""
        used = self.pool.release_shards(num_shards)
        for b in self.pool.offline_parked_blocks():
            self.cache.remove(b)
            self.pool.reclaim([b])
        for b in used:
            if self.cache.entry_of(b) is not None:
                self.cache.remove(b)
        return used

    def grow_shards(self, num_shards: int) -> None:
        self.pool.grow_shards(num_shards)

    # --- invariants ----------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.pool.check_integrity(self._tables.values())
        self.cache.check_integrity()
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"request {rid} holds a block twice: {table}"
        evictable = set(self.cache.evictable_block_ids())
        parked = {b for b in self.cache.cached_block_ids() if self.pool.is_parked(b)}
        assert evictable == parked, f"evictable {sorted(evictable)[:8]} != parked {sorted(parked)[:8]}"
        assert self.pool.num_parked_blocks == len(parked), "a parked block is not in the prefix cache"
        for b in self.cache.cached_block_ids():
            assert self.pool.is_online(b), f"cached block {b} is in an offline shard"
            assert self.pool.ref_count(b) > 0 or self.pool.is_parked(b), f"cached block {b} is on a free list"


def _extra_keys(request: KVRequest) -> ExtraKeys:
    return (request.cache_salt, request.plan_id)
