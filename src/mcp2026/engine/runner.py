"""The runner executes a SchedulerOutput: one forward over a mixed batch of decode tokens and prefill
chunks reading K/V through block tables, and logits only for the chunks that sample. It holds no policy.

After KV eviction a table holds fewer tokens than the request has computed (``ScheduledChunk.kv_offset``):
the runner reads and writes slots (``kv_start`` on), while RoPE gets the true positions; a chunk's mask over
the cache only needs slot order (every cached token precedes the chunk). When asked (``ScoringSpec``), it
returns each slot's attention mass per layer and KV head.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mcp2026.engine.decode_graphs import DecodeGraphs, graphable
from mcp2026.engine.drafting import draft_rows
from mcp2026.engine.output import ScheduledChunk, SchedulerOutput
from mcp2026.kernels import gpu, ops
from mcp2026.kv.eviction import ScoringSpec, StepScores
from mcp2026.kv.layer_pages import LayerPages, LayerTable
from mcp2026.kv.manager import cdiv
from mcp2026.kv.paged_cache import BlockRead, PagedKVCache
from mcp2026.models.attention import (
    AttentionMetadata,
    ForwardContext,
    PrefillSlice,
    WindowView,
    reads_staged_apart,
)


def sliding_windows(model: nn.Module) -> list[int]:
    """The distinct sliding windows of the model's layers (``ModelConfig.attention_window``), smallest first."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    windows = {config.attention_window(layer) for layer in range(config.num_layers)}
    return sorted(w for w in windows if w is not None)


