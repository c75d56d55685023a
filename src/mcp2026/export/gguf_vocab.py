"""The tokenizer of a GGUF export. From a GGUF source every ``tokenizer.*`` key is copied as it was stored
(same ids, same pre-tokenizer, same template); from a Hugging Face tokenizer.json a byte-level BPE vocabulary is
written the way llama.cpp's converter writes it, its pre-tokenizer named by the family that splits text the same
way (``loading.tokenizer.PRE_TOKENIZERS``, the names llama.cpp knows)."""

from __future__ import annotations

import json
from typing import Any

import gguf

from mcp2026.errors import ExportError
from mcp2026.loading.gguf_file import GGUFFile
from mcp2026.loading.tokenizer import PRE_TOKENIZERS, Tokenizer

# Text the pre-tokenizer families split differently: digit runs, contractions, spaces, newlines, accents, CJK
PROBE = "Hello world! It's 2026, we'd 12345 naïve café\n\n  x  \t y ‘quoted’ 日本語 ?!? e\u0301 $4.50"


def _copy_source_keys(writer: gguf.GGUFWriter, source: GGUFFile) -> None:
    for key, value in source.metadata.items():
        if not key.startswith("tokenizer."):
            continue
        kind, item_kind = source.value_types[key]
        sub_type = None if item_kind is None else gguf.GGUFValueType(item_kind)
        writer.add_key_value(key, value, gguf.GGUFValueType(kind), sub_type)


def pre_tokenizer_name(tokenizer: Tokenizer) -> str:
    """The ``tokenizer.ggml.pre`` whose split (and normalization) of ``PROBE`` equals this tokenizer's."""
    backend = tokenizer.backend
    if backend.pre_tokenizer is None:
        raise ExportError("the tokenizer has no pre-tokenizer; llama.cpp cannot split text like it")
    text = backend.normalizer.normalize_str(PROBE) if backend.normalizer is not None else PROBE
    ours = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    for name, family in PRE_TOKENIZERS.items():
        normalized = family.normalizer().normalize_str(PROBE) if family.normalizer is not None else PROBE
        if normalized == text and [p for p, _ in family.pre_tokenizer().pre_tokenize_str(normalized)] == ours:
            return name
    raise ExportError(
        "the tokenizer splits text like none of the pre-tokenizers llama.cpp names that mcp2026 knows "
        f"({', '.join(PRE_TOKENIZERS)}); convert the model with llama.cpp's converter instead"
    )


def _hf_vocab(writer: gguf.GGUFWriter, tokenizer: Tokenizer) -> None:
    data: dict[str, Any] = json.loads(tokenizer.backend.to_str())
    model = data.get("model") or {}
    decoder = data.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise ExportError(
            "only byte-level BPE tokenizers (GPT-2 style) are written to GGUF from a tokenizer.json; this one is "
            f"{model.get('type')} with a {decoder.get('type')} decoder: convert from the model's GGUF instead"
        )
    added = {int(a["id"]): a for a in data.get("added_tokens", [])}
    size = max([*model["vocab"].values(), *added]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for token, i in model["vocab"].items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    eos = tokenizer.eos_token_ids
    if eos:
        writer.add_eos_token_id(eos[0])
    if len(eos) > 1:  # the end-of-turn token the chat template writes
        writer.add_eot_token_id(eos[1])
    writer.add_add_bos_token(tokenizer.add_bos)
    writer.add_add_eos_token(tokenizer.add_eos)


def add_vocab(writer: gguf.GGUFWriter, tokenizer: Tokenizer | None, source: GGUFFile | None) -> None:
    """The vocabulary, special tokens and chat template, from the source GGUF's keys or the tokenizer."""
    if source is not None and "tokenizer.ggml.tokens" in source.metadata:
        _copy_source_keys(writer, source)
        if "tokenizer.chat_template" in source.metadata or tokenizer is None:
            return
    elif tokenizer is None:
        raise ExportError(
            "the model has no tokenizer, and llama.cpp needs one in the GGUF; add tokenizer.json (and "
            "tokenizer_config.json) to the model folder"
        )
    else:
        _hf_vocab(writer, tokenizer)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
