"""Fixed-size KV blocks: free lists, reference counts, and shards that can go offline (DTSS).

Pure bookkeeping over block ids; the tensors that hold the keys and values live in the runner.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than the online shards have free."""


class BlockPool:
    """Block ids ``0 .. num_blocks-1`` split into ``num_shards`` contiguous shards.

    Every block is in exactly one state:
      free   -- on its shard's free list, ref count 0;
      used   -- ref count > 0 (one count per block table that holds it);
      parked -- ref count 0 but kept off the free list because the prefix cache still offers its
                contents; only ``incref`` (a prefix hit) or ``reclaim`` (eviction) take it out.
    Allocation takes the lowest free ids (each free list is a min-heap): the blocks in use stay packed at the
    bottom of the pool, so the memory a CPU pool commits (pages are committed on first write) follows the
    peak load, and the free blocks between and above the held ones can be handed back (``release_free_runs``).
    Shard ``s`` owns ids ``[bounds[s], bounds[s+1])``; the first ``num_online_shards`` shards are online.
    Offline shards keep their free lists but are never allocated from; parked blocks are always online.
    """

    def __init__(self, num_blocks: int, num_shards: int = 1) -> None:
        if num_shards < 1 or num_blocks < num_shards:
            raise ValueError(f"BlockPool needs num_blocks ({num_blocks}) >= num_shards ({num_shards}) >= 1")
        self.num_blocks = num_blocks
        self.num_shards = num_shards
        self.num_online_shards = num_shards
        # NOTE: the last shards absorb the remainder, so uneven sizes still cover every id.
        self._bounds = [s * num_blocks // num_shards for s in range(num_shards + 1)]
        self._ref_counts = [0] * num_blocks
        self._num_used = 0
        self._is_free = [True] * num_blocks
        self._parked: set[int] = set()
        self._free_lists = [list(range(self._bounds[s], self._bounds[s + 1])) for s in range(num_shards)]
        # Blocks handed out since the last release: the only ones whose memory may be committed
        self._written: set[int] = set()

    # --- queries -------------------------------------------------------------------------------------------
    @property
    def num_online_blocks(self) -> int:
        return self._bounds[self.num_online_shards]

    @property
    def num_free_blocks(self) -> int:
        """Free (never parked) blocks in online shards: what ``allocate`` can hand out now."""
        return sum(len(self._free_lists[s]) for s in range(self.num_online_shards))

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_parked_blocks(self) -> int:
        return len(self._parked)

    @property
    def usage(self) -> float:
        """Fraction of online blocks that a request holds (parked blocks count as available)."""
        used_offline = sum(1 for r in self._ref_counts[self.num_online_blocks :] if r > 0)
        return (self._num_used - used_offline) / self.num_online_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_parked(self, block_id: int) -> bool:
        return block_id in self._parked

    def is_online(self, block_id: int) -> bool:
        return block_id < self.num_online_blocks

    def shard_of(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return bisect_right(self._bounds, block_id) - 1

    # --- transitions ---------------------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (ref count 1), lowest online shard first so that releasing the
        highest shards (DTSS) preempts as little as possible. Raises NoFreeBlocksError, changing nothing,
        when the online shards have fewer free blocks."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids: list[int] = []
        for s in range(self.num_online_shards):
            free = self._free_lists[s]
            while free and len(block_ids) < num_blocks:
                block_ids.append(heapq.heappop(free))
        for b in block_ids:
            self._is_free[b] = False
            self._ref_counts[b] = 1
        self._num_used += num_blocks
        self._written.update(block_ids)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block; a parked block becomes used again (a prefix hit)."""
        for b in block_ids:
            if self._is_free[b]:
                raise AssertionError(f"incref of free block {b}: only used or parked blocks can be shared")
            if self._ref_counts[b] == 0:
                self._parked.remove(b)
                self._num_used += 1
            self._ref_counts[b] += 1

    def free(self, block_ids: Iterable[int], *, park: Iterable[int] = ()) -> list[int]:
        """Drop one reference per listed block. A block reaching 0 goes back to its free list, unless it is
        in ``park`` (the prefix cache keeps it). Returns the blocks that were parked."""
        keep = set(park)
        parked: list[int] = []
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise AssertionError(f"free of block {b} with ref count {self._ref_counts[b]}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] > 0:
                continue
            self._num_used -= 1
            if b in keep and self.is_online(b):
                self._parked.add(b)
                parked.append(b)
            else:
                self._push_free(b)
        return parked

    def reclaim(self, block_ids: Iterable[int]) -> None:
        """Parked blocks back to their free lists (the prefix cache evicted them)."""
        for b in block_ids:
            if b not in self._parked:
                raise AssertionError(f"reclaim of block {b}, which is not parked")
            self._parked.remove(b)
            self._push_free(b)

    def _push_free(self, block_id: int) -> None:
        self._is_free[block_id] = True
        heapq.heappush(self._free_lists[self.shard_of(block_id)], block_id)

    def release_free_runs(self) -> list[tuple[int, int, bool]]:
        """The runs [start, end) of consecutive free blocks holding at least one block written since the last
        release, and whether nothing above a run is used or parked; those blocks count as unwritten afterwards
        (the caller hands their memory back). Parked blocks scattered through the pool leave the free runs
        between them, not only the top, to hand back."""
        dirty = sorted(b for b in self._written if self._is_free[b])
        self._written.difference_update(dirty)
        held = max((b for b, r in enumerate(self._ref_counts) if r > 0), default=-1)
        top = max(held, max(self._parked, default=-1))
        runs: list[tuple[int, int, bool]] = []
        for b in dirty:
            if runs and runs[-1][1] >= b:  # already inside the run grown from an earlier dirty block
                continue
            start, end = b, b + 1
            while start > 0 and self._is_free[start - 1]:
                start -= 1
            while end < self.num_blocks and self._is_free[end]:
                end += 1
            runs.append((start, end, start > top))
        return runs

    # --- DTSS ----------------------------------------------------------------------------------------------
    def release_shards(self, num_shards: int) -> list[int]:
        """Take the highest ``num_shards`` online shards offline; at least one shard stays online.
        Returns the ids of blocks still used there: their holders must be preempted. Parked blocks there
        must be reclaimed by the caller (the prefix cache owns them)."""
        if not 0 <= num_shards < self.num_online_shards:
            raise ValueError(
                f"release_shards({num_shards}): must be in [0, {self.num_online_shards - 1}] "
                f"({self.num_online_shards} shards online, one must stay)"
            )
        self.num_online_shards -= num_shards
        offline = range(self.num_online_blocks, self._bounds[self.num_online_shards + num_shards])
        return [b for b in offline if self._ref_counts[b] > 0]

    def offline_parked_blocks(self) -> list[int]:
        return sorted(b for b in self._parked if not self.is_online(b))

    def grow_shards(self, num_shards: int) -> None:
        """Bring back the lowest ``num_shards`` offline shards."""
        num_offline = self.num_shards - self.num_online_shards
        if not 0 <= num_shards <= num_offline:
            raise ValueError(f"grow_shards({num_shards}): must be in [0, {num_offline}] (offline shards)")
        self.num_online_shards += num_shards

    # --- invariants ----------------------------------------------------------------------------------------
    def check_integrity(self, block_tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raise AssertionError naming the first broken invariant. With ``block_tables`` (every table that
        holds references), each ref count must equal the number of times the block appears in them."""
        refs = self._ref_counts
        negative = [b for b, r in enumerate(refs) if r < 0]
        assert not negative, f"negative ref counts for blocks {negative[:8]}"
        listed = [b for s, free in enumerate(self._free_lists) for b in free]
        assert len(listed) == len(set(listed)), "a block is on the free lists twice"
        for s, free in enumerate(self._free_lists):
            wrong = [b for b in free if self.shard_of(b) != s]
            assert not wrong, f"blocks {wrong[:8]} on the free list of shard {s}, which does not own them"
        flagged = {b for b, f in enumerate(self._is_free) if f}
        assert flagged == set(listed), "free flags disagree with the free lists"
        both = [b for b in listed if refs[b] > 0]
        assert not both, f"blocks {both[:8]} are both free and used"
        parked_bad = [b for b in self._parked if refs[b] != 0 or self._is_free[b] or not self.is_online(b)]
        assert not parked_bad, f"parked blocks {parked_bad[:8]} are used, free or offline"
        num_used = sum(1 for r in refs if r > 0)
        assert num_used == self._num_used, f"used counter {self._num_used} != {num_used} blocks with refs"
        total = len(listed) + num_used + len(self._parked)
        assert total == self.num_blocks, (
            f"free ({len(listed)}) + used ({num_used}) + parked ({len(self._parked)}) = {total} "
            f"!= {self.num_blocks} blocks"
        )
        if block_tables is not None:
            held = Counter(b for table in block_tables for b in table)
            mismatch = [
                (b, refs[b], held.get(b, 0)) for b in range(self.num_blocks) if refs[b] != held.get(b, 0)
            ]
            assert not mismatch, f"(block, ref count, references in block tables) disagree: {mismatch[:8]}"