def _in_window(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(q, k) bool: key position <= query position, and within the query's last ``window`` positions."""
    attend = key_pos.unsqueeze(0) <= query_pos
    return attend if window is None else attend & (key_pos.unsqueeze(0) > query_pos - window)


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        cache: PagedKVCache,
        scoring: ScoringSpec | None = None,
        layer_pages: LayerPages | None = None,
    ) -> None:
        if cache.layered and layer_pages is None:
            raise ValueError("a layered KV cache (per-layer budgets) needs the evictor's LayerPages")
        self.model = model
        self.cache = cache
        # per-layer budgets: each layer reads and writes its own pages (kv.layer_pages)
        self.layer_pages = layer_pages if cache.layered else None
        self.device = cache.device
        self.block_size = cache.block_size
        # logits of every row of the chunks that asked for them (prompt logprobs), by request; the engine
        # takes them after each step
        self.chunk_logits: dict[str, torch.Tensor] = {}
        self.num_layers, self.num_kv_heads = cache.num_layers, cache.num_kv_heads
        self.scoring = scoring or ScoringSpec()
        # decode attention by the fused kernel (blocks read in place, quantized ones decoded as they are read,
        # int4's staged tails included) where the storage and device allow
        # (the GPU kernel reads float, int8 and fp8 blocks and sums no per-block scores)
        readable = (
            (cache.reads_in_place or cache.quantized_kernel_kind in gpu.quantized_kv_kinds(cache.device))
            and not self.scoring.decode
            if cache.device.type == "cuda"
            else cache.reads_in_place or cache.quantized_kernel_kind > 0
        )
        self.fused_decode = readable and ops.decode_kernel_available(cache.device, cache.dtype)
        # sliding-window layers read their window's blocks by position: eviction (slots that are not positions)
        # and per-layer pages would need windows over what each layer kept
        self.windows = sliding_windows(model)
        self._check_windows()
        self._scores: list[StepScores] = []
        self.graphs: DecodeGraphs | None = None

    def _check_windows(self) -> None:
        if not self.windows:
            return
        if self.layer_pages is not None or self.scoring.decode or self.scoring.observe_window:
            raise ValueError(
                "sliding-window attention runs without KV eviction: use KVCompressor(policy='none') with this "
                "model (its window already bounds what the sliding layers read)"
            )
        if self.cache.codec.is_staged and self.windows[0] < self.block_size:
            raise ValueError(
                f"a staged KV codec (int4) needs blocks no larger than the smallest sliding window "
                f"({self.windows[0]} positions), got block_size {self.block_size}: lower the block size"
            )

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> str | None:
        """Run decode-only steps of up to ``max_batch`` sequences through ``DecodeGraphs`` (``capture=False``:
        the same buffers, eagerly). Returns why not where this runner's cache or kernels cannot."""
        if self.windows:
            return "the model has sliding-window layers (graphs read every sequence's whole context)"
        if getattr(getattr(self.model, "config", None), "num_experts", 0):
            return (
                "the model routes tokens to experts (each layer reads its expert group sizes on the host: a "
                "captured graph would replay the first step's routing)"
            )
        if not graphable(self.cache):
            return (
                "the KV cache is staged (int4), per-layer or of a codec the decode kernels do not read in "
                "place (graphs need float, int8 or fp8 K/V rows in one pool)"
            )
        if not self.fused_decode:
            return "no decode kernel reads the paged blocks in place here (on CUDA: pip install triton)"
        if self.scoring.decode:
            return "the eviction policy scores every decode step's attention"
        self.graphs = DecodeGraphs(self.model, self.cache, max_batch, max_model_len, capture=capture)
        return None

    def take_scores(self) -> list[StepScores]:
        """Block attention mass of the steps run since the last call (empty unless scoring is on)."""
        scores, self._scores = self._scores, []
        return scores

    def _staged_id(self, request_id: str, stage_after: dict[str, int | None]) -> int | None:
        idx = stage_after.get(request_id)
        return None if idx is None else self.cache.num_pages + idx

    def _decode_metadata(
        self, meta: AttentionMetadata, decodes: list[ScheduledChunk], stage_after: dict[str, int | None]
    ) -> list[int]:
        """Fill the decode fields; returns the slots each sequence reads."""
        bs = self.block_size
        starts = torch.tensor([c.kv_start for c in decodes])
        num_slots = [c.kv_start // bs + 1 for c in decodes]
        tables = _pad([c.block_table[:n] for c, n in zip(decodes, num_slots)], 0)  # (B, nb)
        staged = [self._staged_id(c.request_id, stage_after) for c in decodes]
        for b, idx in enumerate(staged):
            if idx is not None:
                tables[b, num_slots[b] - 1] = idx
        width = tables.shape[1]
        lengths = starts + 1
        if self.scoring.decode:
            meta.decode_mass = torch.zeros(self.num_layers, len(decodes), self.num_kv_heads, width)
        if self._decodes_fused(staged):
            meta.decode_tables, meta.decode_lengths = tables, lengths
            return num_slots
        meta.decode_read = self.cache.block_read(tables)
        meta.decode_bias = self._pad_bias(lengths, width)
        return num_slots

    def _decode_window(
        self, decodes: list[ScheduledChunk], stage_after: dict[str, int | None], window: int, in_place: bool
    ) -> tuple[BlockRead | None, torch.Tensor | None, torch.Tensor] | None:
        """Each decode's first position in the window (the query at position p sees p - window + 1 .. p) and,
        unless the decodes read the cache in place (``in_place``), the read and bias (B, 1, 1, nb * bs) of the
        blocks holding their last ``window`` positions; None when every decode fits in the window."""
        if all(c.kv_start < window for c in decodes):
            return None
        starts = torch.tensor([max(0, c.kv_start - window + 1) for c in decodes], dtype=torch.int64)
        if in_place:
            return None, None, starts
        bs = self.block_size
        rows, firsts, lengths = [], [], []
        for c in decodes:
            first = max(0, c.kv_start - window + 1)  # slots are positions: no eviction with windows
            first_block = first // bs
            row = list(c.block_table[first_block : c.kv_start // bs + 1])
            staged = self._staged_id(c.request_id, stage_after)
            if staged is not None:
                row[-1] = staged
            rows.append(row)
            firsts.append(first - first_block * bs)
            lengths.append(c.kv_start - first_block * bs + 1)
        tables = _pad(rows, 0)  # (B, nb)
        key = torch.arange(tables.shape[1] * bs).unsqueeze(0)
        hidden = (key < torch.tensor(firsts).unsqueeze(1)) | (key >= torch.tensor(lengths).unsqueeze(1))
        bias = torch.zeros(hidden.shape, dtype=self.cache.dtype).masked_fill_(hidden, float("-inf"))
        return self.cache.block_read(tables), bias[:, None, None, :], starts

    def _window_view(
        self,
        decodes: list[ScheduledChunk],
        prefills: list[ScheduledChunk],
        stage_after: dict[str, int | None],
        window: int,
        in_place: bool,
    ) -> WindowView | None:
        """What the layers sliding over ``window`` read this step; None when no sequence outgrew it. ``in_place``:
        the step's decodes read the cache in place (the paged kernel takes the window's starts)."""
        decode = self._decode_window(decodes, stage_after, window, in_place) if decodes else None
        q_start, slices = len(decodes), []
        for c in prefills:
            outgrown = c.kv_start + c.num_tokens > window
            slices.append(self._prefill_view(c, q_start, stage_after, window) if outgrown else None)
            q_start += c.num_tokens
        if decode is None and all(p is None for p in slices):
            return None
        read, bias, starts = decode or (None, None, None)
        return WindowView(read, bias, slices, starts)

    def _decodes_fused(self, staged: list[int | None]) -> bool:
        """Whether the step's decodes run in the fused kernel (the quantized one reads staged tails too)."""
        return self.fused_decode and (
            bool(self.cache.quantized_kernel_kind) or all(idx is None for idx in staged)
        )

    def _pad_bias(self, lengths: torch.Tensor, width: int) -> torch.Tensor | None:
        """(..., 1, 1, width * bs) additive bias hiding each row's keys past its length (``lengths`` (...,));
        None when no row is short."""
        pad = torch.arange(width * self.block_size) >= lengths.unsqueeze(-1)
        if not bool(pad.any()):
            return None
        bias = torch.zeros(pad.shape, dtype=self.cache.dtype).masked_fill_(pad, float("-inf"))
        return bias.unsqueeze(-2).unsqueeze(-2)

    def _decode_metadata_layered(
        self,
        meta: AttentionMetadata,
        decodes: list[ScheduledChunk],
        stage_after: dict[str, int | None],
        tables_of: dict[str, LayerTable],
    ) -> list[int]:
        """``_decode_metadata`` with per-layer tables (L, B, nb) and lengths (L, B): layer ``l`` of a sequence
        reads its own slots, ``shift[l]`` blocks fewer than the uniform view's. Returns the uniform slots read."""
        bs, num_layers = self.block_size, self.num_layers
        layer_tables = [tables_of[c.request_id] for c in decodes]
        num_slots = [c.kv_start // bs + 1 for c in decodes]
        slots = torch.tensor(num_slots).unsqueeze(0) - torch.stack([t.shift for t in layer_tables], dim=1)
        width = int(slots.max())
        tables = torch.zeros(num_layers, len(decodes), width, dtype=torch.long)
        staged = [self._staged_id(c.request_id, stage_after) for c in decodes]
        for b, (lt, idx) in enumerate(zip(layer_tables, staged)):
            w = min(width, lt.pages.shape[1])
            tables[:, b, :w] = lt.pages[:, :w]
            if idx is not None:
                tables[torch.arange(num_layers), b, slots[:, b] - 1] = idx
        offsets = torch.tensor([c.kv_start % bs for c in decodes]).unsqueeze(0)
        lengths = (slots - 1) * bs + offsets + 1  # (L, B)
        if self.scoring.decode:
            meta.decode_mass = torch.zeros(num_layers, len(decodes), self.num_kv_heads, width)
        if self._decodes_fused(staged):
            meta.decode_tables, meta.decode_lengths = tables, lengths
            return num_slots
        meta.decode_read = [self.cache.block_read(tables[layer]) for layer in range(num_layers)]
        meta.decode_bias = self._pad_bias(lengths, width)  # (L, B, 1, 1, nb * bs)
        return num_slots

    def _prefill_slice_layered(
        self, c: ScheduledChunk, q_start: int, stage_after: dict[str, int | None], lt: LayerTable
    ) -> tuple[PrefillSlice, int | None]:
        """``_prefill_slice`` per layer: each reads its own pages, ``shift[l]`` blocks fewer slots (the first
        chunk in an exact cache reads nothing, alike in every layer). Masks are shared between layers with the
        same shift; scores go to one (L, nkv, widest layer's slots) tensor."""
        if c.kv_start == 0 and self.cache.stores_exactly:  # reads no cache
            return self._prefill_slice(c, q_start, stage_after)
        bs, end = self.block_size, c.kv_start + c.num_tokens
        by_shift: dict[int, PrefillSlice] = {}
        layers: list[PrefillSlice] = []
        observed_slots = None
        for layer in range(self.num_layers):
            shift = int(lt.shift[layer])
            ids = lt.pages[layer, : cdiv(end, bs) - shift].tolist()
            own = dataclasses.replace(c, block_table=ids, kv_offset=c.kv_offset + shift * bs)
            if shift not in by_shift:
                by_shift[shift], observed_slots = self._prefill_slice(own, q_start, stage_after)
                layers.append(by_shift[shift])
                continue
            staged = self._staged_id(c.request_id, stage_after)
            if staged is not None:
                ids[-1] = staged
            read = self.cache.block_read(torch.tensor([ids], dtype=torch.long))
            layers.append(dataclasses.replace(by_shift[shift], context=read))
        first = layers[0]
        parent = PrefillSlice(q_start, c.num_tokens, None, None, per_layer=layers)
        if observed_slots is None:
            return parent, None
        width = max(p.mass.shape[-1] for p in layers)
        parent.mass = torch.zeros(self.num_layers, self.num_kv_heads, width)
        parent.num_observed = first.num_observed
        for p in layers:
            p.mass = parent.mass[:, :, : p.context.num_blocks]
        return parent, cdiv(end, bs)

    def _prefill_slice(
        self, c: ScheduledChunk, q_start: int, stage_after: dict[str, int | None]
    ) -> tuple[PrefillSlice, int | None]:
        """A prefill chunk's slice; with scoring, also the number of slots observed."""
        bs = self.block_size
        end = c.kv_start + c.num_tokens  # slot positions
        spec = self.scoring
        num_observed = 0
        if spec.observe_window and (spec.observe_every_chunk or c.samples):
            num_observed = min(spec.observe_window, c.num_tokens)
        p = self._prefill_view(c, q_start, stage_after, None)
        if not num_observed:
            return p, None
        num_slots = cdiv(end, bs)
        key_pos = torch.arange(end if p.context is None else num_slots * bs)
        p.num_observed = num_observed
        p.observe_mask = key_pos.unsqueeze(0) <= torch.arange(end - num_observed, end).unsqueeze(1)
        p.mass = torch.zeros(self.num_layers, self.num_kv_heads, num_slots)
        return p, num_slots

    def _prefill_view(
        self, c: ScheduledChunk, q_start: int, stage_after: dict[str, int | None], window: int | None
    ) -> PrefillSlice:
        """A prefill chunk's slice over the whole context (``window`` None) or, for layers sliding over
        ``window``, over the blocks from the first one its first query sees, each query masked to its window."""
        bs = self.block_size
        start, end = c.kv_start, c.kv_start + c.num_tokens  # slot positions
        query_pos = torch.arange(start, end).unsqueeze(1)
        if start == 0 and self.cache.stores_exactly:
            # the chunk's fresh K/V are what the cache holds; any other cache's first chunk reads back what it
            # stored, like every later chunk and every decode: a token's K/V then depend on the stored K/V before
            # it, not on where a chunk started (batched runs equal one-at-a-time ones; a prefix hit holds what a
            # fresh prefill stores)
            if window is None:
                return PrefillSlice(q_start, c.num_tokens, None, None)
            mask = self._additive(_in_window(torch.arange(end), query_pos, window))
            return PrefillSlice(q_start, c.num_tokens, None, mask, windowed=True)
        first_block = 0 if window is None else max(0, start - window + 1) // bs
        ids = list(c.block_table[first_block : cdiv(end, bs)])
        staged = self._staged_id(c.request_id, stage_after)
        if staged is not None:
            ids[-1] = staged
        key_pos = torch.arange(first_block * bs, cdiv(end, bs) * bs)
        read = self.cache.block_read(torch.tensor([ids], dtype=torch.long))
        if self.cache.codec.is_staged:
            return self._staged_view_slice(c, q_start, read, key_pos, query_pos, window)
        mask = self._additive(_in_window(key_pos, query_pos, window))  # (q_len, ctx)
        return PrefillSlice(q_start, c.num_tokens, read, mask, kv_start=start, windowed=window is not None)

    def _staged_view_slice(
        self,
        c: ScheduledChunk,
        q_start: int,
        read: BlockRead,
        key_pos: torch.Tensor,
        query_pos: torch.Tensor,
        window: int | None = None,
    ) -> PrefillSlice:
        """A staged codec's prefill slice: each query reads the blocks before its own as stored (sealed) and
        its own block as staged, as a decode step would (``attention._staged_keys``; the token that fills
        a block reads it sealed, as its decode step would); so a token's K/V do not depend on where a chunk
        started, and a block of generated tokens holds what a prefill stores."""
        bs, start = self.block_size, c.kv_start
        first = start // bs * bs  # the chunk's first block starts here; its tokens before start are staged
        num_prior = start - first
        entry = self.cache.stage_index(c.request_id) if num_prior else None
        if num_prior and entry is None:
            raise RuntimeError(f"request {c.request_id}: {num_prior} staged tokens expected, none staged")
        # where the query's staged block starts: its own block's, except for the token that fills a block,
        # which decode reads sealed (its step seals the block before attending)
        staged_from = (query_pos + 1) // bs * bs  # (q_len, 1)
        sealed = key_pos.unsqueeze(0) < staged_from
        attend = _in_window(key_pos, query_pos, window) & sealed
        apart = reads_staged_apart(self.cache.device)
        if not apart:  # then the staged keys follow in the same call
            staged_pos = torch.arange(first, start + c.num_tokens)
            own = _in_window(staged_pos, query_pos, window) & (staged_pos.unsqueeze(0) >= staged_from)
            attend = torch.cat((attend, own), dim=1)
        # apart, each query's own staged block is read whole up to itself: within its window, which is
        # no smaller than a block (``_check_windows``)
        return PrefillSlice(
            q_start,
            c.num_tokens,
            read,
            self._additive(attend),
            kv_start=start,
            stage_entry=entry or 0,
            num_prior=num_prior,
            staged_apart=apart,
            windowed=window is not None,
        )

    def _additive(self, attend: torch.Tensor) -> torch.Tensor:
        """A bool attention mask (True = attend) as SDPA adds it: 0 / -inf in the cache's compute dtype."""
        return torch.zeros(attend.shape, dtype=self.cache.dtype).masked_fill_(~attend, float("-inf"))

    def _metadata(
        self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]
    ) -> tuple[AttentionMetadata, list[tuple[list[str], torch.Tensor, int | None]]]:
        chunks = decodes + prefills
        tables_of = (
            {c.request_id: self.layer_pages.table(c.request_id, c.block_table) for c in chunks}
            if self.layer_pages is not None
            else None
        )
        write = self.cache.plan_write(
            [
                (
                    c.request_id,
                    c.kv_start,
                    c.num_tokens,
                    c.block_table if tables_of is None else tables_of[c.request_id],
                )
                for c in chunks
            ]
        )
        meta = AttentionMetadata(
            write, self.block_size, num_decodes=len(decodes), layered=tables_of is not None
        )
        observed = []  # (request ids, slots observed, prefill slice number or None for decodes)
        if decodes:
            if tables_of is None:
                num_slots = self._decode_metadata(meta, decodes, write.stage_after)
            else:
                num_slots = self._decode_metadata_layered(meta, decodes, write.stage_after, tables_of)
            if meta.decode_mass is not None:
                observed.append(([c.request_id for c in decodes], num_slots, None))
        q_start = len(decodes)
        for c in prefills:
            if tables_of is None:
                p, num_slots = self._prefill_slice(c, q_start, write.stage_after)
            else:
                p, num_slots = self._prefill_slice_layered(
                    c, q_start, write.stage_after, tables_of[c.request_id]
                )
            meta.prefills.append(p)
            if num_slots is not None:
                observed.append(([c.request_id], [num_slots], len(meta.prefills) - 1))
            q_start += c.num_tokens
        # the CPU kernel starts at a window; the GPU's gathers the window's blocks
        in_place = (
            self.device.type == "cpu"
            and meta.decode_tables is not None
            and self.cache.reads_in_place
            and meta.decode_mass is None
        )
        for window in self.windows:
            view = self._window_view(decodes, prefills, write.stage_after, window, in_place)
            if view is not None:
                meta.windows[window] = view
        return meta, observed

    def _collect_scores(self, meta: AttentionMetadata, observed: list) -> None:
        for request_ids, num_slots, i in observed:
            if i is None:  # (L, B, nkv, nb) -> (B, lanes, nb)
                mass = meta.decode_mass.cpu().permute(1, 0, 2, 3).flatten(1, 2)
            else:
                p = meta.prefills[i]
                mass = (p.mass.cpu() / p.num_observed).flatten(0, 1).unsqueeze(0)
            self._scores.append(StepScores(request_ids, num_slots, mass))

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, all_logits: bool = False) -> tuple[list[str], torch.Tensor]:
        """Run the step; returns the request ids that sample and their logits (N, V) float32, in that order:
        ``num_sample_rows`` rows per request (one, or one plus one per draft token).
        ``all_logits`` (teacher-forced evaluation): logits of every token, (T, V) in chunk order, and no ids."""
        if self.graphs is not None and not all_logits and self.graphs.accepts(output.chunks):
            return [c.request_id for c in output.chunks], self.graphs.run(output.chunks)
        decodes, prefills, units = [], [], []  # units: (chunk, its tokens in the batch), in batch order
        for c in output.chunks:
            if c.num_draft_tokens:
                decodes += draft_rows(c)
                units.append((c, c.num_tokens))
            elif c.is_decode:
                decodes.append(c)
                units.append((c, 1))
        for c in output.chunks:
            if not c.is_decode:
                prefills.append(c)
                units.append((c, c.num_tokens))
        chunks = decodes + prefills
        host_meta, observed = self._metadata(decodes, prefills)
        meta = host_meta.to(self.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        positions = torch.tensor(
            [p for c in chunks for p in range(c.start_pos, c.start_pos + len(c.token_ids))], dtype=torch.long
        )
        ids, positions = ids.to(self.device), positions.to(self.device)
        hidden = self.model(ids, positions, ForwardContext(meta, self.cache))
        self.cache.commit(host_meta.write)
        if observed:
            self._collect_scores(meta, observed)
        if all_logits:
            return [], self.model.compute_logits(hidden)
        rows, sample_ids, end = [], [], 0
        for c, num_tokens in units:
            if c.wants_all_logits:
                self.chunk_logits[c.request_id] = self.model.compute_logits(hidden[end : end + c.num_tokens])
            end += num_tokens
            if c.samples:
                rows.extend(range(end - c.num_sample_rows, end))
                sample_ids.append(c.request_id)
        if not rows:
            return [], torch.empty(0)
        if len(rows) == hidden.shape[0]:  # rows ascend: every row samples (a decode-only step), no gather
            return sample_ids, self.model.compute_logits(hidden)
        return sample_ids, self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
