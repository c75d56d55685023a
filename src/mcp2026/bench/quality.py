"""Quality of a model against a reference on the same teacher-forced text: perplexity, KL divergence
KL(reference || model) per token, top-1 agreement and the perplexity change, as one ``QualityResult``.

Two ways in: windows scored llama.cpp-style on bare models (``evaluate``: quantized weights against fp32), and
long sequences streamed through engines' paged KV caches in lockstep (``compare_quality_many``: compressed KV
against uncompressed), whose logits come from ``LLMEngine.score``. Text: held-out ShareGPT conversations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mcp2026.engine.engine import LLMEngine
from mcp2026.quant.perplexity import nll_of, scored_logprobs, scored_targets

_AFTER_PROMPT = ("num_tokens_after_prompt", "reference_ppl_after_prompt", "ppl_after_prompt")


@dataclass(frozen=True)
class QualityResult:
    ppl: float
    nll: float  # mean negative log-likelihood (nats/token)
    num_tokens: int  # scored tokens
    kld: float | None = None  # mean KL(reference || model), nats/token
    kld_p99: float | None = None
    top1_agreement: float | None = None  # share of scored tokens where both argmaxes agree
    reference_ppl: float | None = None
    delta_ppl: float | None = None  # relative: ppl / reference_ppl - 1
    delta_ppl_stderr: float | None = None  # of ln(ppl / reference_ppl), from per-token differences
    # The same perplexities over the positions after a prompt only (what generation sees: a prompt token's own
    # logits are computed while its chunk still reads the uncompressed prompt so far); lockstep runs only.
    num_tokens_after_prompt: int = 0
    reference_ppl_after_prompt: float = float("nan")
    ppl_after_prompt: float = float("nan")

    def to_dict(self) -> dict[str, float | int | None]:
        """The fields, without the after-prompt ones when the text had no prompt part."""
        out = dataclasses.asdict(self)
        if not self.num_tokens_after_prompt:
            for name in _AFTER_PROMPT:
                del out[name]
        return out


# ---- windows on bare models ------------------------------------------------------------------------
def kld_of(reference_logprobs: Tensor, logprobs: Tensor) -> Tensor:
    """(S, V) each -> (S,) KL(reference || model) = sum_v p_ref (log p_ref - log p)."""
    ref = reference_logprobs.float()
    return (ref.exp() * (ref - logprobs.float())).sum(-1).clamp_min(0.0)


def reference_logprobs(model: nn.Module, windows: Sequence[Tensor]) -> list[Tensor]:
    return [scored_logprobs(model, w)[0] for w in windows]


def evaluate(
    model: nn.Module | Callable[[Tensor], Tensor],
    windows: Sequence[Tensor],
    reference: Sequence[Tensor] | nn.Module | None = None,
) -> QualityResult:
    """Perplexity of ``model`` on ``windows``; with ``reference`` (the unquantized model, or its
    ``reference_logprobs`` for these windows) also KLD, top-1 agreement and the perplexity change.
    ``model`` may also be a function from a window to its scored log-probabilities (a peer engine)."""
    nlls, ref_nlls, klds, agree = [], [], [], []
    for i, window in enumerate(windows):
        if isinstance(model, nn.Module):
            logprobs, targets = scored_logprobs(model, window)
        else:
            logprobs, targets = model(window), scored_targets(window)
        nlls.append(nll_of(logprobs, targets))
        if reference is None:
            continue
        ref = scored_logprobs(reference, window)[0] if isinstance(reference, nn.Module) else reference[i]
        ref_nlls.append(nll_of(ref, targets))
        klds.append(kld_of(ref, logprobs))
        agree.append(ref.argmax(-1) == logprobs.argmax(-1))
    nll = torch.cat(nlls).double()
    result: dict[str, Any] = {
        "ppl": math.exp(nll.mean().item()),
        "nll": nll.mean().item(),
        "num_tokens": nll.numel(),
    }
    if reference is not None:
        ref_nll, kld = torch.cat(ref_nlls).double(), torch.cat(klds).double()
        diff = nll - ref_nll
        result.update(
            kld=kld.mean().item(),
            kld_p99=torch.quantile(kld, 0.99).item() if kld.numel() > 1 else kld.max().item(),
            top1_agreement=torch.cat(agree).double().mean().item(),
            reference_ppl=math.exp(ref_nll.mean().item()),
            delta_ppl=math.exp(diff.mean().item()) - 1,
            delta_ppl_stderr=(diff.std() / math.sqrt(diff.numel())).item() if diff.numel() > 1 else 0.0,
        )
    return QualityResult(**result)


# ---- long sequences through engines, in lockstep ----------------------------------------------------
class QualityAccumulator:
    """Running sums of several test streams' logits against a reference's on one teacher-forced sequence:
    NLL (over all positions and after the prompt), KL(ref || test) and top-1 agreement. Feed it chunks of
    logits in position order; any engine's logits will do (ours, or a peer's)."""

    def __init__(self, token_ids: Sequence[int], num_tests: int, prompt_len: int | None = None) -> None:
        self.tokens = torch.tensor([int(t) for t in token_ids])
        self.first_after = len(self.tokens) if prompt_len is None else prompt_len  # logits at positions >= it
        self.nll_ref = self.nll_ref_after = 0.0
        self.nll, self.nll_after = [0.0] * num_tests, [0.0] * num_tests
        self.kld, self.agree = [0.0] * num_tests, [0] * num_tests
        self.count = self.count_after = 0

    def add(self, start: int, ref_logits: torch.Tensor, test_logits: Sequence[torch.Tensor]) -> None:
        """Logits (n, V) of positions start .. start + n - 1: the reference's, and each test's."""
        n = min(ref_logits.shape[0], len(self.tokens) - 1 - start)  # the last position has no next token
        if n <= 0:
            return
        target = self.tokens[start + 1 : start + 1 + n].unsqueeze(1)
        after = slice(max(0, self.first_after - start), n)
        la = torch.log_softmax(ref_logits[:n].double(), -1)
        pa, top = la.exp(), la.argmax(-1)
        token_nll = -la.gather(1, target)
        self.nll_ref += float(token_nll.sum())
        self.nll_ref_after += float(token_nll[after].sum())
        for i, b in enumerate(test_logits):
            lb = torch.log_softmax(b[:n].double(), -1)
            token_nll = -lb.gather(1, target)
            self.nll[i] += float(token_nll.sum())
            self.nll_after[i] += float(token_nll[after].sum())
            self.kld[i] += float((pa * (la - lb)).sum())
            self.agree[i] += int((top == lb.argmax(-1)).sum())
        self.count += n
        self.count_after += len(range(n)[after])

    def results(self) -> list[QualityResult]:
        if self.count == 0:
            raise ValueError("need at least 2 tokens")

        def after_ppl(total: float) -> float:
            return math.exp(total / self.count_after) if self.count_after else float("nan")

        ppl_ref = math.exp(self.nll_ref / self.count)
        out = []
        for i in range(len(self.nll)):
            ppl = math.exp(self.nll[i] / self.count)
            out.append(
                QualityResult(
                    ppl,
                    self.nll[i] / self.count,
                    self.count,
                    kld=self.kld[i] / self.count,
                    top1_agreement=self.agree[i] / self.count,
                    reference_ppl=ppl_ref,
                    delta_ppl=ppl / ppl_ref - 1.0,
                    num_tokens_after_prompt=self.count_after,
                    reference_ppl_after_prompt=after_ppl(self.nll_ref_after),
                    ppl_after_prompt=after_ppl(self.nll_after[i]),
                )
            )
        return out


def compare_quality(
    ref: LLMEngine,
    test: LLMEngine,
    token_ids: Sequence[int],
    prompt_len: int | None = None,
    prompt_chunk: int = 512,
    chunk_size: int = 1,
) -> QualityResult:
    """Perplexity of both engines and KL(ref || test) on the same teacher-forced sequence."""
    return compare_quality_many(ref, [test], token_ids, prompt_len, prompt_chunk, chunk_size)[0]


def compare_quality_many(
    ref: LLMEngine,
    tests: Sequence[LLMEngine],
    token_ids: Sequence[int],
    prompt_len: int | None = None,
    prompt_chunk: int = 512,
    chunk_size: int = 1,
) -> list[QualityResult]:
    """``compare_quality`` for several test engines in one lockstep: the reference runs once,
    not once per test. Memory: every engine holds one chunk of logits (``prompt_chunk`` x vocab floats)."""
    scores = QualityAccumulator(token_ids, len(tests), prompt_len)
    streams = zip(
        ref.score(token_ids, prompt_len, prompt_chunk, chunk_size, "kv-ref"),
        *(t.score(token_ids, prompt_len, prompt_chunk, chunk_size, "kv-test") for t in tests),
    )
    for (start, a), *others in streams:
        scores.add(start, a, [b for _, b in others])
    return scores.results()
