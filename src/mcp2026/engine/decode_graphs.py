"""Decode steps replayed from CUDA graphs: the whole forward of a decode-only step (every layer, attention
and the lm_head included) captured once per batch-size bucket, so a step costs one graph launch instead of
hundreds of kernel launches, each started from Python.

A graph replays fixed addresses and shapes, so each step's inputs go into persistent buffers: token ids,
positions, KV lengths, the rows each new K/V lands in, and block tables padded to the longest context the
engine admits. All of them sit in one host buffer (pinned) and one device buffer, so a step's inputs travel
in one copy. A batch is padded up to its bucket by repeating its last sequence: the copies compute the same
K/V into the same rows (the same values written twice) and their logits are dropped. The attention kernel
takes its loop bounds from the lengths buffer, so one graph serves every context length.

A bucket is captured the first time a step of its size runs, with that step's own inputs in the buffers:
the warm-up passes before capture then write exactly the K/V the step writes, so capturing never disturbs
the cache. ``capture=False`` runs the same buffers and padding eagerly (how CPU tests check this logic).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mcp2026.engine.output import ScheduledChunk
from mcp2026.kv.manager import cdiv
from mcp2026.kv.paged_cache import PagedKVCache
from mcp2026.kv.write_plan import WritePlan
from mcp2026.models.attention import AttentionMetadata, ForwardContext

# Batch sizes with a graph of their own; a step takes the smallest that holds it (vLLM's spacing: fine at
# small batches, where padding costs the most relative time).
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


# quantized KV layouts written one row per token and head (int8, fp8: ``PagedKVCache.quantized_kernel_kind``);
# whether this device's decode kernel reads them is the runner's fused_decode
PER_TOKEN_KINDS = (1, 3)


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    return tuple(sorted({b for b in BUCKETS if b < max_batch} | {max_batch}))


def graphable(cache: PagedKVCache) -> bool:
    """Whether a decode step over this cache can be captured: one row write per token and head (K/V as they
    are, or int8 / fp8 rows encoded on the device) into one pool shared by all layers, read in place by the
    decode kernels; staged (int4) and per-layer caches run eagerly."""
    per_token = cache.stores_exactly or cache.quantized_kernel_kind in PER_TOKEN_KINDS
    return per_token and not cache.layered and not cache.codec.is_staged


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        cache: PagedKVCache,
        max_batch: int,
        max_model_len: int,
        capture: bool = True,
    ) -> None:
        if not graphable(cache):
            raise ValueError(
                "decode graphs need a cache of per-token K/V rows (float, int8 or fp8) in one pool (see graphable)"
            )
        self.model, self.cache = model, cache
        self.capture = capture
        self.device = cache.device
        self.buckets = buckets_up_to(max_batch)
        self.max_batch = max_batch
        self.block_size, self.num_kv_heads = cache.block_size, cache.num_kv_heads
        self.width = cdiv(max_model_len, cache.block_size)  # table entries per sequence
        n, nkv = max_batch, self.num_kv_heads
        sizes = {"ids": n, "positions": n, "lengths": n, "rows": n * nkv, "tables": n * self.width}
        total = sum(sizes.values())
        pin = self.device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.long, pin_memory=pin)
        self._dev = torch.zeros(total, dtype=torch.long, device=self.device)
        self._host_np = self._host.numpy()
        self._views: dict[str, tuple[np.ndarray, torch.Tensor]] = {}
        offset = 0
        for name, size in sizes.items():
            self._views[name] = (self._host_np[offset : offset + size], self._dev[offset : offset + size])
            offset += size
        self._tables_offset = total - sizes["tables"]
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self._pool = None
        self.num_runs = 0  # steps run through the buffers (graph replays, or eager ones with capture=False)

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def accepts(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """A step of decodes only (one new token each, every one sampling), within the largest bucket."""
        return 0 < len(chunks) <= self.max_batch and all(
            len(c.token_ids) == 1
            and c.start_pos > 0
            and c.samples
            and not c.wants_all_logits
            and c.kv_start < self.width * self.block_size
            for c in chunks
        )

    def _fill(self, decodes: Sequence[ScheduledChunk], bucket: int) -> None:
        bs, nkv = self.block_size, self.num_kv_heads
        chunks = list(decodes) + [decodes[-1]] * (bucket - len(decodes))  # padding repeats the last sequence
        slots = np.fromiter((c.kv_start for c in chunks), np.int64, bucket)
        self._views["ids"][0][:bucket] = [c.token_ids[0] for c in chunks]
        self._views["positions"][0][:bucket] = [c.start_pos for c in chunks]
        self._views["lengths"][0][:bucket] = slots + 1
        tables = self._views["tables"][0].reshape(self.max_batch, self.width)
        last = np.empty(bucket, np.int64)  # the block each new token lands in
        for b, c in enumerate(chunks):
            n = int(slots[b]) // bs + 1
            tables[b, :n] = c.block_table[:n]
            last[b] = c.block_table[n - 1]
        rows = self._views["rows"][0].reshape(self.max_batch, nkv)
        rows[:bucket] = (last[:, None] * nkv + np.arange(nkv)) * bs + (slots % bs)[:, None]
        end = self._tables_offset + bucket * self.width
        self._dev[:end].copy_(self._host[:end], non_blocking=True)

    def _forward(self, bucket: int) -> torch.Tensor:
        dev = {k: v[1] for k, v in self._views.items()}
        meta = AttentionMetadata(
            WritePlan(rows=dev["rows"][: bucket * self.num_kv_heads]), self.block_size, num_decodes=bucket
        )
        meta.decode_tables = dev["tables"].view(self.max_batch, self.width)[:bucket]
        meta.decode_lengths = dev["lengths"][:bucket]
        hidden = self.model(dev["ids"][:bucket], dev["positions"][:bucket], ForwardContext(meta, self.cache))
        return self.model.compute_logits(hidden)

    def _capture(self, bucket: int) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(
            stream
        ):  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the graph
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bucket)
        self._pool = graph.pool()
        self._graphs[bucket] = (graph, logits)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def run(self, decodes: Sequence[ScheduledChunk]) -> torch.Tensor:
        """The step's logits (B, V) float32, row i for ``decodes[i]``: valid until the next ``run``."""
        bucket = self.bucket(len(decodes))
        self._fill(decodes, bucket)
        self.num_runs += 1
        if not self.capture:
            return self._forward(bucket)[: len(decodes)]
        if bucket not in self._graphs:
            self._capture(bucket)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[: len(decodes)]
