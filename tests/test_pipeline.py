"""Pipeline on the real default model (fp32): input forms, order, profile fields, stops, seeds, batch == alone."""

from __future__ import annotations

import pytest

from mcp2026 import Pipeline, QuantConfig, SamplingParams
from mcp2026.errors import NotSupportedYetError
from mcp2026.pipeline import normalize_inputs

GREEDY = SamplingParams(max_tokens=8)

# Short and long, chat and plain, numbers, code, whitespace runs, non-Latin scripts, emoji.
DIVERSE_PROMPTS = [
    "What is the capital of France?",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Translate to French: Good morning, my friend.",
    "Once upon a time",
    "List three colors:\n-",
    "12345 + 67890 =",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "   leading spaces\t\tand tabs\n\n\n",
    "你好，世界！",
    "Emoji test: 😀👍🏽 means",
    "<html><body>",
    "Q: Why is the sky blue?\nA:",
    "Write a haiku about the sea.",
    "x",
    "SELECT name FROM users WHERE",
]


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    return Pipeline(dtype="fp32")


# --- fast: checks that run before any model is loaded ------------------------------------------


def test_unsupported_precision_fails_before_loading():
    # The model path does not exist: the precision check must come first to raise this error.
    with pytest.raises(NotSupportedYetError, match="fp16"):
        Pipeline(model="/no/such/model", config=QuantConfig(target_precision="fp16"))


def test_normalize_inputs():
    chat = [{"role": "user", "content": "hi"}]
    assert normalize_inputs("a") == ["a"]
    assert normalize_inputs(["a", "b"]) == ["a", "b"]
    assert normalize_inputs(chat) == [chat]
    assert normalize_inputs([chat, "b"]) == [chat, "b"]
    with pytest.raises(ValueError, match=r"inputs\[0\]"):
        normalize_inputs([1, 2])
    with pytest.raises(ValueError, match=r"inputs\[1\]"):
        normalize_inputs(["ok", None])


# --- slow: the real default model ---------------------------------------------------------------


@pytest.mark.slow
def test_input_forms_and_order(pipe):
    conversation = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a fruit."},
    ]
    one = pipe.infer("Hello", GREEDY)
    assert len(one.outputs) == 1 and one.text == one.outputs[0].text
    many = pipe.infer(["Hello", "1, 2, 3,", "Goodbye"], GREEDY)
    alone = [pipe.infer(p, GREEDY).outputs[0] for p in ("Hello", "1, 2, 3,", "Goodbye")]
    assert [o.token_ids for o in many.outputs] == [o.token_ids for o in alone]
    assert [o.prompt_token_ids for o in many.outputs] == [o.prompt_token_ids for o in alone]
    assert many.outputs[0].token_ids == one.outputs[0].token_ids
    chats = pipe.infer([conversation, [{"role": "user", "content": "Hi"}]], GREEDY)
    single_chat = pipe.infer(conversation, GREEDY)
    assert chats.outputs[0].token_ids == single_chat.outputs[0].token_ids
    assert chats.outputs[0].prompt_token_ids == pipe.tokenizer.encode_chat(conversation)
    assert all(o.text and o.finish_reason in ("stop", "length") for o in chats.outputs)


@pytest.mark.slow
def test_greedy_capital_of_france(pipe):
    out = pipe.generate("What is the capital of France?", SamplingParams(max_tokens=16), chat=True)
    assert "Paris" in out.text


@pytest.mark.slow
def test_profile_fields(pipe):
    result = pipe.infer(
        ["Tell me a story.", "Count to five:"], SamplingParams(max_tokens=8, ignore_eos=True), profile=True
    )
    assert result.latency_ms > 0
    assert 0 < result.ttft_ms <= result.latency_ms
    assert 0 < result.tpot_ms <= result.latency_ms
    assert result.tokens_per_s > 0
    assert 0 < result.mem_saturation <= 1
    assert result.peak_rss_bytes > 100e6
    assert set(result.breakdown) == {"tokenize", "prefill", "decode", "sample", "detokenize"}
    assert all(ms >= 0 for ms in result.breakdown.values())
    assert result.breakdown["prefill"] > 0 and result.breakdown["decode"] > 0
    assert sum(result.breakdown.values()) <= result.latency_ms * 1.05
    assert result.mem_bw_util > 0
    plain = pipe.infer("Hi", GREEDY)
    assert plain.latency_ms is None and plain.breakdown == {}


@pytest.mark.slow
def test_speculative_decoding_keeps_drafts_and_the_tokens_of_plain_decoding():
    """A copying task on the default path (the GGUF's blocks as stored): prompt-lookup drafts are kept, and
    the tokens are those of the same model without speculation. The drafts run as rows of the decode kernels,
    which compute each row alone, as plain decoding does. (Float weights go through torch's GEMM, whose
    rounding depends on the number of rows, as batching does: a near-tie may then fall the other way.)"""
    pipe = Pipeline()
    text = (
        "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
        "the members agreed to fund the children's reading room and to postpone the parking garage."
    )
    messages = [{"role": "user", "content": f"Repeat this text word for word:\n\n{text}"}]
    params = SamplingParams(max_tokens=48)
    result = pipe.infer([messages], params, profile=True)
    spec = result.speculation
    assert spec["enabled"] and spec["num_accepted_tokens"] > 10 and spec["tokens_per_draft"] > 1.5
    plain = Pipeline(speculative="off").infer([messages], params).outputs[0]
    assert result.outputs[0].token_ids == plain.token_ids


@pytest.mark.slow
def test_stop_string_cuts_text(pipe):
    full = pipe.generate("What is the capital of France?", SamplingParams(max_tokens=16), chat=True)
    assert "Paris" in full.text
    stopped = pipe.generate(
        "What is the capital of France?", SamplingParams(max_tokens=16, stop=("Paris",)), chat=True
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index("Paris")]
    assert "Paris" not in stopped.text


@pytest.mark.slow
def test_max_tokens_finishes_with_length(pipe):
    out = pipe.generate("Once upon a time", SamplingParams(max_tokens=5, ignore_eos=True))
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(pipe):
    sampling = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    first = pipe.infer(["Write a sentence about cats.", "Write a sentence about dogs."], sampling)
    again = pipe.infer(["Write a sentence about dogs.", "Write a sentence about cats."], sampling)
    assert first.outputs[0].token_ids == again.outputs[1].token_ids
    assert first.outputs[1].token_ids == again.outputs[0].token_ids
    other_seed = pipe.infer(
        "Write a sentence about cats.",
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True),
    )
    assert other_seed.outputs[0].token_ids != first.outputs[0].token_ids


@pytest.mark.slow
def test_batched_greedy_equals_alone(pipe):
    sampling = SamplingParams(max_tokens=24)
    inputs = [[{"role": "user", "content": p}] if i % 4 == 0 else p for i, p in enumerate(DIVERSE_PROMPTS)]
    batched = pipe.infer(inputs, sampling)
    alone = [pipe.infer([item], sampling).outputs[0] for item in inputs]
    for i, (b, a) in enumerate(zip(batched.outputs, alone)):
        assert b.token_ids == a.token_ids, f"prompt {i}: {DIVERSE_PROMPTS[i]!r}"
        assert b.text == a.text and b.finish_reason == a.finish_reason


@pytest.mark.slow
def test_invalid_inputs_name_the_item(pipe):
    with pytest.raises(ValueError, match=r"inputs\[0\]"):
        pipe.infer(inputs=[1, 2])
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 inputs"):
        pipe.infer(["a", "b"], [GREEDY])
    assert not pipe.engine.has_unfinished()
