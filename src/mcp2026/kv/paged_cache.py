"""Physical KV storage for the paged cache: per layer, K and V planes indexed by block, stored by a codec.

Planar layout (all K, then all V): every plane of the codec (data, scales, zero
points) is one contiguous (num_layers, num_blocks, num_kv_heads, *chunk) tensor; a chunk is one head of one
block (``block_size`` tokens). Head-major chunks let a read gather (sequence, head, block) chunks straight into
(B, nkv, L, hd): the attention matmuls then run on contiguous operands, with no transpose of K or V.
Logical bookkeeping (which request owns which block) lives in ``kv.block_pool`` / ``kv.manager``.

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

import copy
import math
import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from mcp2026.kernels import gpu as kernel_gpu
from mcp2026.kernels import ops as kernel_ops
from mcp2026.kv.codecs import (
    Fp8PerToken,
    Identity,
    Int4PerChannel,
    Int4PerTokenGroup,
    Int8PerToken,
    KVCodec,
    Planes,
    TensorCodec,
    identity_codec,
)
from mcp2026.kv.debug import ErrorMonitor
from mcp2026.kv.layer_pages import LayerTable


def _allocate(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, mmap.mmap | None]:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    return tensor, buffer


def staging_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage of a staged codec's unfilled blocks: 16 bits (fp32 models stage in bf16)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # NOTE: CPU index_copy_/index_select have no float8 kernels; copying the bytes is the same thing.
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _select(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _bytes(src).index_select(0, index).view(src.dtype)


def _copy(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    _bytes(dst).index_copy_(0, index, _bytes(src.to(dst.dtype)))


@dataclass
class BlockRead:
    """A (B, nb) grid of blocks to read, one row per sequence. ``chunk_ids``: the chunk of every (sequence,
    head, block), in that order; grid cells (``stage_seq``, ``stage_block``) come from staging ``stage_idx``."""

    chunk_ids: torch.Tensor  # (B * nkv * nb,)
    num_seqs: int
    num_blocks: int
    stage_seq: torch.Tensor | None = None
    stage_block: torch.Tensor | None = None
    stage_idx: torch.Tensor | None = None

    def to(self, device: torch.device) -> BlockRead:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return BlockRead(
            move(self.chunk_ids),
            self.num_seqs,
            self.num_blocks,
            move(self.stage_seq),
            move(self.stage_block),
            move(self.stage_idx),
        )


@dataclass
class WritePlan:
    """Where one step's T new tokens go (the same for every layer; a layered cache's ``rows`` and
    ``seal_chunk_ids`` have one row per layer). Rows index a plane viewed as (num_blocks * nkv * bs, *row):
    row = (block * nkv + head) * bs + offset (a layered cache's flat pool: page for block); staging likewise.

    Unstaged codecs: (token, head) rows ``rows`` (T * nkv,). Staged codecs: full blocks (chunks
    ``seal_chunk_ids``) are assembled from new tokens ``seal_src`` (NS*bs,) and staged (token, head) rows
    ``seal_stage_src`` placed at tokens ``seal_stage_dst``, encoded and written; tail tokens ``tail_src`` go
    to staging rows ``tail_dst`` (Tt * nkv,).
    """

    rows: torch.Tensor | None = None
    seal_chunk_ids: torch.Tensor | None = None
    seal_src: torch.Tensor | None = None
    seal_stage_dst: torch.Tensor | None = None
    seal_stage_src: torch.Tensor | None = None
    tail_dst: torch.Tensor | None = None
    tail_src: torch.Tensor | None = None
    tail_is_whole_step: bool = False  # every new token goes to staging (no seal): tail_src is all T, in order
    stage_after: dict[str, int | None] = field(default_factory=dict)  # request -> staging index after it
    is_monitored: bool = False  # measure the round-trip error of this step's writes

    def for_layer(self, layer: int) -> WritePlan:
        """A layered cache's plan as one layer writes it (its row of ``rows`` / ``seal_chunk_ids``): a shallow
        copy (every layer of every step makes one; ``dataclasses.replace`` cost ~80 us each)."""
        plan = copy.copy(self)
        plan.rows = None if self.rows is None else self.rows[layer]
        plan.seal_chunk_ids = None if self.seal_chunk_ids is None else self.seal_chunk_ids[layer]
        return plan

    def to(self, device: torch.device) -> WritePlan:
        if device.type == "cpu":
            return self
        moved = {
            k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in self.__dict__.items()
        }
        return WritePlan(**moved)


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
        layered: bool = False,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        # Per-layer budgets (kv.layer_pages): every layer reads and writes pages of one flat pool (page = layer *
        # num_blocks + block), through per-layer tables; ids from num_pages on name staging entries.
        self.layered = layered
        self.num_pages = num_layers * num_blocks if layered else num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # what reads return (the model's activation dtype)
        self.device = torch.device(device)
        self.codec = codec or identity_codec(dtype)
        self.codec.check_shape(num_kv_heads, head_dim)
        key, value = self.codec.key, self.codec.value
        # Stored as is in a 16- or 32-bit float (maybe narrower than the activations): kernels read in place;
        # "plain" when that float is the activation dtype too (torch's index_copy_ can write it).
        self._raw = (
            isinstance(key, Identity)
            and isinstance(value, Identity)
            and key.dtype == value.dtype
            and key.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )
        self._plain = self._raw and key.dtype == dtype
        self._buffers: list[mmap.mmap] = []
        self.k_planes = self._allocate_planes(self.codec.key)
        self.v_planes = self._allocate_planes(self.codec.value)
        self.block_bytes = self.codec.block_bytes(block_size, num_kv_heads, head_dim)  # one layer
        # Staging store (staged codecs only): the last, unfilled block of each request in 16 bits (KIVI keeps
        # its residual in fp16), grown on demand.
        self.stage_dtype = staging_dtype(self.dtype)
        self._stage_k = self._stage_v = torch.empty(0)
        self._staged: dict[str, int] = {}
        self._free_stage: set[int] = set()
        self.monitor = ErrorMonitor(num_layers, self.codec.name, max_error, error_check_interval)
        # decided once, read by every decode step's attention (see _quantized_kernel_kind), with the per-layer
        # plane lists it passes
        self.quantized_kernel_kind = self._quantized_kernel_kind()
        # int4 (KIVI) seals in one kernel call per tensor and layer: the key and value "groups" it takes
        self._int4_seal_groups = (
            (0, value._group(head_dim))
            if type(key) is Int4PerChannel and type(value) is Int4PerTokenGroup
            else None
        )
        self._layer_planes = (
            [
                (
                    [self._at(p, layer) for p in self.k_planes.values()],
                    [self._at(p, layer) for p in self.v_planes.values()],
                )
                for layer in range(num_layers)
            ]
            if self.quantized_kernel_kind
            else []
        )

    def _allocate_planes(self, codec: TensorCodec) -> Planes:
        planes = {}
        for name, spec in codec.planes(self.block_size, self.head_dim).items():
            shape = (self.num_layers, self.num_blocks, self.num_kv_heads, *spec.shape)
            tensor, buffer = _allocate(shape, spec.dtype, self.device)
            planes[name] = tensor
            if buffer is not None:
                self._buffers.append(buffer)
        return planes

    def _at(self, plane: torch.Tensor, layer: int) -> torch.Tensor:
        """What ``layer`` reads and writes of a plane, (blocks, nkv, *chunk): its own blocks, or a layered
        cache's whole flat pool of pages (every layer's)."""
        return plane.flatten(0, 1) if self.layered else plane[layer]

    # --- sizes -----------------------------------------------------------------------------------------
    @property
    def k(self) -> torch.Tensor:
        """The key data plane's memory as (L, num_slots, nkv, ...): block ``i`` is rows [i*bs, (i+1)*bs)
        (inside a block the layout is head-major, so a row is not one token)."""
        return self._slot_view(next(iter(self.k_planes.values())))

    @property
    def v(self) -> torch.Tensor:
        return self._slot_view(next(iter(self.v_planes.values())))

    def _slot_view(self, plane: torch.Tensor) -> torch.Tensor:
        return plane.view(self.num_layers, self.num_slots, self.num_kv_heads, -1)

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
    def plan_write(self, chunks: Sequence[tuple[str, int, int, Sequence[int] | LayerTable]]) -> WritePlan:
        """Plan a step's writes. ``chunks``: (request id, start slot, number of tokens, block table; a layered
        cache takes each request's ``LayerTable``), the step's tokens in this order. Pure: nothing changes until
        ``commit(plan)``."""
        is_monitored = self.monitor.is_due() and not self.codec.is_lossless
        if self.layered and not all(isinstance(c[3], LayerTable) for c in chunks):
            raise ValueError("a layered cache writes through LayerTables (kv.layer_pages), one per request")
        if self.codec.is_staged:
            return self._plan_staged(chunks, is_monitored)
        bs = self.block_size
        if self.layered:  # (L, T * nkv): token p of a chunk goes to slot p // bs - shift of each layer
            rows = []
            for _, start, n, lt in chunks:
                pos = torch.arange(start, start + n)
                slots = (pos // bs).unsqueeze(0) - lt.shift.unsqueeze(1)  # (L, n)
                pages = lt.pages.gather(1, slots)
                rows.append(self._layer_rows(pages, pos % bs))
            return WritePlan(rows=torch.cat(rows, dim=1), is_monitored=is_monitored)
        bases = [table[p // bs] for _, start, n, table in chunks for p in range(start, start + n)]
        offsets = [p % bs for _, start, n, _ in chunks for p in range(start, start + n)]
        return WritePlan(rows=self._rows(bases, offsets), is_monitored=is_monitored)

    def _layer_rows(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """(L, n * nkv) rows of tokens at ``offsets`` (n,) in pages (L, n)."""
        heads = torch.arange(self.num_kv_heads)
        rows = (pages.unsqueeze(2) * self.num_kv_heads + heads) * self.block_size + offsets.view(1, -1, 1)
        return rows.flatten(1)

    def _rows(self, chunk_base: Sequence[int], offsets: Sequence[int]) -> torch.Tensor:
        """(token, head) rows (n * nkv,) of tokens at ``offsets`` in blocks / staging entries ``chunk_base``."""
        heads = torch.arange(self.num_kv_heads)
        base = torch.tensor(chunk_base, dtype=torch.long).unsqueeze(1) * self.num_kv_heads
        return (
            (base + heads) * self.block_size + torch.tensor(offsets, dtype=torch.long).unsqueeze(1)
        ).flatten()

    def _plan_staged(
        self, chunks: Sequence[tuple[str, int, int, Sequence[int] | LayerTable]], is_monitored: bool
    ) -> WritePlan:
        bs = self.block_size
        seal_ids: list = []  # block ids; a layered cache's (L, k) page tensors
        seal_src: list[int] = []  # per sealed token: its index among the new tokens (or a dummy)
        stage_dst: list[int] = []  # sealed tokens that come from staging ...
        stage_base: list[int] = []  # ... their staging entry and offset
        stage_off: list[int] = []
        tail_base: list[int] = []
        tail_off: list[int] = []
        tail_src: list[int] = []
        after: dict[str, int | None] = {}
        taken: set[int] = set()
        tok0 = 0
        for rid, start, n, table in chunks:
            end = start + n
            current = self._staged.get(rid)
            if start % bs and current is None:
                raise AssertionError(f"request {rid}: block {start // bs} is partly written but not staged")
            first, last = start // bs, end // bs  # blocks [first, last) fill in this step
            if last > first:
                head = start % bs  # staged tokens at the start of the first sealed block
                stage_dst.extend(range(len(seal_src), len(seal_src) + head))
                stage_base.extend([current] * head)
                stage_off.extend(range(head))
                if isinstance(table, LayerTable):  # (L, k) pages, one row per layer
                    slots = torch.arange(first, last).unsqueeze(0) - table.shift.unsqueeze(1)
                    seal_ids.append(table.pages.gather(1, slots))
                else:
                    seal_ids.extend(table[first:last])
                seal_src.extend([tok0] * head)
                seal_src.extend(range(tok0, tok0 + last * bs - start))
            if end % bs:
                idx = current if (last == first and current is not None) else self._take_stage(taken)
                lo = max(start, last * bs)
                tail_base.extend([idx] * (end - lo))
                tail_off.extend(p % bs for p in range(lo, end))
                tail_src.extend(range(tok0 + lo - start, tok0 + n))
                after[rid] = idx
            else:
                after[rid] = None
            tok0 += n

        def tensor(values: list[int]) -> torch.Tensor | None:
            return torch.tensor(values, dtype=torch.long) if values else None

        plan = WritePlan(stage_after=after, is_monitored=is_monitored)
        if seal_ids and self.layered:  # (L, NS * nkv)
            pages = torch.cat(seal_ids, dim=1).unsqueeze(2)
            plan.seal_chunk_ids = (pages * self.num_kv_heads + torch.arange(self.num_kv_heads)).flatten(1)
        elif seal_ids:
            blocks = torch.tensor(seal_ids, dtype=torch.long).unsqueeze(1)
            plan.seal_chunk_ids = (blocks * self.num_kv_heads + torch.arange(self.num_kv_heads)).flatten()
        if seal_ids:
            plan.seal_src = tensor(seal_src)
        if stage_dst:
            plan.seal_stage_dst, plan.seal_stage_src = tensor(stage_dst), self._rows(stage_base, stage_off)
        if tail_src:
            plan.tail_dst, plan.tail_src = self._rows(tail_base, tail_off), tensor(tail_src)
            plan.tail_is_whole_step = not seal_ids and len(tail_src) == tok0
        return plan

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
        shape = (self.num_layers, new, self.num_kv_heads, self.block_size, self.head_dim)
        k = torch.zeros(shape, dtype=self.stage_dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.stage_dtype, device=self.device)
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

    def save_staging(
        self, request_ids: Iterable[str]
    ) -> dict[str, tuple[int, torch.Tensor, torch.Tensor] | None]:
        """The requests' staged tails (entry, K, V), for ``restore_staging`` after a lookahead draft."""
        saved: dict[str, tuple[int, torch.Tensor, torch.Tensor] | None] = {}
        for rid in request_ids:
            idx = self._staged.get(rid)
            saved[rid] = (
                None if idx is None else (idx, self._stage_k[:, idx].clone(), self._stage_v[:, idx].clone())
            )
        return saved

    def restore_staging(self, saved: dict[str, tuple[int, torch.Tensor, torch.Tensor] | None]) -> None:
        """Put the saved staged tails back, in their own entries: release every saved request's entry first (a
        draft that sealed a block may have taken another request's old entry), then restore."""
        self.release_requests(saved)
        for rid, entry in saved.items():
            if entry is not None:
                idx, k, v = entry
                self._free_stage.discard(idx)
                self._staged[rid] = idx
                self._stage_k[:, idx], self._stage_v[:, idx] = k, v

    def stage_index(self, request_id: str) -> int | None:
        return self._staged.get(request_id)

    def staged_rows(self, layer: int, entry: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` staged tokens of staging ``entry``: K and V (nkv, count, hd), staging dtype.
        During a step, a request's entry from before the step keeps its rows (a sealing step stages the new
        tail elsewhere; one that does not seal appends after them)."""
        return self._stage_k[layer, entry, :, :count], self._stage_v[layer, entry, :, :count]

    def write(self, layer: int, plan: WritePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: (T, nkv, hd), the step's new tokens in plan order
        if self.layered:  # this layer's rows / sealed chunks of the flat pool
            plan = plan.for_layer(layer)
        if self._write_in_one_call(layer, plan, k, v):
            return
        if self._plain and plan.rows is not None and not plan.is_monitored:  # no codec, no kernels
            hd = self.head_dim
            self._at(self.k_planes["x"], layer).view(-1, hd).index_copy_(0, plan.rows, k.reshape(-1, hd))
            self._at(self.v_planes["x"], layer).view(-1, hd).index_copy_(0, plan.rows, v.reshape(-1, hd))
            return
        for planes, codec, x, kind in (
            (self.k_planes, self.codec.key, k, 0),
            (self.v_planes, self.codec.value, v, 1),
        ):
            if plan.rows is not None:
                encoded = codec.encode(x)  # (T, nkv, *row) per plane
                for name, data in encoded.items():
                    _copy(self._at(planes[name], layer).flatten(0, 2), plan.rows, data.flatten(0, 1))
            else:
                encoded, x = self._write_staged(layer, plan, planes, codec, x, kind)
            if plan.is_monitored and encoded is not None:
                self.monitor.record(layer, kind, codec, encoded, x)

    def _write_in_one_call(self, layer: int, plan: WritePlan, k: torch.Tensor, v: torch.Tensor) -> bool:
        """One kernel call for the layer where the kernels store exactly what the torch path would: rows of a
        raw cache (narrowed as ``.to()`` rounds), int8 / fp8 rows (encoded as ``codec.encode``, bit for bit;
        ~20 torch ops per plane otherwise), a staged codec's step that only extends tails (into staging).
        Not on steps the error monitor measures: it needs the encoded planes (a staged tail is never measured)."""
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            return False
        hd = self.head_dim
        if k.is_cuda:  # the GPU kernels write raw rows (a strided K/V view in one launch, not four)
            gpu_kernels = kernel_gpu.kernels_for(k, v)
            if gpu_kernels is None or not self._raw or plan.rows is None or plan.is_monitored:
                return False
            k_rows = self._at(self.k_planes["x"], layer).view(-1, hd)
            gpu_kernels.write_kv_rows(
                k_rows, self._at(self.v_planes["x"], layer).view(-1, hd), plan.rows, k, v
            )
            return True
        kernels = kernel_ops.kernels_for(k, v)
        if kernels is None:
            return False
        if plan.rows is not None and not plan.is_monitored:
            if self._raw:
                k_rows, v_rows = (
                    self._at(self.k_planes["x"], layer).view(-1, hd),
                    self._at(self.v_planes["x"], layer).view(-1, hd),
                )
                kernels.write_kv_rows(k_rows, v_rows, plan.rows, k, v)
                return True
            if self.quantized_kernel_kind in (1, 3):
                kernels.write_kv_rows_quantized(
                    self.quantized_kernel_kind, *self._layer_planes[layer], plan.rows, k, v
                )
                return True
        if plan.tail_is_whole_step:
            stage_k, stage_v = self._stage_k[layer].view(-1, hd), self._stage_v[layer].view(-1, hd)
            kernels.write_kv_rows(stage_k, stage_v, plan.tail_dst, k, v)
            return True
        return False

    def _write_staged(
        self, layer: int, plan: WritePlan, planes: Planes, codec: TensorCodec, x: torch.Tensor, kind: int
    ) -> tuple[Planes | None, torch.Tensor]:
        store = self._stage_k if kind == 0 else self._stage_v
        stage = store[layer].flatten(0, 2) if store.dim() > 1 else None  # (capacity*nkv*bs, hd) rows
        nkv, hd = x.shape[1:]
        encoded, full = None, x
        if plan.seal_chunk_ids is not None:
            # the new tokens rounded as staging rounds them: a block sealed by a decode step holds staged
            # tokens, so one sealed by a prefill chunk encodes the same numbers
            full = x.index_select(0, plan.seal_src).to(self.stage_dtype).to(self.dtype)  # (NS*bs, nkv, hd)
            if plan.seal_stage_dst is not None:
                staged = stage.index_select(0, plan.seal_stage_src).view(-1, nkv, hd).to(self.dtype)
                full.index_copy_(0, plan.seal_stage_dst, staged)
            if not self._seal_in_one_call(layer, plan, planes, full, kind):
                full = (
                    full.view(-1, self.block_size, nkv, hd).transpose(1, 2).flatten(0, 1)
                )  # (NS*nkv, bs, hd)
                encoded = codec.encode(full)
                for name, data in encoded.items():
                    _copy(self._at(planes[name], layer).flatten(0, 1), plan.seal_chunk_ids, data)
        if plan.tail_dst is not None:
            tail = x.index_select(0, plan.tail_src).to(self.stage_dtype).flatten(0, 1)  # (Tt*nkv, hd)
            stage.index_copy_(0, plan.tail_dst, tail)
        return encoded, full

    def _seal_in_one_call(
        self, layer: int, plan: WritePlan, planes: Planes, full: torch.Tensor, kind: int
    ) -> bool:
        """int4 blocks (``full`` (NS*bs, nkv, hd), block-major) encoded and written by one kernel call, the bytes
        ``codec.encode`` stores (~15 torch ops and four plane copies otherwise). Not on monitored steps (the
        monitor needs the encoded planes); the kernel declines NaN, infinite or beyond-fp16 values."""
        if self._int4_seal_groups is None or plan.is_monitored:
            return False
        kernels = kernel_ops.kernels_for(full)
        if kernels is None:
            return False
        tensors = [self._at(plane, layer) for plane in planes.values()]  # q, scale, zero, meta
        group = self._int4_seal_groups[kind]
        return bool(kernels.seal_int4_blocks(tensors, plan.seal_chunk_ids, full, self.block_size, group))

    # --- reads -----------------------------------------------------------------------------------------
    @property
    def stores_exactly(self) -> bool:
        """K/V are stored as they are, in the activation dtype: reading them back gives what was written."""
        return self._plain

    @property
    def reads_in_place(self) -> bool:
        """K/V are stored as they are in fp32, bf16 or fp16 (maybe narrower than the compute dtype): the decode
        kernel may read the blocks in place, widening on load."""
        return self._raw

    def _quantized_kernel_kind(self) -> int:
        """Which quantized layout the decode kernel can read in place: 1 int8, 2 int4 (KIVI, staged tails
        included), 3 fp8, 0 none (``reads_in_place`` storage, or a layout it does not know)."""
        key, value = type(self.codec.key), type(self.codec.value)  # these classes exactly: their planes
        if key is Int8PerToken and value is Int8PerToken:
            return 1
        if key is Fp8PerToken and value is Fp8PerToken:
            return 3
        groups = self.v_planes["scale"].shape[-1] if value is Int4PerTokenGroup else 0
        if key is Int4PerChannel and 1 <= groups <= 64 and self.stage_dtype == torch.bfloat16:
            return 2  # the kernel decodes at most 64 value groups per token
        return 0

    def layer_planes(
        self, layer: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """One layer's K and V planes in the codec's order (data, scale, zero[, meta]), (num_blocks, nkv, ...)
        each, and its staging stores (entries, nkv, bs, hd), empty when nothing was ever staged."""
        staged = self._stage_k.dim() > 1
        return (
            *self._layer_planes[layer],
            self._stage_k[layer] if staged else self._stage_k,
            self._stage_v[layer] if staged else self._stage_v,
        )

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V blocks, (num_blocks, nkv, bs, hd) each (``reads_in_place`` storage only)."""
        return self._at(self.k_planes["x"], layer), self._at(self.v_planes["x"], layer)

    def block_read(self, block_ids: torch.Tensor) -> BlockRead:
        """A read of ``block_ids`` (B, nb) (a layered cache's pages), where ids >= num_pages name staging
        entries."""
        num_seqs, num_blocks = block_ids.shape
        staged = block_ids >= self.num_pages
        has_staged = self.codec.is_staged and bool(staged.any())
        ids = block_ids.masked_fill(staged, 0) if has_staged else block_ids
        heads = torch.arange(self.num_kv_heads).view(1, -1, 1)
        chunk_ids = (ids.unsqueeze(1) * self.num_kv_heads + heads).flatten()  # (B, nkv, nb) order
        read = BlockRead(chunk_ids, num_seqs, num_blocks)
        if has_staged:
            read.stage_seq, read.stage_block = staged.nonzero(as_tuple=True)
            read.stage_idx = block_ids[read.stage_seq, read.stage_block] - self.num_pages
        return read

    def gather(self, layer: int, read: BlockRead) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks, decoded: (B, nkv, nb * bs, hd) each, in the cache's compute dtype."""
        out = []
        shape = (read.num_seqs, self.num_kv_heads, read.num_blocks, self.block_size, self.head_dim)
        for planes, codec, stage in (
            (self.k_planes, self.codec.key, self._stage_k),
            (self.v_planes, self.codec.value, self._stage_v),
        ):
            picked = {
                name: _select(self._at(p, layer).flatten(0, 1), read.chunk_ids) for name, p in planes.items()
            }
            x = codec.decode(picked, self.dtype).view(shape)
            if read.stage_idx is not None:
                x[read.stage_seq, :, read.stage_block] = stage[layer][read.stage_idx].to(
                    x.dtype
                )  # (S, nkv, bs, hd)
            out.append(x.flatten(2, 3))
        return out[0], out[1]

    # --- eviction ---------------------------------------------------------------------------------------
    def compact(self, before: Sequence[int], after: Sequence[int], source: torch.Tensor) -> int:
        """Per-lane compaction after KV eviction (lane = one layer's one KV head, ``layer * nkv + head``):
        slot ``j`` of table ``after`` gets, in each lane, what slot ``source[lane, j]`` of table ``before``
        held. ``source`` (L * nkv, n) is increasing in each row; slot ``j`` with ``source[:, j] == j`` and the
        same block in both tables is not copied. Every plane moves (data, scales, zero points); a staged
        codec's unfilled block lives in staging, which belongs to the request and does not move.
        Returns the number of (layer, block, head) chunks copied."""
        if self.layered:
            raise ValueError("a layered cache compacts through move_chunks (kv.eviction packs its pages)")
        nkv = self.num_kv_heads
        lanes, n = source.shape
        if lanes != self.num_layers * nkv:
            raise ValueError(f"compact: {lanes} lanes, the cache has {self.num_layers} x {nkv}")
        old = torch.tensor(list(before), dtype=torch.long)
        new = torch.tensor(list(after[:n]), dtype=torch.long)
        layer = torch.arange(self.num_layers).repeat_interleave(nkv).unsqueeze(1) * self.num_blocks
        head = torch.arange(nkv).repeat(self.num_layers).unsqueeze(1)
        src = (layer + old[source]) * nkv + head  # chunk ids, (lanes, n)
        dst = (layer + new.unsqueeze(0)) * nkv + head
        return self.move_chunks(src.flatten(), dst.flatten())

    def move_chunks(self, src: torch.Tensor, dst: torch.Tensor) -> int:
        """Copy chunks (one page's one head: chunk id = page * nkv + head of the flat pool) ``src`` to ``dst``,
        every plane, all read before any is written (a chunk may be both a source and a destination).
        Returns the number copied."""
        moved = src != dst
        src, dst = src[moved].to(self.device), dst[moved].to(self.device)
        if src.numel():
            for plane in (*self.k_planes.values(), *self.v_planes.values()):
                flat = plane.flatten(0, 2)  # (L * num_blocks * nkv, *chunk)
                _copy(flat, dst, _select(flat, src))
        return int(src.numel())

    def block_chunks(self, blocks: Sequence[int]) -> torch.Tensor:
        """Every chunk id (``move_chunks``') of whole blocks: each layer's page, each head."""
        pages = torch.arange(self.num_layers).unsqueeze(1) * self.num_blocks + torch.tensor(list(blocks))
        return (pages.unsqueeze(2) * self.num_kv_heads + torch.arange(self.num_kv_heads)).flatten()

    # --- debug checks ----------------------------------------------------------------------------------
    def debug_report(self) -> dict:
        return {
            "codec": self.codec.name,
            "bytes_per_token": self.bytes_per_token,
            "num_blocks": self.num_blocks,
            "pool_bytes": self.nbytes,
            "staging_bytes": self.staging_nbytes,
            "num_staged_blocks": self.num_staged,
            **self.monitor.report(),
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
