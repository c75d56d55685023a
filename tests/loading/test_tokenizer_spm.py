"""SentencePiece ("llama") GGUF vocabularies: ids against llama.cpp's algorithm (``spm_reference.ReferenceSpm``,
a plain-Python port) and transformers' own GGUF tokenizer, on a tiny vocabulary written with ``gguf``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcp2026.loading.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerLoadError
from spm_reference import CORPUS, ReferenceSpm, spm_vocabulary, write_spm_gguf

GEMMA_FLAGS = {"add_bos_token": True, "add_eos_token": False, "add_space_prefix": False}
BOS, EOS = 2, 1

SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "the the the tokenizer tokenizes tokens",
    "   leading and trailing   ",
    "x    y\t\tz\t\t\tw",
    "a\n\nb\n\n\n\n\n\nc\r\nd",
    "In 2026, 12345 apples cost $3.50 — 0.5%",
    "Héllo wörld, café naïve; ÆØÅ ß ƒ",
    "Emoji: 😀👍🏽🇺🇸 ❤️ 👨‍👩‍👧",
    "世界 你好，世界！日本語のテキスト 한국어",
    "def tokenize(text):\n    return [t for t in text.split() if t]  # comment\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<b>bold</b> and <bos> in text <eos>",
    "<start_of_turn",  # not a token: spelled out
    " ",
    "x",
    "",
]


@pytest.fixture(scope="module")
def vocabulary():
    return spm_vocabulary()


@pytest.fixture(scope="module")
def gemma_style(tmp_path_factory):
    return write_spm_gguf(tmp_path_factory.mktemp("spm") / "gemma.gguf", flags=GEMMA_FLAGS)


@pytest.fixture(scope="module")
def tokenizer(gemma_style):
    return Tokenizer.from_gguf(gemma_style)


@pytest.fixture(scope="module")
def reference(vocabulary):
    return ReferenceSpm(*vocabulary, add_space_prefix=False)


@pytest.mark.parametrize("text", SAMPLES)
def test_ids_match_llama_cpp(tokenizer, reference, text):
    assert tokenizer.encode(text) == [BOS, *reference.encode(text)]
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(
            st.sampled_from(CORPUS.split() + [" ", "  ", "\n", "\t", "<b>", "<end_of_turn>", "▁", "😀"]),
            st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6),
        ),
        max_size=12,
    ).map("".join)
)
def test_ids_match_llama_cpp_on_random_text(tokenizer, reference, text):
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)


def test_ids_match_transformers_gguf_tokenizer(gemma_style, tokenizer):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(gemma_style.parent, gguf_file=gemma_style.name)
    mismatches = {text: (tokenizer.encode(text), theirs.encode(text)) for text in SAMPLES}
    assert {text: ids for text, ids in mismatches.items() if ids[0] != ids[1]} == {}


@pytest.mark.parametrize("text", [s for s in SAMPLES if "<" not in s])
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_keeps_special_text_when_asked(tokenizer, text):
    assert (
        tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
    )


def test_special_and_user_defined_tokens_are_single(tokenizer, vocabulary):
    tokens = vocabulary[0]
    for token in ("<start_of_turn>", "<end_of_turn>", "<b>", "  ", "\n\n"):
        assert tokenizer.encode(token, add_special_tokens=False) == [tokens.index(token)]
    # control tokens are dropped from text, user-defined ones are text
    ids = tokenizer.encode("<start_of_turn><b>hi</b><end_of_turn>")
    assert tokenizer.decode(ids) == "<b>hi</b>"


def test_characters_outside_the_vocabulary_fall_back_to_bytes(tokenizer, vocabulary):
    tokens = vocabulary[0]
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert [tokens[i] for i in ids] == [f"<0x{b:02X}>" for b in "😀".encode()]


@pytest.mark.parametrize(
    "text", ["héllo 😀 世界 👨‍👩‍👧 ok", "  a\n\n\tb  ", "The tokenizer turns the prompt"]
)
def test_streaming_detokenizer_rebuilds_the_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("The fox"))
    deltas = [stream.push(i) for i in ids]
    assert "".join(deltas) + stream.flush() == text
    assert all("\ufffd" not in d for d in deltas)  # never half a UTF-8 character


def test_space_prefix_as_llama_cpp(tmp_path, vocabulary):
    """Llama-2/Mistral files: no add_space_prefix key means llama.cpp's default (on), and a space goes in
    front of every fragment after a token, as llama.cpp does (transformers' LlamaTokenizer differs there)."""
    tokenizer = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "llama.gguf", architecture="llama"))
    reference = ReferenceSpm(*vocabulary, add_space_prefix=True)
    assert tokenizer.add_bos  # llama.cpp's default for a SentencePiece vocabulary
    for text in SAMPLES:
        assert tokenizer.encode(text) == [BOS, *reference.encode(text)], text
    for text in ("The fox", " The fox ", "héllo 😀"):  # no added tokens inside: see above
        assert tokenizer.decode(tokenizer.encode(text)) == text
        stream = IncrementalDetokenizer(tokenizer)  # the decoder strips the prefix space of each window alike
        streamed = "".join(stream.push(i) for i in tokenizer.encode(text, add_special_tokens=False))
        assert streamed + stream.flush() == text


def test_add_eos_appends_eos(tmp_path):
    flags = {**GEMMA_FLAGS, "add_eos_token": True}
    tokenizer = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "eos.gguf", flags=flags))
    ids = tokenizer.encode("the fox")
    assert ids[0] == BOS and ids[-1] == EOS
    assert EOS not in tokenizer.encode("the fox", add_special_tokens=False)


def test_missing_byte_tokens_is_a_clear_error(tmp_path, vocabulary):
    tokens, scores, types = (list(v) for v in vocabulary)
    i = tokens.index("<0x41>")
    del tokens[i], scores[i], types[i]
    path = write_spm_gguf(tmp_path / "nobytes.gguf", vocabulary=(tokens, scores, types))
    with pytest.raises(TokenizerLoadError, match=r"nobytes.gguf: .*lacks 1 byte tokens \(<0x41>"):
        Tokenizer.from_gguf(path)


def test_scores_of_the_wrong_length_is_a_clear_error(tmp_path, vocabulary):
    tokens, scores, types = vocabulary
    path = write_spm_gguf(tmp_path / "short.gguf", vocabulary=(tokens, scores[:-1], types))
    with pytest.raises(TokenizerLoadError, match="tokenizer.ggml.scores has"):
        Tokenizer.from_gguf(path)
