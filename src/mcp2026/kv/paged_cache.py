"""Physical KV storage for the paged cache: per layer, K and V planes indexed by block, stored by a codec.

Planar layout (all K, then all V): every plane of the codec (data, scales, zero
points) is one contiguous (num_layers, num_blocks, num_kv_heads, *chunk) tensor; a chunk is one head of one
block (``block_size`` tokens). Head-major chunks let a read gather (sequence, head, block) chunks straight into
(B, nkv, L, hd): the attention matmuls then run on contiguous operands, with no transpose of K or V.
Logical bookkeeping (which request owns which block) lives in ``kv.block_pool`` / ``kv.manager``.

Where a step's tokens go is planned by ``kv.write_plan``; staged codecs keep each request's last, not yet full
block in ``kv.staging``, and a read names a staged block by ``num_pages + staging index``. On the CPU the planes
are anonymous mmaps (``kv.pool_memory``): ``release_blocks`` hands a range of blocks back to the OS.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
from mcp2026.kv.pool_memory import allocate_plane, release_block_range
from mcp2026.kv.staging import SavedEntries, StagingStore, staging_dtype
from mcp2026.kv.write_plan import WriteChunk, WritePlan, WritePlanner


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
        # Staging store (staged codecs only): the last, unfilled block of each request in 16 bits
        self.stage_dtype = staging_dtype(self.dtype)
        self.staging = StagingStore(
            num_layers, num_kv_heads, block_size, head_dim, self.stage_dtype, self.device
        )
        self._planner = WritePlanner(
            block_size, num_kv_heads, layered, self.staging if self.codec.is_staged else None
        )
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
            tensor, buffer = allocate_plane(shape, spec.dtype, self.device)
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
        return self.staging.nbytes

    @property
    def num_staged(self) -> int:
        return self.staging.num_staged

    # --- writes ----------------------------------------------------------------------------------------
    def plan_write(self, chunks: Sequence[WriteChunk]) -> WritePlan:
        """Plan a step's writes. ``chunks``: (request id, start slot, number of tokens, block table; a layered
        cache takes each request's ``LayerTable``), the step's tokens in this order. Pure: nothing changes until
        ``commit(plan)``."""
        # A float cache (fp32, bf16, fp16) is a cast whose rounding is bounded by its format: only encoding
        # codecs are measured (a measured step takes the per-layer path, a cost the default cache need not pay)
        is_monitored = not self._raw and self.monitor.is_due()
        if self.layered and not all(isinstance(c[3], LayerTable) for c in chunks):
            raise ValueError("a layered cache writes through LayerTables (kv.layer_pages), one per request")
        return self._planner.plan(chunks, is_monitored)

    def commit(self, plan: WritePlan) -> None:
        """The step ran: apply its staging changes."""
        self.staging.commit(plan.stage_after)

    def release_requests(self, request_ids: Iterable[str]) -> None:
        """Requests finished or preempted: their staging entries are free again."""
        self.staging.release(request_ids)

    def save_staging(self, request_ids: Iterable[str]) -> SavedEntries:
        """The requests' staged tails (entry, K, V), for ``restore_staging`` after a lookahead draft."""
        return self.staging.save(request_ids)

    def restore_staging(self, saved: SavedEntries) -> None:
        self.staging.restore(saved)

    def stage_index(self, request_id: str) -> int | None:
        return self.staging.index(request_id)

    def staged_rows(self, layer: int, entry: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` staged tokens of staging ``entry``: K and V (nkv, count, hd), staging dtype.
        During a step, a request's entry from before the step keeps its rows (a sealing step stages the new
        tail elsewhere; one that does not seal appends after them)."""
        return self.staging.rows(layer, entry, count)

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
            stage_k, stage_v = self.staging.k[layer].view(-1, hd), self.staging.v[layer].view(-1, hd)
            kernels.write_kv_rows(stage_k, stage_v, plan.tail_dst, k, v)
            return True
        return False

    def _write_staged(
        self, layer: int, plan: WritePlan, planes: Planes, codec: TensorCodec, x: torch.Tensor, kind: int
    ) -> tuple[Planes | None, torch.Tensor]:
        store = self.staging.k if kind == 0 else self.staging.v
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
        return (*self._layer_planes[layer], *self.staging.layer(layer))

    def raw_planes(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer's K and V blocks, (L, num_blocks, nkv, bs, hd) each, where each layer owns its plane and
        stores K/V as they are (``reads_in_place``, not layered); else None."""
        if not self._raw or self.layered:
            return None
        return self.k_planes["x"], self.v_planes["x"]

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
            (self.k_planes, self.codec.key, self.staging.k),
            (self.v_planes, self.codec.value, self.staging.v),
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
    def release_blocks(self, start_block: int, end_block: int, free_above: bool = False) -> int:
        """Return the memory of blocks [start, end) to the OS (CPU only); they read as zeros afterwards.
        Returns the number of bytes released (whole pages inside the range, every layer and plane; with
        ``free_above``, when no block after ``end`` holds anything, also the page ``end`` falls in)."""
        if not self._buffers or end_block <= start_block:
            return 0
        planes = [*self.k_planes.values(), *self.v_planes.values()]
        return sum(
            release_block_range(b, p, start_block, end_block, free_above)
            for b, p in zip(self._buffers, planes)
        )
