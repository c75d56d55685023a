"""What the evictor knows of each request's slots, per lane (one layer's one KV head): the block each slot holds
and the attention the slot has drawn, in one (lanes, max slots) row per request of every tensor.

Scores follow ``EvictionPolicy.score_kind``: "mean" keeps the attention mass summed per slot and the number of
observations; "recent" also keeps the mass relative to uniform, averaged with a decay by age in tokens, and the
last observation alone. Compaction moves a row's entries with the slots they describe.
"""

from __future__ import annotations

import torch

from mcp2026.kv.manager import cdiv


class LaneScores:
    def __init__(self, num_lanes: int, max_blocks: int, score_kind: str, score_half_life: float) -> None:
        self.num_lanes = num_lanes
        self.max_blocks = max_blocks
        self.score_kind = score_kind
        self.score_half_life = score_half_life
        shape = (0, num_lanes, max_blocks)
        self.origin = torch.zeros(shape, dtype=torch.long)  # the block (positions // block_size) a slot holds
        self.mass = torch.zeros(shape)
        self.count = torch.zeros(shape)
        self.recent = torch.zeros(shape)  # decayed mass relative to uniform ("recent" scores)
        self.last = torch.zeros(shape)  # the last observation, relative to uniform
        self._free_rows: list[int] = []

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.origin, self.mass, self.count, self.recent, self.last

    def allocate_row(self) -> int:
        """A row for a new request, its slots holding blocks 0, 1, ... (the tensors grow, replaced, when full)."""
        if not self._free_rows:
            old = self.mass.shape[0]
            new = max(8, 2 * old)
            self.origin, self.mass, self.count, self.recent, self.last = (
                torch.cat([t, t.new_zeros(new - old, *t.shape[1:])]) for t in self.tensors()
            )
            self._free_rows = list(range(new - 1, old - 1, -1))
        row = self._free_rows.pop()
        self.origin[row] = torch.arange(self.max_blocks)
        return row

    def free_row(self, row: int) -> None:
        for t in self.tensors():
            t[row].zero_()
        self._free_rows.append(row)

    def observe(self, row: int, mass: torch.Tensor, num_slots: int, age: int) -> None:
        """Fold one observation in: ``mass`` (lanes, >= num_slots), over the row's first ``num_slots`` slots,
        made ``age`` tokens after the previous one."""
        mass = mass[:, :num_slots].float()
        n = num_slots
        if self.score_kind == "recent":
            rel = mass * n  # relative to uniform over the blocks this observation saw
            keep = 0.5 ** (float(age) / self.score_half_life)
            old = self.recent[row, :, :n]
            seen = self.count[row, :, :n] > 0  # a block's first observation is its score
            self.recent[row, :, :n] = torch.where(seen, keep * old + (1.0 - keep) * rel, rel)
            self.last[row, :, :n] = rel  # slots past n are zero (compaction zeroes what it vacates)
        self.mass[row, :, :n] += mass
        self.count[row, :, :n] += 1.0

    def observe_lanes(self, row: int, mass: torch.Tensor, lane_slots: torch.Tensor, age: int) -> None:
        """``observe`` for a request whose layers hold different numbers of slots (``lane_slots`` (lanes,)):
        lane by lane, only its own."""
        n = int(lane_slots.max())
        valid = torch.arange(n).unsqueeze(0) < lane_slots.unsqueeze(1)  # (lanes, n)
        mass = mass[:, :n].float() * valid
        if self.score_kind == "recent":
            rel = mass * lane_slots.unsqueeze(1)
            keep = 0.5 ** (float(age) / self.score_half_life)
            old = self.recent[row, :, :n]
            seen = self.count[row, :, :n] > 0
            updated = torch.where(seen, keep * old + (1.0 - keep) * rel, rel)
            self.recent[row, :, :n] = torch.where(valid, updated, old)
            self.last[row, :, :n] = torch.where(valid, rel, self.last[row, :, :n])
        self.mass[row, :, :n] += mass
        self.count[row, :, :n] += valid.float()

    def restart_from_last(self, row: int) -> None:
        """With "recent" scores: the observation that completed the prompt replaces the scores so far."""
        self.recent[row] = self.last[row]

    def fold_draft(self, row: int, draft: torch.Tensor, weight: float) -> None:
        """Blend draft tokens' attention (relative to uniform, (lanes, n)) into the prompt's observation."""
        w, n = weight, draft.shape[1]
        if self.score_kind == "recent":
            self.last[row, :, :n] = (1.0 - w) * self.last[row, :, :n] + w * draft
        else:  # mean attention per observation: the draft's relative mass back to a share (/ n)
            prompt = self.mass[row, :, :n] / self.count[row, :, :n].clamp_min(1.0)
            self.mass[row, :, :n] = (1.0 - w) * prompt + w * draft / n
            self.count[row, :, :n] = 1.0

    def score(self, row: int, num_slots: int, is_prompt_done: bool = False) -> torch.Tensor:
        """(lanes, num_slots) the policy's score of one request's slots (``EvictionPolicy.score_kind``)."""
        if self.score_kind == "recent":
            return (self.last if is_prompt_done else self.recent)[row, :, :num_slots].clone()
        return self.mass[row, :, :num_slots] / self.count[row, :, :num_slots].clamp_min(1.0)

    def compact(
        self, row: int, lanes: slice, source: torch.Tensor, num_slots: int, num_tokens: int, block_size: int
    ) -> None:
        """After eviction: ``lanes``' first slots take what slots ``source`` (lanes, kept) held, in order, of
        the first ``num_slots``; the slots after them hold the blocks after the tail (the last slot holds the
        last block of ``num_tokens`` tokens)."""
        m = source.shape[1]
        for t in self.tensors():
            t[row, lanes, :m] = t[row, lanes, :num_slots].gather(1, source)
            t[row, lanes, m:num_slots] = 0
        self.origin[row, lanes, m:] = torch.arange(m, self.max_blocks) + cdiv(num_tokens, block_size) - m
