"""Sampler: greedy, seeded reproducibility, truncation, penalties, min_tokens, logprobs, distribution."""

from __future__ import annotations

import math

import pytest
import torch

from mcp2026.engine.sampler import Sampler, SamplingState, greedy_ids
from mcp2026.types import SamplingParams

VOCAB = 512


def _state(prompt: list[int] | None = None, eos: tuple[int, ...] = (), **kwargs) -> SamplingState:
    return SamplingState.create(SamplingParams(**kwargs), prompt or [1, 2, 3], eos_token_ids=eos)


def _logits(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _run(states: list[SamplingState], num_steps: int, vocab: int = VOCAB) -> list[list[int]]:
    """Sample num_steps tokens for every state; row logits depend only on (row's seed key, step)."""
    sampler = Sampler()
    for step in range(num_steps):
        rows = [_logits(1, seed=1000 * step + len(s.prompt_token_ids), vocab=vocab)[0] for s in states]
        out = sampler.sample(torch.stack(rows), states)
        for s, t in zip(states, out.token_ids, strict=True):
            s.output_token_ids.append(t)
    return [s.output_token_ids for s in states]


def test_greedy_is_argmax_fast_and_slow_path() -> None:
    logits = _logits(8)
    expected = logits.argmax(-1).tolist()
    assert Sampler().sample(logits, [_state() for _ in range(8)]).token_ids == expected
    # logprobs on one row forces the general path; greedy rows must still be argmax.
    states = [_state(logprobs=2 if i == 3 else None) for i in range(8)]
    out = Sampler().sample(logits, states)
    assert out.token_ids == expected
    assert out.logprobs[3] is not None and all(lp is None for i, lp in enumerate(out.logprobs) if i != 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_take_the_first_maximum_and_a_nan_as_argmax_does(dtype) -> None:
    nan, inf = float("nan"), float("inf")
    rows = [[1.0, nan, 5.0], [-inf, -inf, -inf], [2.0, 7.0, 7.0], [0.0, inf, inf], [3.0, 1.0, 2.0]]
    logits = torch.tensor(rows, dtype=dtype)
    assert greedy_ids(logits) == logits.argmax(-1).tolist() == [1, 0, 1, 1, 0]
    assert greedy_ids(logits[1::2]) == [0, 1]  # a strided view of the rows


def test_sample_does_not_modify_logits_and_checks_rows() -> None:
    logits = _logits(2)
    before = logits.clone()
    states = [_state(temperature=1.0, repetition_penalty=1.5, frequency_penalty=1.0, seed=1), _state()]
    states[0].output_token_ids += [5, 5, 6]
    Sampler().sample(logits, states)
    assert torch.equal(logits, before)
    with pytest.raises(ValueError):
        Sampler().sample(logits, states[:1])


_CONFIGS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 0.9, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3},
]


@pytest.mark.parametrize("config", _CONFIGS)
def test_seeded_reproducible_alone_and_in_batch(config: dict) -> None:
    alone = _run([_state(prompt=[7] * 5, seed=42, **config)], num_steps=12)[0]
    others = [_state(prompt=[7] * (6 + i), **c) for i, c in enumerate(_CONFIGS)] + [_state(prompt=[9] * 20)]
    batch = others[:2] + [_state(prompt=[7] * 5, seed=42, **config)] + others[2:]
    assert _run(batch, num_steps=12)[2] == alone
    assert _run([_state(prompt=[7] * 5, seed=42, **config)], num_steps=12)[0] == alone


def test_different_seeds_differ() -> None:
    a = _run([_state(temperature=1.0, seed=1)], num_steps=20)[0]
    b = _run([_state(temperature=1.0, seed=2)], num_steps=20)[0]
    c = _run([_state(temperature=1.0)], num_steps=20)[0]
    d = _run([_state(temperature=1.0)], num_steps=20)[0]
    assert a != b and c != d


def test_top_k_1_and_tiny_top_p_and_tiny_temperature_are_greedy() -> None:
    logits = _logits(16, seed=3)
    expected = logits.argmax(-1).tolist()
    for config in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 5, "top_p": 1e-6}, {"min_p": 1.0}):
        states = [_state(temperature=1.5, seed=i, **config) for i in range(16)]
        assert Sampler().sample(logits, states).token_ids == expected, config
    states = [_state(temperature=1e-30, seed=i) for i in range(16)]
    assert Sampler().sample(logits, states).token_ids == expected


