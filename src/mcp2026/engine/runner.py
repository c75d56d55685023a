"""The runner executes a SchedulerOutput: one forward over a mixed batch of decode tokens and prefill
chunks reading K/V through block tables, and logits only for the chunks that sample. It holds no policy.

Block tables may have holes (``kv.manager.HOLE``: evicted blocks); the runner reads only live blocks, with
masks built from the true positions, and, when asked (``ScoringSpec``), returns each block's attention mass.
"""

from __future__ import annotations

import torch
from torch import nn

from mcp2026.engine.attention import AttentionMetadata, ForwardContext, PrefillSlice
from mcp2026.engine.output import ScheduledChunk, SchedulerOutput
from mcp2026.kernels import ops
from mcp2026.kv.eviction import ScoringSpec, StepScores
from mcp2026.kv.manager import HOLE, cdiv
from mcp2026.kv.paged_cache import PagedKVCache


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


class ModelRunner:
    def __init__(self, model: nn.Module, cache: PagedKVCache, scoring: ScoringSpec | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.scoring = scoring or ScoringSpec()
        # decode attention by the fused kernel (blocks read in place) where the storage and device allow
        self.fused_decode = cache.reads_in_place and ops.decode_kernel_available(cache.device, cache.dtype)
        self._scores: list[StepScores] = []

    def take_scores(self) -> list[StepScores]:
        """Block attention mass of the steps run since the last call (empty unless scoring is on)."""
        scores, self._scores = self._scores, []
        return scores

    def _staged_id(self, request_id: str, stage_after: dict[str, int | None]) -> int | None:
        idx = stage_after.get(request_id)
        return None if idx is None else self.cache.num_blocks + idx

    def _decode_metadata(
        self, meta: AttentionMetadata, decodes: list[ScheduledChunk], stage_after: dict[str, int | None]
    ) -> torch.Tensor:
        """Fill the decode fields; returns the table index of every read block, (B, nb), -1 = padding."""
        bs = self.block_size
        starts = torch.tensor([c.start_pos for c in decodes])
        tables = _pad([c.block_table[: c.start_pos // bs + 1] for c in decodes], HOLE)  # (B, nb)
        is_live = tables != HOLE
        num_live = is_live.sum(1)
        if bool((num_live < starts // bs + 1).any()):  # holes: live blocks first, in table order
            order = torch.argsort((~is_live).to(torch.uint8), dim=1, stable=True)
            tables, is_live = tables.gather(1, order), is_live.gather(1, order)
        else:
            order = torch.arange(tables.shape[1]).expand_as(tables)
        width = int(num_live.max())
        tables, index = tables[:, :width].clone(), order[:, :width].masked_fill(~is_live[:, :width], -1)
        for b, c in enumerate(decodes):
            staged = self._staged_id(c.request_id, stage_after)
            if staged is not None:
                tables[b, int(num_live[b]) - 1] = staged
        lengths = (num_live - 1) * bs + starts % bs + 1
        if self.scoring.decode:
            meta.decode_mass = torch.zeros(tables.shape)
        if self.fused_decode and not any(
            self._staged_id(c.request_id, stage_after) is not None for c in decodes
        ):
            meta.decode_tables, meta.decode_lengths = tables, lengths
            return index
        meta.decode_read = self.cache.block_read(tables.clamp_min(0))
        if int(lengths.min()) != width * bs:
            pad = torch.arange(width * bs).unsqueeze(0) >= lengths.unsqueeze(1)  # (B, L)
            bias = torch.zeros(pad.shape, dtype=self.cache.dtype).masked_fill_(pad, float("-inf"))
            meta.decode_bias = bias[:, None, None, :]
        return index

    def _prefill_slice(
        self, c: ScheduledChunk, q_start: int, stage_after: dict[str, int | None]
    ) -> tuple[PrefillSlice, torch.Tensor | None]:
        """A prefill chunk's slice; with scoring, also the table index of each context block."""
        bs = self.block_size
        start, end = c.start_pos, c.start_pos + c.num_tokens
        spec = self.scoring
        num_observed = 0
        if spec.observe_window and (spec.observe_every_chunk or c.samples):
            num_observed = min(spec.observe_window, c.num_tokens)
        if start == 0:
            p = PrefillSlice(q_start, c.num_tokens, None, None)
            index = torch.arange(cdiv(end, bs))
            key_pos = torch.arange(end)
        else:
            live = [i for i, b in enumerate(c.block_table[: cdiv(end, bs)]) if b != HOLE]
            ids = [c.block_table[i] for i in live]
            staged = self._staged_id(c.request_id, stage_after)
            if staged is not None:
                ids[-1] = staged
            index = torch.tensor(live, dtype=torch.long)
            key_pos = (index.unsqueeze(1) * bs + torch.arange(bs)).flatten()  # (ctx,) true positions
            mask = key_pos.unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)  # (q_len, ctx)
            read = self.cache.block_read(torch.tensor([ids], dtype=torch.long))
            p = PrefillSlice(q_start, c.num_tokens, read, mask)
        if not num_observed:
            return p, None
        p.num_observed = num_observed
        p.observe_mask = key_pos.unsqueeze(0) <= torch.arange(end - num_observed, end).unsqueeze(1)
        p.mass = torch.zeros(index.numel())
        return p, index

    def _metadata(
        self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]
    ) -> tuple[AttentionMetadata, list[tuple[list[str], torch.Tensor, int | None]]]:
        chunks = decodes + prefills
        write = self.cache.plan_write(
            [(c.request_id, c.start_pos, c.num_tokens, c.block_table) for c in chunks]
        )
        meta = AttentionMetadata(write, self.block_size, num_decodes=len(decodes))
        observed = []  # (request ids, table index, prefill slice number or None for decodes)
        if decodes:
            index = self._decode_metadata(meta, decodes, write.stage_after)
            if meta.decode_mass is not None:
                observed.append(([c.request_id for c in decodes], index, None))
        q_start = len(decodes)
        for c in prefills:
            p, index = self._prefill_slice(c, q_start, write.stage_after)
            meta.prefills.append(p)
            if index is not None:
                observed.append(([c.request_id], index.unsqueeze(0), len(meta.prefills) - 1))
            q_start += c.num_tokens
        return meta, observed

    def _collect_scores(self, meta: AttentionMetadata, observed: list) -> None:
        for request_ids, index, i in observed:
            if i is None:
                mass = meta.decode_mass.cpu()
            else:
                p = meta.prefills[i]
                mass = (p.mass.cpu() / p.num_observed).unsqueeze(0)
            self._scores.append(StepScores(request_ids, index, mass))

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, all_logits: bool = False) -> tuple[list[str], torch.Tensor]:
        """Run the step; returns the request ids that sample and their logits (N, V) float32, in that order.
        ``all_logits`` (teacher-forced evaluation): logits of every token, (T, V) in chunk order, and no ids."""
        decodes = [c for c in output.chunks if len(c.token_ids) == 1 and c.start_pos > 0]
        prefills = [c for c in output.chunks if not (len(c.token_ids) == 1 and c.start_pos > 0)]
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
        for c in chunks:
            end += len(c.token_ids)
            if c.samples:
                rows.append(end - 1)
                sample_ids.append(c.request_id)
        if not rows:
            return [], torch.empty(0)
        return sample_ids, self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
