"""Embeddings: one vector per input, pooled from the model's final hidden states (after the final norm).

Inputs run through the model's own forward without the KV cache: nothing an embedding computes is read again,
so it holds no blocks (running requests keep every block they have) and a lossy KV codec does not round its
keys and values. Several inputs share one forward, each attending only to itself; a forward holds up to the
scheduler's token budget of inputs, and an input longer than the budget runs in a forward of its own.
The caller runs it where the engine's steps run (the engine is not thread-safe).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcp2026.models.attention import ForwardContext
from mcp2026.types import EmbeddingParams, EmbeddingResult


def pool(hidden: torch.Tensor, lengths: torch.Tensor, pooling: str) -> torch.Tensor:
    """hidden (T, H) of sequences of ``lengths`` (B,) laid one after another -> (B, H): each one's last row
    ("last") or the mean of its rows ("mean")."""
    ends = lengths.cumsum(0)
    if pooling == "last":
        return hidden[ends - 1]
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)  # (T,)
    sums = torch.zeros(len(lengths), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    return sums.index_add_(0, seq, hidden) / lengths.unsqueeze(1).to(hidden.dtype)


def finish(pooled: torch.Tensor, params: EmbeddingParams) -> torch.Tensor:
    """The first ``dimensions`` components (Matryoshka truncation), then L2-normalised when asked."""
    if params.dimensions is not None:
        pooled = pooled[:, : params.dimensions]
    return F.normalize(pooled, p=2.0, dim=-1) if params.normalize else pooled


def plan_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive input indices grouped into forwards of at most ``max_tokens`` tokens (an input longer than
    that alone)."""
    batches: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if batches and total + n <= max_tokens:
            batches[-1].append(i)
            total += n
        else:
            batches.append([i])
            total = n
    return batches


class Embedder:
    """Turns inputs (text or token ids) into pooled vectors with the engine's model."""

    def __init__(
        self, model: nn.Module, tokenizer: Any, max_model_len: int, vocab_size: int, max_batch_tokens: int
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_batch_tokens = max_batch_tokens
        self.device = next(model.parameters()).device

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def token_ids(self, item: str | Sequence[int], index: int = 0, name: str = "inputs") -> list[int]:
        """One input's token ids, checked: ValueError naming ``name[index]`` when empty, too long or outside
        the vocabulary."""
        if isinstance(item, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            ids = self.tokenizer.encode(item)
        elif isinstance(item, Sequence) and all(isinstance(t, int) for t in item):
            ids = [int(t) for t in item]
        else:
            raise ValueError(
                f"{name}[{index}] must be a string or a list of token ids, got {type(item).__name__}"
            )
        if not ids:
            raise ValueError(f"{name}[{index}] is empty: give at least one token")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(
                f"{name}[{index}]: token ids must be in [0, {self.vocab_size}), got {min(ids)}..{max(ids)}"
            )
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"{name}[{index}] has {len(ids)} tokens but this model's context is {self.max_model_len} tokens; "
                "shorten it"
            )
        return ids

    def check_params(self, params: EmbeddingParams) -> None:
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions is {params.dimensions} but this model's embeddings have {self.hidden_size}; "
                f"ask for at most {self.hidden_size}"
            )

    def batches(self, token_lists: Sequence[Sequence[int]]) -> list[list[int]]:
        """Which inputs share each forward (indices into ``token_lists``)."""
        return plan_batches([len(t) for t in token_lists], self.max_batch_tokens)

    @torch.inference_mode()
    def forward(self, token_lists: Sequence[Sequence[int]], params: EmbeddingParams) -> torch.Tensor:
        """One forward over checked inputs: (B, dimensions or hidden size) float32 on the CPU."""
        lengths = [len(t) for t in token_lists]
        ids = torch.tensor(
            [t for tokens in token_lists for t in tokens], dtype=torch.long, device=self.device
        )
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        hidden = self.model(ids, positions, ForwardContext(seq_lens=tuple(lengths)))  # (T, H)
        lens = torch.tensor(lengths, device=self.device)
        return finish(pool(hidden.float(), lens, params.pooling), params).cpu()

    def embed(
        self, inputs: Sequence[str | Sequence[int]], params: EmbeddingParams | None = None
    ) -> EmbeddingResult:
        """Every input's vector, in input order; all inputs are checked before any forward runs."""
        params = params or EmbeddingParams()
        if not inputs:
            raise ValueError("no inputs to embed: give at least one")
        self.check_params(params)
        token_lists = [self.token_ids(item, i) for i, item in enumerate(inputs)]
        vectors: list[list[float]] = [[] for _ in token_lists]
        for batch in self.batches(token_lists):
            rows = self.forward([token_lists[i] for i in batch], params)
            for i, row in zip(batch, rows.tolist()):
                vectors[i] = row
        return EmbeddingResult(vectors, [len(t) for t in token_lists])