def _frequencies(probs: list[float], num_rows: int = 2000, num_steps: int = 10, **config) -> list[float]:
    logits = torch.tensor(probs).log().expand(num_rows, -1).contiguous()
    states = [_state(seed=i, **config) for i in range(num_rows)]
    counts = [0] * len(probs)
    sampler = Sampler()
    for _ in range(num_steps):
        for t in sampler.sample(logits, states).token_ids:
            counts[t] += 1
    return [c / (num_rows * num_steps) for c in counts]


def test_distribution_matches_probabilities() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    freqs = _frequencies(probs, temperature=1.0)
    assert all(abs(f - p) < 0.015 for f, p in zip(freqs, probs, strict=True)), freqs
    # temperature 0.5 squares the probabilities (then renormalises).
    squared = [p * p / sum(q * q for q in probs) for p in probs]
    freqs = _frequencies(probs, temperature=0.5)
    assert all(abs(f - p) < 0.015 for f, p in zip(freqs, squared, strict=True)), freqs


def test_truncation_distributions() -> None:
    probs = [0.05, 0.15, 0.3, 0.5]
    freqs = _frequencies(probs, num_steps=5, temperature=1.0, top_k=2)
    assert freqs[0] == freqs[1] == 0 and abs(freqs[3] - 0.5 / 0.8) < 0.02, freqs
    # top_p = 0.7: 0.5 < 0.7 so the 0.3 token is still needed; 0.15 and 0.05 are cut.
    freqs = _frequencies(probs, num_steps=5, temperature=1.0, top_p=0.7)
    assert freqs[0] == freqs[1] == 0 and abs(freqs[3] - 0.5 / 0.8) < 0.02, freqs
    # min_p = 0.2: threshold 0.1 drops only the 0.05 token.
    freqs = _frequencies(probs, num_steps=5, temperature=1.0, min_p=0.2)
    assert freqs[0] == 0 and freqs[1] > 0.1 and abs(freqs[3] - 0.5 / 0.95) < 0.02, freqs


@pytest.mark.parametrize("scale", [0.1, 4.0])  # 0.1: nucleus > 1024 candidates (full-sort fallback)
def test_top_p_samples_stay_in_nucleus_large_vocab(scale: float) -> None:
    vocab, num_rows, top_p = 4096, 64, 0.9
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(9)) * scale
    order = row.softmax(-1).sort(descending=True)
    mass_before = order.values.cumsum(-1) - order.values
    nucleus = set(order.indices[mass_before < top_p].tolist())
    states = [_state(temperature=1.0, top_p=top_p, seed=i) for i in range(num_rows)]
    tokens = Sampler().sample(row.expand(num_rows, -1).contiguous(), states).token_ids
    assert set(tokens) <= nucleus
    rank = {t: r for r, t in enumerate(order.indices.tolist())}
    if scale < 1:
        assert len(nucleus) > 1024 and max(rank[t] for t in tokens) >= 1024
    else:
        assert len(nucleus) < 1024


def test_top_p_reproducible_when_batch_mixes_small_and_large_nuclei() -> None:
    rows = torch.randn(8, 4096, generator=torch.Generator().manual_seed(4))
    rows = rows * torch.tensor([0.1, 4.0] * 4)[:, None]
    params = {"temperature": 1.0, "top_p": 0.9}
    batch = Sampler().sample(rows, [_state(seed=i, **params) for i in range(8)]).token_ids
    alone = [Sampler().sample(rows[i : i + 1], [_state(seed=i, **params)]).token_ids[0] for i in range(8)]
    assert batch == alone


def test_penalties_exact_numbers() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    state = _state(prompt=[0, 0], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    state.output_token_ids += [1, 2, 2]
    out = Sampler().process_logits(logits, [state])
    # token 0: prompt only -> 2 / 2; token 1: output once -> -2 * 2 - 0.5 - 0.25;
    # token 2: output twice -> 1 / 2 - 2 * 0.5 - 0.25; others untouched.
    expected = torch.tensor([[1.0, -4.75, -0.75, -1.0, 0.5, 3.0]])
    assert torch.equal(out, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]]))


def test_logit_bias_is_added_per_row_after_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    biased = _state(prompt=[0], repetition_penalty=2.0, logit_bias={0: -100, 3: 2.5})
    plain = _state()
    out = Sampler().process_logits(logits, [biased, plain])
    assert torch.equal(out, torch.tensor([[1.0 - 100, -2.0, 1.0, 2.5], [0.0, 1.0, 2.0, 3.0]]))
    # greedy rows with a bias leave the argmax fast path: the banned argmax is not picked
    assert Sampler().sample(logits, [_state(logit_bias={0: -100}), plain]).token_ids == [2, 3]
    forced = _state(temperature=1.0, seed=1, logit_bias={1: 100})
    assert Sampler().sample(logits[:1], [forced]).token_ids == [1]


