"""SchedulerOutput: the one contract between the scheduler (decides) and the runner (executes)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request to compute this step, at positions ``start_pos .. start_pos+len-1``.

    KV for positions ``< start_pos`` is already cached in the blocks of ``block_table``, which also covers this
    chunk. Without eviction block ``i`` holds positions ``[i*block_size, (i+1)*block_size)``. After KV eviction
    ``kv_offset`` tokens of KV are gone: the table holds ``kv_start = start_pos - kv_offset`` cached tokens
    (which positions, per layer and head, is ``kv.eviction``'s business) and the chunk's K/V go at slots
    ``kv_start ..``. Nothing may be written into blocks before ``kv_start // block_size``: they can be shared
    prefix-cache blocks.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int  # == the request's num_computed_tokens before this step
    block_table: list[int]
    samples: bool  # the chunk ends at the request's last known token: return one sampled token for it
    _: KW_ONLY  # the optional fields below are named at every call: two of them are easy to swap
    wants_all_logits: bool = False  # prompt logprobs: the runner keeps the logits of every row of the chunk
    kv_offset: int = 0  # tokens of KV evicted before this chunk (a multiple of the block size)
    # speculative decoding: the last this many tokens are drafts after the request's last known token; the
    # runner returns logits for that token and every draft (num_draft_tokens + 1 rows)
    num_draft_tokens: int = 0

    @property
    def kv_start(self) -> int:
        """Where the chunk's first token goes in the table (cached tokens before it)."""
        return self.start_pos - self.kv_offset

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Logit rows the runner returns for this chunk: the last known token's and one per draft."""
        return 1 + self.num_draft_tokens if self.samples else 0

    @property
    def is_decode(self) -> bool:
        """One known token after cached ones (with or without drafts): a decode step's work, not a prompt's."""
        return self.start_pos > 0 and self.num_tokens - self.num_draft_tokens == 1


@dataclass(frozen=True)
class SchedulerOutput:
    """One step. Chunks with a single token (decodes) come first, then longer prefill chunks."""

    chunks: list[ScheduledChunk]
    num_batched_tokens: int  # == sum of chunk lengths, <= max_num_batched_tokens
    preempted_ids: list[str] = field(default_factory=list)  # blocks freed, will recompute from position 0
    finished_ids: list[str] = field(default_factory=list)  # finished (any reason) since the last step

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def sampling_ids(self) -> list[str]:
        """Request ids the runner must return a sampled token for, in chunk order."""
        return [c.request_id for c in self.chunks if c.samples]
