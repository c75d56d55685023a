"""Physical KV storage for the paged cache: per layer, K and V planes indexed by block, stored by a codec.

Planar layout (all K, then all V, as in our design notes): every plane of the codec (data, scales, zero
points) is one contiguous (num_layers, num_blocks, *per_block) tensor. Logical bookkeeping (which request owns
which block) lives in ``kv.block_pool`` / ``kv.manager``. Reads gather whole blocks and decode them.

Staged codecs (int4 KIVI keys are quantized per channel over a block's tokens) keep each request's last, not
yet full block in a full-precision staging store: a write plan seals a block (staged tokens + new tokens,
encoded into the pool) when it fills and stages the new tail. A read names a staged block by
``num_blocks + staging index``. Staging entries belong to requests, changes commit after the forward succeeds
(a failed step can be rerun), and a sealing step moves the tail to a fresh entry so the one it reads stays
intact until the commit.

On the CPU the storage is an anonymous mmap: untouched pages cost no memory (RSS grows with use, and
read as zeros, so padded reads are always finite), and ``release_blocks`` hands a range of blocks back to
the OS (madvise DONTNEED) when the DTSS takes KV shards offline under memory pressure.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from mcp2026.kv.codecs import KVCodec, Planes, TensorCodec, identity_codec

log = logging.getLogger(__name__)


def _allocate(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, mmap.mmap | None]:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    return tensor, buffer


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # NOTE: CPU index_copy_/index_select have no float8 kernels; copying the bytes is the same thing.
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _select(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _bytes(src).index_select(0, index).view(src.dtype)


def _copy(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    _bytes(dst).index_copy_(0, index, _bytes(src.to(dst.dtype)))


@dataclass
class BlockRead:
    """Blocks to read: ``block_ids`` (N,) pool ids; rows ``stage_pos`` come from staging ``stage_idx``."""

    block_ids: torch.Tensor
    stage_pos: torch.Tensor | None = None
    stage_idx: torch.Tensor | None = None

    def to(self, device: torch.device) -> BlockRead:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return BlockRead(move(self.block_ids), move(self.stage_pos), move(self.stage_idx))


@dataclass
class WritePlan:
    """Where one step's T new tokens go (the same for every layer).

    Unstaged codecs: token ``t`` goes to slot ``slots[t]``. Staged codecs: full blocks ``seal_block_ids``
    are assembled from new tokens ``seal_src`` (NS*bs,) and staged rows ``seal_stage_src`` (placed at
    ``seal_stage_dst``), encoded and written; tail tokens ``tail_src`` go to staging rows ``tail_dst``.
    """

    slots: torch.Tensor | None = None
    seal_block_ids: torch.Tensor | None = None
    seal_src: torch.Tensor | None = None
    seal_stage_dst: torch.Tensor | None = None
    seal_stage_src: torch.Tensor | None = None
    tail_dst: torch.Tensor | None = None
    tail_src: torch.Tensor | None = None
    stage_after: dict[str, int | None] = field(default_factory=dict)  # request -> staging index after it
    is_monitored: bool = False  # measure the round-trip error of this step's writes

    def to(self, device: torch.device) -> WritePlan:
        if device.type == "cpu":
            return self
        moved = {
            k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in self.__dict__.items()
        }
        return WritePlan(**moved)


@dataclass
class _ErrorStats:
    """Relative round-trip error ||x_hat - x|| / ||x|| per layer, for K and V, on monitored writes."""

    max_error: torch.Tensor  # (2, L)
    sum_error: torch.Tensor  # (2, L)
    num_checks: torch.Tensor  # (2, L)
    num_over: torch.Tensor  # (2, L) checks above the threshold


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        codec: KVCodec | None = None,
        max_error: float = 0.02,
        error_check_interval: int = 16,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # what reads return (the model's activation dtype)
        self.device = torch.device(device)
        self.codec = codec or identity_codec(dtype)
        self.codec.check_shape(num_kv_heads, head_dim)
        self._buffers: list[mmap.mmap] = []
        self.k_planes = self._allocate_planes(self.codec.key)
        self.v_planes = self._allocate_planes(self.codec.value)
        self.block_bytes = self.codec.block_bytes(block_size, num_kv_heads, head_dim)  # one layer
        # Staging store (staged codecs only): full-precision last blocks, grown on demand.
        self._stage_k = self._stage_v = torch.empty(0)
        self._staged: dict[str, int] = {}
        self._free_stage: set[int] = set()
        self.max_error = max_error
        self.error_check_interval = error_check_interval
        self._num_plans = 0
        shape = (2, num_layers)
        self.errors = _ErrorStats(*(torch.zeros(shape) for _ in range(4)))
        self.num_shape_checks = 0
        self._warned_layers: set[tuple[int, int]] = set()

    def _allocate_planes(self, codec: TensorCodec) -> Planes:
        planes = {}
        for name, spec in codec.planes(self.block_size, self.num_kv_heads, self.head_dim).items():
            tensor, buffer = _allocate((self.num_layers, self.num_blocks, *spec.shape), spec.dtype, self.device)
            planes[name] = tensor
            if buffer is not None:
                self._buffers.append(buffer)
        return planes

    # --- sizes -----------------------------------------------------------------------------------------
    @property
    def k(self) -> torch.Tensor:
        """The key data plane per slot, (L, num_slots, nkv, ...): the raw values for identity codecs."""
        return next(iter(self.k_planes.values())).flatten(1, 2)

    @property
    def v(self) -> torch.Tensor:
        return next(iter(self.v_planes.values())).flatten(1, 2)

    @property
    def nbytes(self) -> int:
        planes = [*self.k_planes.values(), *self.v_planes.values()]
        return sum(p.numel() * p.element_size() for p in planes)

    @property
    def bytes_per_token(self) -> float:
        """Pool bytes per token, all layers, K and V (staging excluded)."""
        return self.num_layers * self.block_bytes / self.block_size

    @property
    def staging_nbytes(self) -> int:
        return (self._stage_k.numel() + self._stage_v.numel()) * self._stage_k.element_size()

    @property
    def num_staged(self) -> int:
        return len(self._staged)

    # --- writes ----------------------------------------------------------------------------------------
    def plan_write(self, chunks: Sequence[tuple[str, int, int, Sequence[int]]]) -> WritePlan:
        """Plan a step's writes. ``chunks``: (request id, start position, number of tokens, block table),
        the step's tokens in this order. Pure: nothing changes until ``commit(plan)``."""
        self._num_plans += 1
        is_monitored = not self.codec.is_lossless and self._num_plans % self.error_check_interval == 1
        if not self.codec.is_staged:
            slots = [self._chunk_slots(start, n, table) for _, start, n, table in chunks]
            return WritePlan(slots=torch.cat(slots), is_monitored=is_monitored)
        return self._plan_staged(chunks, is_monitored)

    def _chunk_slots(self, start: int, num_tokens: int, table: Sequence[int]) -> torch.Tensor:
        bs = self.block_size
        pos = torch.arange(start, start + num_tokens)
        blocks = torch.tensor(table[start // bs : (start + num_tokens - 1) // bs + 1], dtype=torch.long)
        return blocks[pos // bs - start // bs] * bs + pos % bs

    def _plan_staged(self, chunks: Sequence[tuple[str, int, int, Sequence[int]]], is_monitored: bool) -> WritePlan:
        bs = self.block_size
        seal_ids, seal_src, stage_dst, stage_src, tail_dst, tail_src = [], [], [], [], [], []
        after: dict[str, int | None] = {}
        taken: set[int] = set()
        offsets = torch.arange(bs)
        tok0 = 0
        for rid, start, n, table in chunks:
            end = start + n
            current = self._staged.get(rid)
            if start % bs and current is None:
                raise AssertionError(f"request {rid}: block {start // bs} is partly written but not staged")
            first, num_sealed = start // bs, end // bs - start // bs
            if num_sealed:
                seal_ids.extend(table[first : first + num_sealed])
                src = tok0 - start + (torch.arange(first, first + num_sealed) * bs).unsqueeze(1) + offsets
                head = start % bs  # staged tokens at the start of the first sealed block
                if head:
                    dst0 = len(seal_ids) * bs - num_sealed * bs
                    stage_dst.append(torch.arange(dst0, dst0 + head))
                    stage_src.append(torch.arange(current * bs, current * bs + head))
                    src[0, :head] = tok0
                seal_src.append(src.flatten())
            if end % bs:
                idx = current if (num_sealed == 0 and current is not None) else self._take_stage(taken)
                lo = max(start, end // bs * bs)
                tail_dst.append(idx * bs + torch.arange(lo, end) % bs)
                tail_src.append(torch.arange(tok0 + lo - start, tok0 + n))
                after[rid] = idx
            else:
                after[rid] = None
            tok0 += n

        def cat(parts: list[torch.Tensor]) -> torch.Tensor | None:
            return torch.cat(parts) if parts else None

        return WritePlan(
            seal_block_ids=torch.tensor(seal_ids, dtype=torch.long) if seal_ids else None,
            seal_src=cat(seal_src),
            seal_stage_dst=cat(stage_dst),
            seal_stage_src=cat(stage_src),
            tail_dst=cat(tail_dst),
            tail_src=cat(tail_src),
            stage_after=after,
            is_monitored=is_monitored,
        )

    def _take_stage(self, taken: set[int]) -> int:
        available = self._free_stage - taken
        if not available:
            self._grow_staging()
            available = self._free_stage - taken
        idx = min(available)
        taken.add(idx)
        return idx

    def _grow_staging(self) -> None:
        old = self._stage_k.shape[1] if self._stage_k.dim() > 1 else 0
        new = max(8, 2 * old)
        shape = (self.num_layers, new, self.block_size, self.num_kv_heads, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if old:
            k[:, :old], v[:, :old] = self._stage_k, self._stage_v
        self._stage_k, self._stage_v = k, v
        self._free_stage.update(range(old, new))

    def commit(self, plan: WritePlan) -> None:
        """The step ran: apply its staging changes."""
        for rid, idx in plan.stage_after.items():
            old = self._staged.pop(rid, None)
            if idx is not None:
                self._staged[rid] = idx
                self._free_stage.discard(idx)
            if old is not None and old != idx:
                self._free_stage.add(old)

    def release_requests(self, request_ids: Iterable[str]) -> None:
        """Requests finished or preempted: their staging entries are free again."""
        for rid in request_ids:
            idx = self._staged.pop(rid, None)
            if idx is not None:
                self._free_stage.add(idx)

    def stage_index(self, request_id: str) -> int | None:
        return self._staged.get(request_id)

    def write(self, layer: int, plan: WritePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: (T, nkv, hd), the step's new tokens in plan order
        for planes, codec, x, kind in ((self.k_planes, self.codec.key, k, 0), (self.v_planes, self.codec.value, v, 1)):
            if plan.slots is not None:
                encoded = codec.encode(x)
                for name, data in encoded.items():
                    _copy(planes[name][layer].flatten(0, 1), plan.slots, data)
            else:
                encoded, x = self._write_staged(layer, plan, planes, codec, x, kind)
            if plan.is_monitored and encoded is not None:
                self._monitor(layer, kind, codec, encoded, x)

    def _write_staged(
        self, layer: int, plan: WritePlan, planes: Planes, codec: TensorCodec, x: torch.Tensor, kind: int
    ) -> tuple[Planes | None, torch.Tensor]:
        store = self._stage_k if kind == 0 else self._stage_v
        stage = store[layer].flatten(0, 1) if store.dim() > 1 else None  # (capacity*bs, nkv, hd)
        encoded, full = None, x
        if plan.seal_block_ids is not None:
            full = x.index_select(0, plan.seal_src).to(self.dtype)  # (NS*bs, nkv, hd)
            if plan.seal_stage_dst is not None:
                full.index_copy_(0, plan.seal_stage_dst, stage.index_select(0, plan.seal_stage_src))
            full = full.view(-1, self.block_size, *x.shape[1:])
            encoded = codec.encode(full)
            for name, data in encoded.items():
                _copy(planes[name][layer], plan.seal_block_ids, data)
        if plan.tail_dst is not None:
            stage.index_copy_(0, plan.tail_dst, x.index_select(0, plan.tail_src).to(self.dtype))
        return encoded, full

    # --- reads -----------------------------------------------------------------------------------------
    def block_read(self, block_ids: torch.Tensor) -> BlockRead:
        """A read of ``block_ids`` (N,), where ids >= num_blocks name staging entries."""
        staged = block_ids >= self.num_blocks
        if not self.codec.is_staged or not bool(staged.any()):
            return BlockRead(block_ids)
        pos = staged.nonzero().squeeze(1)
        return BlockRead(block_ids.masked_fill(staged, 0), pos, block_ids[pos] - self.num_blocks)

    def gather(self, layer: int, read: BlockRead) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks, decoded: (N, bs, nkv, hd) each, in the cache's compute dtype."""
        out = []
        for planes, codec, stage in (
            (self.k_planes, self.codec.key, self._stage_k),
            (self.v_planes, self.codec.value, self._stage_v),
        ):
            picked = {name: _select(p[layer], read.block_ids) for name, p in planes.items()}
            x = codec.decode(picked, self.dtype)
            if read.stage_pos is not None:
                x.index_copy_(0, read.stage_pos, stage[layer].index_select(0, read.stage_idx))
            out.append(x)
        return out[0], out[1]

    # --- debug checks ----------------------------------------------------------------------------------
    def _monitor(self, layer: int, kind: int, codec: TensorCodec, encoded: Planes, x: torch.Tensor) -> None:
        decoded = codec.decode(encoded, torch.float32)
        if decoded.shape != x.shape:
            raise AssertionError(f"KV codec {codec.name} changed a shape: {tuple(x.shape)} -> {tuple(decoded.shape)}")
        self.num_shape_checks += 1
        x = x.float()
        error = float((decoded - x).norm() / x.norm().clamp_min(1e-12))
        stats = self.errors
        stats.max_error[kind, layer] = max(float(stats.max_error[kind, layer]), error)
        stats.sum_error[kind, layer] += error
        stats.num_checks[kind, layer] += 1
        if error > self.max_error:
            stats.num_over[kind, layer] += 1
            if (kind, layer) not in self._warned_layers:
                self._warned_layers.add((kind, layer))
                log.warning(
                    "KV %s of layer %d: %s round-trip error %.4f exceeds max_error %.4f",
                    "keys" if kind == 0 else "values",
                    layer,
                    self.codec.name,
                    error,
                    self.max_error,
                )

    def debug_report(self) -> dict:
        stats = self.errors
        checks = stats.num_checks.clamp_min(1)
        mean = (stats.sum_error / checks).tolist()
        over = [
            {"layer": layer, "kind": "k" if kind == 0 else "v", "max_error": float(stats.max_error[kind, layer])}
            for kind in (0, 1)
            for layer in range(self.num_layers)
            if stats.num_over[kind, layer] > 0
        ]
        return {
            "codec": self.codec.name,
            "bytes_per_token": self.bytes_per_token,
            "num_blocks": self.num_blocks,
            "pool_bytes": self.nbytes,
            "staging_bytes": self.staging_nbytes,
            "num_staged_blocks": self.num_staged,
            "max_error_threshold": self.max_error,
            "num_error_checks": int(stats.num_checks.sum()),
            "num_shape_checks": self.num_shape_checks,
            "k_error_max": stats.max_error[0].tolist(),
            "v_error_max": stats.max_error[1].tolist(),
            "k_error_mean": mean[0],
            "v_error_mean": mean[1],
            "layers_over_max_error": over,
        }

    # --- DTSS ------------------------------------------------------------------------------------------
    def release_blocks(self, start_block: int, end_block: int) -> int:
        """Return the memory of blocks [start, end) to the OS (CPU only); they read as zeros afterwards.
        Returns the number of bytes released (whole pages inside the range, every layer and plane)."""
        if not self._buffers or end_block <= start_block:
            return 0
        page = mmap.PAGESIZE
        released = 0
        planes = [*self.k_planes.values(), *self.v_planes.values()]
        for buffer, plane in zip(self._buffers, planes):
            block_bytes = plane[0, 0].numel() * plane.element_size()
            layer_bytes = self.num_blocks * block_bytes
            for layer in range(self.num_layers):
                lo = layer * layer_bytes + start_block * block_bytes
                hi = layer * layer_bytes + end_block * block_bytes
                lo, hi = -(-lo // page) * page, hi // page * page
                if hi > lo:
                    buffer.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                    released += hi - lo
        return released
