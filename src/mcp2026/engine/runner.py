"""The runner executes a SchedulerOutput: one forward over a mixed batch of decode tokens and prefill
chunks reading K/V through block tables, and logits only for the chunks that sample. It holds no policy.
"""

from __future__ import annotations

import torch
from torch import nn

from mcp2026.engine.attention import AttentionMetadata, ForwardContext, PrefillSlice
from mcp2026.engine.output import ScheduledChunk, SchedulerOutput
from mcp2026.kv.paged_cache import PagedKVCache


def _slots(block_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    # block_tables: (B, nb) -> (B, length) slot of every position
    b = block_tables.shape[0]
    offsets = torch.arange(block_size, dtype=torch.long)
    return (block_tables.unsqueeze(-1) * block_size + offsets).view(b, -1)[:, :length]


def _pad(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)


class ModelRunner:
    def __init__(self, model: nn.Module, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.k.device
        self.block_size = cache.block_size

    def _metadata(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> AttentionMetadata:
        bs = self.block_size
        chunks = decodes + prefills
        slot_rows = []
        for c in chunks:
            positions = range(c.start_pos, c.start_pos + len(c.token_ids))
            slot_rows.extend(c.block_table[p // bs] * bs + p % bs for p in positions)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_rows, dtype=torch.long), num_decodes=len(decodes)
        )
        if decodes:
            lengths = torch.tensor([c.start_pos + 1 for c in decodes])
            max_len = int(lengths.max())
            meta.decode_slots = _slots(_pad([c.block_table for c in decodes]), bs, max_len)
            if int(lengths.min()) != max_len:
                pad = torch.arange(max_len).unsqueeze(0) >= lengths.unsqueeze(1)  # (B, L)
                meta.decode_slots.masked_fill_(pad, 0)  # never read unwritten slots (uninitialised memory)
                bias = torch.zeros(pad.shape, dtype=self.cache.k.dtype).masked_fill_(pad, float("-inf"))
                meta.decode_bias = bias[:, None, None, :]
        q_start = len(decodes)
        for c in prefills:
            q_len = len(c.token_ids)
            if c.start_pos == 0:
                meta.prefills.append(PrefillSlice(q_start, q_len, None, None))
            else:
                ctx_len = c.start_pos + q_len
                slots = _slots(torch.tensor([c.block_table]), bs, ctx_len)[0]
                q_pos = torch.arange(c.start_pos, ctx_len).unsqueeze(1)
                mask = torch.arange(ctx_len).unsqueeze(0) <= q_pos  # (q_len, ctx)
                meta.prefills.append(PrefillSlice(q_start, q_len, slots, mask))
            q_start += q_len
        return meta

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> tuple[list[str], torch.Tensor]:
        """Run the step; returns the request ids that sample and their logits (N, V) float32, in that order."""
        decodes = [c for c in output.chunks if len(c.token_ids) == 1 and c.start_pos > 0]
        prefills = [c for c in output.chunks if not (len(c.token_ids) == 1 and c.start_pos > 0)]
        chunks = decodes + prefills
        meta = self._metadata(decodes, prefills).to(self.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        positions = torch.tensor(
            [p for c in chunks for p in range(c.start_pos, c.start_pos + len(c.token_ids))], dtype=torch.long
        )
        ids, positions = ids.to(self.device), positions.to(self.device)
        hidden = self.model(ids, positions, ForwardContext(meta, self.cache))
        rows, sample_ids, end = [], [], 0
        for c in chunks:
            end += len(c.token_ids)
            if c.samples:
                rows.append(end - 1)
                sample_ids.append(c.request_id)
        if not rows:
            return [], torch.empty(0)
        return sample_ids, self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
