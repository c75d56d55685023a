"""Windowed perplexity of a bare model, as llama.cpp's ``llama-perplexity`` scores it: the text is cut into
windows of ``n_ctx`` (512) tokens, each run from scratch, and only the second half of each window is scored
(positions n_ctx/2 .. n_ctx-2 predicting the next token), so every scored token has at least n_ctx/2 tokens
of context. The DQG's perplexity budget checks plans with it; ``bench.quality`` builds its metrics on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mcp2026.sharegpt import sharegpt_texts

N_CTX = 512


def windows_from_tokens(
    tokens: Sequence[int], n_ctx: int = N_CTX, num_windows: int | None = None, bos_token_id: int | None = None
) -> list[Tensor]:
    """Consecutive non-overlapping windows of ``n_ctx`` tokens (a short tail is dropped); with
    ``bos_token_id`` the first token of each window is replaced by BOS, as llama.cpp does."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    count = len(ids) // n_ctx if num_windows is None else min(num_windows, len(ids) // n_ctx)
    windows = [ids[i * n_ctx : (i + 1) * n_ctx].clone() for i in range(count)]
    if bos_token_id is not None:
        for w in windows:
            w[0] = bos_token_id
    return windows


def evaluation_windows(tokenizer, num_windows: int, n_ctx: int = N_CTX, seed: int = 0) -> list[Tensor]:
    """``num_windows`` windows of held-out ShareGPT text (the evaluation split), fixed by ``seed``."""
    tokens: list[int] = []
    for text in sharegpt_texts("evaluation", seed):
        tokens.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(tokens) >= num_windows * n_ctx:
            break
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos", False) else None
    return windows_from_tokens(tokens, n_ctx, num_windows, bos)


def scored_positions(n: int) -> slice:
    """The positions of an ``n``-token window whose next-token predictions are scored: its second half."""
    return slice(n // 2, n - 1)


def scored_targets(window: Tensor) -> Tensor:
    """The tokens the scored positions of ``window`` predict (what ``scored_logprobs`` returns with them)."""
    return window[len(window) // 2 + 1 :]


def nll_of(logprobs: Tensor, targets: Tensor) -> Tensor:
    """(S, V) log-probabilities, (S,) targets -> (S,) negative log-likelihoods."""
    return -logprobs.float().gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.inference_mode()
def scored_logprobs(model: nn.Module, window: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probabilities (S, V) at the scored positions of one window, and their targets (S,)."""
    device = next(model.parameters()).device
    ids = window.to(device)
    n = len(ids)
    hidden = model(ids, torch.arange(n, device=device))  # (n, H)
    logits = model.compute_logits(hidden[scored_positions(n)])  # (S, V)
    return torch.log_softmax(logits.float(), dim=-1).cpu(), scored_targets(window)


def perplexity(model: nn.Module, windows: Sequence[Tensor]) -> float:
    """exp of the mean negative log-likelihood over the scored positions of all ``windows``."""
    nll = torch.cat([nll_of(*scored_logprobs(model, w)) for w in windows]).double()
    return math.exp(nll.mean().item())