@pytest.mark.parametrize(
    "bias", [{-1: 1.0}, {1: 100.5}, {1: float("nan")}, {True: 1.0}, dict.fromkeys(range(1025), 1.0)]
)
def test_bad_logit_bias_is_refused(bias) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_frequency_counts_repeats_and_presence_does_not() -> None:
    logits = torch.zeros(2, 4)
    freq = _state(frequency_penalty=1.5)
    presence = _state(presence_penalty=1.5)
    for s in (freq, presence):
        s.output_token_ids += [3, 3, 3, 1]
    out = Sampler().process_logits(logits, [freq, presence])
    assert out[0].tolist() == [0.0, -1.5, 0.0, -4.5]
    assert out[1].tolist() == [0.0, -1.5, 0.0, -1.5]
    freq.output_token_ids[:] = [2]  # truncated output (e.g. rejected draft tokens) is recounted
    assert Sampler().process_logits(logits, [freq])[0].tolist() == [0.0, 0.0, -1.5, 0.0]
    # Prompt tokens are not penalised by frequency/presence (token 1..3 are in the default prompt).
    assert Sampler().process_logits(logits, [_state(frequency_penalty=2.0)])[0].tolist() == [0.0] * 4


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    state = _state(prompt=[0], repetition_penalty=1.5)
    assert Sampler().sample(logits, [state]).token_ids == [1]  # 5 / 1.5 < 4
    assert Sampler().sample(logits, [_state(prompt=[2])]).token_ids == [0]


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]])  # eos = 2, stop id = 3
    state = _state(eos=(2,), min_tokens=3, stop_token_ids=(3,))
    sampler = Sampler()
    for _ in range(3):
        token = sampler.sample(logits, [state]).token_ids[0]
        assert token == 1
        state.output_token_ids.append(token)
    assert sampler.sample(logits, [state]).token_ids == [2]
    # ignore_eos: eos is an ordinary token, so it is not masked; stop ids still are.
    ignoring = _state(eos=(2,), min_tokens=3, stop_token_ids=(3,), ignore_eos=True)
    assert sampler.sample(logits, [ignoring]).token_ids == [2]
    # Random rows are masked too.
    random_rows = [
        _state(eos=(2,), min_tokens=1, stop_token_ids=(3,), temperature=1.0, seed=i) for i in range(50)
    ]
    assert not {2, 3} & set(sampler.sample(logits.expand(50, -1), random_rows).token_ids)


def test_logprobs_sorted_and_consistent() -> None:
    logits = _logits(3, seed=5, vocab=16)
    states = [
        _state(logprobs=5, temperature=0.5, seed=0),
        _state(logprobs=0),
        _state(logprobs=16, temperature=1.0, top_k=3, seed=1),
    ]
    out = Sampler().sample(logits, states)
    reference = torch.log_softmax(logits, dim=-1)  # raw: before temperature and truncation
    for i, lp in enumerate(out.logprobs):
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(reference[i, lp.token_id].item(), abs=1e-5)
        values = list(lp.top.values())
        assert values == sorted(values, reverse=True)
        assert len(lp.top) == states[i].params.logprobs
        for token, value in lp.top.items():
            assert value == pytest.approx(reference[i, token].item(), abs=1e-5)
    assert list(out.logprobs[0].top) == reference[0].topk(5).indices.tolist()
    assert math.fsum(math.exp(v) for v in out.logprobs[2].top.values()) == pytest.approx(1.0, abs=1e-4)
    # Greedy picks the most likely token, so its logprob is the top-1 value.
    assert out.logprobs[1].logprob == pytest.approx(reference[1].max().item(), abs=1e-6)


def test_logprobs_reflect_penalties_and_skip_masked() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    state = _state(prompt=[2], repetition_penalty=3.0, logprobs=3, eos=(0,), min_tokens=1)
    lp = Sampler().sample(logits, [state]).logprobs[0]
    reference = torch.log_softmax(torch.tensor([float("-inf"), 2.0, 1.0]), dim=-1)
    assert lp.token_id == 1 and lp.logprob == pytest.approx(reference[1].item())
    assert list(lp.top) == [1, 2]  # the masked eos (-inf) is not reported


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", -1), ("max_tokens", 0), ("logprobs", 21)],
)
def test_invalid_params_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
