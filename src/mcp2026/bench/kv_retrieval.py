"""The retrieval check of ``mcp2026 bench kv``: a fact stated early in a long context and asked about at the
end. Each seed picks a name, a 5-digit code, where the fact goes and which filler surrounds it; every engine
greedy-decodes a short answer, and a compressed engine *agrees* when it gives the same answer as the
uncompressed engine: the same code (the first number of 3+ digits in its reply), or no code in both. Identical
token ids, a stricter count, are reported next to it: where neither engine finds the fact, both go on with
unrelated text that compression changes without changing the answer. Whether an answer is *correct*
(contains the code) is counted separately: a small model may not retrieve well even uncompressed, and
agreement is what compression can break.

With a tokenizer the prompt is text (filler = held-out conversations, chat template when the model has one);
without one (tiny test models) it is token ids: filler, then key ids + value ids, more filler, the key ids.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcp2026.types import SamplingParams

NAMES = (
    "Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas",
    "Kofi", "Lena", "Marek", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Tariq",
)  # fmt: skip
NUMBER = re.compile(r"[0-9]+(?:[, ][0-9]{3})*")  # "61750", "61,750" and "61 750" are one number
ANSWER_TOKENS = 16  # greedy tokens per answer: "The secret code for Quentin is 12345." fits (digits: 1 each)
EARLY = (0.05, 0.3)  # the fact starts within this fraction of the filler
KEY_LEN, VALUE_LEN = 4, 5  # token mode: ids naming the fact and ids of its value


@dataclass(frozen=True)
class RetrievalPrompt:
    seed: int
    prompt_token_ids: list[int]
    code: str | None  # text mode: the digits the answer must contain
    value_ids: tuple[int, ...] = ()  # token mode: the ids the answer must start with

    def is_correct(self, answer_ids: Sequence[int], tokenizer: Any | None) -> bool:
        if self.code is not None and tokenizer is not None:
            return self.code in tokenizer.decode(list(answer_ids))
        return tuple(answer_ids[: len(self.value_ids)]) == self.value_ids

    def answer(self, answer_ids: Sequence[int], tokenizer: Any | None) -> str | tuple[int, ...] | None:
        """What the reply answers: text mode, its first number of 3+ digits, separators dropped (None: it
        gives no code); token mode, its first ids (as many as the fact's value)."""
        if self.code is not None and tokenizer is not None:
            numbers = (
                re.sub("[, ]", "", m.group()) for m in NUMBER.finditer(tokenizer.decode(list(answer_ids)))
            )
            return next((n for n in numbers if len(n) >= 3), None)
        return tuple(answer_ids[: len(self.value_ids)])


def _question(name: str) -> str:
    return f"What is the secret code for {name}? Answer with the 5-digit code only."


def _encode_text(tokenizer: Any, body: str, question: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.encode_chat([{"role": "user", "content": f"{body}\n\n{question}"}])
    return tokenizer.encode(f"{body}\n\nQuestion: {question}\nAnswer:")


def text_overhead(tokenizer: Any) -> int:
    """Tokens a prompt takes besides its filler (template, fact, question), plus slack for the joins."""
    fact = "The secret code for Quentin is 12345."
    return len(_encode_text(tokenizer, fact, _question("Quentin"))) + 16


def build_prompt(
    seed: int, filler_ids: Sequence[int], tokenizer: Any | None, vocab_size: int
) -> RetrievalPrompt:
    """One retrieval prompt around ``filler_ids`` (held-out text, or random ids in token mode)."""
    rng = random.Random(seed)
    where = rng.uniform(*EARLY)
    if tokenizer is None:
        key = [rng.randrange(vocab_size) for _ in range(KEY_LEN)]
        value = [rng.randrange(vocab_size) for _ in range(VALUE_LEN)]
        cut = int(len(filler_ids) * where)
        ids = [*filler_ids[:cut], *key, *value, *filler_ids[cut:], *key]
        return RetrievalPrompt(seed, ids, None, tuple(value))
    name, code = rng.choice(NAMES), f"{rng.randrange(10_000, 100_000)}"
    filler = tokenizer.decode(list(filler_ids))
    cut = int(len(filler) * where)
    cut = next((i for i in range(cut, len(filler)) if filler[i].isspace()), len(filler))  # between words
    body = f"{filler[:cut]}\n\nThe secret code for {name} is {code}.\n\n{filler[cut:]}"
    return RetrievalPrompt(seed, _encode_text(tokenizer, body, _question(name)), code)


def answers(engine: Any, prompts: Sequence[RetrievalPrompt]) -> list[list[int]]:
    """Greedy answers of ``engine``, one prompt at a time: with eviction, what a request keeps depends on
    its prefill chunks, and those on what else is batched; alone, every engine sees the same chunks."""
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
    out = []
    for p in prompts:
        (output,) = engine.generate([p.prompt_token_ids], params)
        if output.finish_reason == "error":
            raise RuntimeError(f"retrieval prompt (seed {p.seed}) failed in the engine: {output.error}")
        out.append(list(output.token_ids))
    return out


@dataclass(frozen=True)
class RetrievalScore:
    num_prompts: int
    num_agree: int  # the same answer as the uncompressed engine's (RetrievalPrompt.answer)
    num_correct: int  # answers containing the fact
    num_ref_correct: int = 0  # prompts the uncompressed engine answered correctly ...
    num_kept: int = 0  # ... and this engine too: the fact survived compression
    num_identical: int = 0  # replies whose token ids equal the uncompressed engine's

    @property
    def agreement(self) -> float:
        return self.num_agree / self.num_prompts

    @property
    def accuracy(self) -> float:
        return self.num_correct / self.num_prompts


def score(
    prompts: Sequence[RetrievalPrompt],
    reference: Sequence[Sequence[int]],
    got: Sequence[Sequence[int]],
    tokenizer: Any | None,
) -> RetrievalScore:
    if not len(prompts) == len(reference) == len(got) or not prompts:
        raise ValueError("need one reference and one answer per prompt, and at least one prompt")
    agree = sum(p.answer(a, tokenizer) == p.answer(b, tokenizer) for p, a, b in zip(prompts, reference, got))
    identical = sum(list(a) == list(b) for a, b in zip(reference, got))
    correct = [p.is_correct(a, tokenizer) for p, a in zip(prompts, got)]
    ref_correct = [p.is_correct(a, tokenizer) for p, a in zip(prompts, reference)]
    kept = sum(r and c for r, c in zip(ref_correct, correct))
    return RetrievalScore(len(prompts), agree, sum(correct), sum(ref_correct), kept, identical)
