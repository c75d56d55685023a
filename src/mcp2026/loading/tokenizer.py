"""Tokenizer: a real ``tokenizers.Tokenizer`` rebuilt from GGUF metadata (or loaded from an HF folder),
with HF-compatible chat templating and streaming detokenization.

A byte-level BPE GGUF (``tokenizer.ggml.model`` "gpt2") is rebuilt with the model's original pre-tokenizer,
chosen by ``tokenizer.ggml.pre`` from ``PRE_TOKENIZERS`` (the same families as llama.cpp's ``llama-vocab.cpp``);
transformers' own GGUF conversion splits digits and whitespace differently for e.g. SmolLM2, so we do not
use it. A SentencePiece GGUF ("llama") is rebuilt by ``tokenizer_spm``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from mcp2026.errors import ModelLoadError
from mcp2026.loading.chat_templates import builtin_chat_template
from mcp2026.loading.gguf_file import GGUFFile, GGUFFormatError
from mcp2026.loading.tokenizer_spm import build_spm

logger = logging.getLogger(__name__)

# gguf.TokenType values (llama.cpp's llama_token_type); copied so importing this module needs no gguf.
_TOKEN_TYPE_CONTROL = 3  # HF added token with special=True
_TOKEN_TYPE_USER_DEFINED = 4  # HF added token with special=False

# Chat templates close a turn with one of these; a model emits it when done, so it must stop generation
# even where the file's eos is another token (Llama-3 base eos is <|end_of_text|>, turns end <|eot_id|>).
_END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

# Original tokenizer.json regexes (llama.cpp keeps an equivalent rewrite of each in llama-vocab.cpp).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerLoadError(ModelLoadError, ValueError):
    """A tokenizer file or GGUF tokenizer section that cannot be used; the message names file and problem."""


@dataclass(frozen=True)
class BpeFamily:
    """How one ``tokenizer.ggml.pre`` family splits text before BPE (mirrors its HF tokenizer.json)."""

    pre_tokenizer: Callable[[], pre_tokenizers.PreTokenizer]
    normalizer: Callable[[], normalizers.Normalizer] | None = None
    ignore_merges: bool = False  # Llama-3: a word already in the vocab is one token, merges are skipped


def _gpt2() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's built-in regex is GPT-2's: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # NOTE: digits are isolated one by one *before* the GPT-2 regex, so "In 2026" -> "In", " ", "2", "0", ...
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _regex_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )

    return build


_GPT2 = BpeFamily(_gpt2)
_STARCODER = BpeFamily(_digits_then_gpt2)
PRE_TOKENIZERS: dict[str, BpeFamily] = {
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "smollm": _STARCODER,  # SmolLM/SmolLM2: Sequence[Digits(individual), ByteLevel(use_regex)]
    "starcoder": _STARCODER,
    "llama-bpe": BpeFamily(_regex_then_bytes(_LLAMA3_PATTERN), ignore_merges=True),
    "qwen2": BpeFamily(_regex_then_bytes(_QWEN2_PATTERN), normalizer=normalizers.NFC),
}


class Tokenizer:
    """Our wrapper over a ``tokenizers.Tokenizer``: ids in and out, chat prompts, stop tokens.

    ``encode`` prepends ``bos_token_id`` iff ``add_bos`` and ``add_special_tokens`` (and appends
    ``eos_token_ids[0]`` iff ``add_eos`` too); it never relies on the backend's post-processor, so GGUF and
    HF sources behave alike. Special-token text inside ``text`` is always matched to its id (as HF does).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
        add_eos: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.add_eos = add_eos and len(eos_token_ids) > 0
        self.chat_template = chat_template
        markers = _end_of_turn_ids(backend, chat_template)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos_token_ids, *markers]))
        self._compiled: tuple[str, jinja2.Template] | None = None  # (source, compiled) chat template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if not add_special_tokens:
            return ids
        bos = [self.bos_token_id] if self.add_bos else []
        return [*bos, *ids, self.eos_token_ids[0]] if self.add_eos else [*bos, *ids]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render like transformers' ``apply_chat_template(tokenize=False)``; ``tools`` are OpenAI tool dicts."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; encode plain text instead")
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, _chat_environment().from_string(self.chat_template))
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return self._compiled[1].render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=list(tools)
            if tools
            else None,  # templates test it with `is not none`, as transformers passes it
            documents=None,
            **{name: token for name, token in specials.items() if token is not None},
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        # The template writes any BOS itself, so no special tokens are added here (as in transformers).
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False
        )

    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | Any) -> Tokenizer:
        """From a GGUF path (only the metadata is read), a parsed ``GGUFFile`` or a ``gguf.GGUFReader``.

        Without ``tokenizer.chat_template`` the built-in template for ``general.architecture`` is used,
        where there is one (``chat_templates``)."""
        if isinstance(source, (str, os.PathLike)):
            path, metadata = os.fspath(source), read_gguf_metadata(source)
        elif isinstance(source, GGUFFile):
            path, metadata = str(source.path), source.metadata
        else:
            path = str(getattr(source.data, "filename", "<GGUF reader>"))
            metadata = {
                k: f.contents()
                for k, f in source.fields.items()
                if k.startswith("tokenizer.") or k == "general.architecture"
            }

        def fail(problem: str) -> TokenizerLoadError:
            return TokenizerLoadError(f"{path}: {problem}")

        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise fail("GGUF has no tokenizer.ggml.tokens field (the vocabulary); cannot build a tokenizer")
        is_spm = metadata.get("tokenizer.ggml.model") == "llama"
        backend = _gguf_backend(metadata, path, fail)

        def token_id(key: str) -> int | None:
            value = metadata.get(key)
            if value is not None and not 0 <= int(value) < len(tokens):
                raise fail(f"{key} = {value} is outside the vocabulary (size {len(tokens)})")
            return None if value is None else int(value)

        eos_ids = [token_id(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
        chat_template = metadata.get("tokenizer.chat_template")
        if chat_template is None:
            architecture = metadata.get("general.architecture")
            chat_template = builtin_chat_template(architecture)
            if chat_template is not None:
                logger.info(
                    "%s: no chat template in the file; using the built-in %s template", path, architecture
                )
        # NOTE: the add_bos default is llama.cpp's: on for SentencePiece vocabularies, off for byte-level BPE
        return cls(
            backend,
            bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[i for i in eos_ids if i is not None],
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", is_spm)),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=chat_template,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From tokenizer.json plus tokenizer_config.json, and generation_config.json, special_tokens_map.json,
        chat_template.jinja / chat_template.json where present."""
        folder = Path(path)
        try:
            backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises its own Exception type for a missing or broken file
            raise TokenizerLoadError(f"{folder / 'tokenizer.json'}: cannot load ({e})") from None
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")

        def special_id(name: str) -> int | None:
            entry = config.get(name) or special_map.get(name)
            content = entry.get("content") if isinstance(entry, dict) else entry
            token_id = backend.token_to_id(content) if content else None
            if content and token_id is None:
                raise TokenizerLoadError(f"{folder}: {name} {content!r} is not in tokenizer.json")
            return token_id

        bos_id = special_id("bos_token")
        if bos_id is None and isinstance(generation.get("bos_token_id"), int):
            bos_id = generation["bos_token_id"]
        generation_eos = generation.get("eos_token_id")
        generation_eos = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # not configured: does the tokenizer.json post-processor add it?
            with_bos = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and with_bos[:1] == [bos_id] and len(with_bos) > 1
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=[i for i in (special_id("eos_token"), *generation_eos) if i is not None],
            add_bos=bool(add_bos),
            chat_template=_hf_chat_template(folder, config),
        )


class IncrementalDetokenizer:
    """Streams text for ids pushed one at a time; the deltas (plus ``flush()``) concatenate to
    ``tokenizer.decode(all_ids)``. A delta never ends in half a UTF-8 character.

    Each push decodes only a short window: ids from ``prefix`` (text already emitted, kept for context)
    to the end, as vLLM/TGI do. Text is released once it no longer ends in U+FFFD (an incomplete byte run).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = list(prompt_ids[-4:])  # a little prompt context, never emitted
        self._num_emitted = len(self._window)  # window[:num_emitted] is text already returned

    def push(self, token_id: int) -> str:
        self._window.append(token_id)
        emitted_text = self._decode(self._window[: self._num_emitted])
        text = self._decode(self._window)
        if len(text) <= len(emitted_text) or text.endswith("\ufffd"):
            return ""
        del self._window[: self._num_emitted]
        self._num_emitted = len(self._window)
        return text[len(emitted_text) :]

    def flush(self) -> str:
        """What is still held back (an unfinished UTF-8 run decodes to U+FFFD, as ``decode`` does)."""
        emitted_text = self._decode(self._window[: self._num_emitted])
        text = self._decode(self._window)
        del self._window[: self._num_emitted]
        self._num_emitted = len(self._window)
        return text[len(emitted_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""


def _gguf_backend(
    metadata: Mapping[str, Any], path: str, fail: Callable[[str], Exception]
) -> tokenizers.Tokenizer:
    """The ``tokenizers`` backend a GGUF vocabulary describes (``tokenizer.ggml.tokens`` is present)."""
    kind, tokens = metadata.get("tokenizer.ggml.model"), metadata["tokenizer.ggml.tokens"]
    token_types = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise fail(f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
    if kind == "llama":
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise fail(
                "GGUF has no tokenizer.ggml.scores field; a 'llama' (SentencePiece) vocabulary needs it"
            )
        # llama.cpp's default for a SentencePiece vocabulary whose file does not say
        add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        return build_spm(tokens, scores, token_types, add_space_prefix=add_space_prefix, fail=fail)
    if kind != "gpt2":
        raise fail(
            f"tokenizer.ggml.model is {kind!r}; supported are 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise fail("GGUF has no tokenizer.ggml.merges field; a 'gpt2' BPE tokenizer needs its merges")
    pre = metadata.get("tokenizer.ggml.pre")
    family = PRE_TOKENIZERS.get(pre) if pre is not None else None
    if family is None:
        logger.warning(
            "%s: unknown tokenizer.ggml.pre %r; falling back to the GPT-2 pre-tokenizer", path, pre
        )
        family = _GPT2
    return _build_bpe(tokens, merges, token_types, family, fail)


def _build_bpe(
    tokens: list[str],
    merges: list[str],
    token_types: list[int],
    family: BpeFamily,
    fail: Callable[[str], Exception],
) -> tokenizers.Tokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise fail(f"tokenizer.ggml.tokens has {len(tokens) - len(vocab)} duplicate entries")
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if bad := next((m for m, p in zip(merges, pairs, strict=True) if len(p) != 2), None):
        raise fail(f"tokenizer.ggml.merges entry {bad!r} is not two space-separated symbols")
    # NOTE: unk_token stays None as in the HF files: a byte missing from the vocab is dropped, not <unk>.
    model = models.BPE(vocab=vocab, merges=pairs, unk_token=None, ignore_merges=family.ignore_merges)
    backend = tokenizers.Tokenizer(model)
    if family.normalizer is not None:
        backend.normalizer = family.normalizer()
    backend.pre_tokenizer = family.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(token, special=kind == _TOKEN_TYPE_CONTROL, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (v2/v3), without touching tensors (see loading/gguf_file.py)."""
    try:
        return GGUFFile.open(path, tensors=False).metadata
    except (OSError, GGUFFormatError) as e:
        raise TokenizerLoadError(f"{path}: not a readable GGUF file ({e})") from None


def _end_of_turn_ids(backend: tokenizers.Tokenizer, chat_template: str | None) -> list[int]:
    """Ids of special end-of-turn tokens that the chat template writes."""
    if not chat_template:
        return []
    specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    return [specials[m] for m in _END_OF_TURN_MARKERS if m in chat_template and m in specials]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"{path}: not valid JSON ({e})") from None


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    # transformers saves the template beside the config in newer versions; that copy wins.
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; render as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, **options: Any) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON (indent, separators, sort_keys).
    return json.dumps(value, ensure_ascii=ensure_ascii, **options)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """The jinja environment transformers renders chat templates in (untrusted code: sandboxed)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
