"""SentencePiece vocabularies in GGUF (``tokenizer.ggml.model == "llama"``: Gemma, Llama-2, Mistral) rebuilt
as a ``tokenizers`` BPE that splits text exactly as llama.cpp's SPM tokenizer (``llm_tokenizer_spm``) does.

llama.cpp starts from the characters of each text fragment (spaces written as "▁") and keeps merging the
adjacent pair whose concatenation is the highest-scoring vocabulary entry; a character that is not an
entry becomes <0xNN> byte tokens. A BPE whose merges are every split of every entry into two entries,
ranked by that entry's score, makes the same choices. Control, unknown and user-defined entries are
matched whole in the raw text before that (llama.cpp's special-token partition), so they are added tokens.
NOTE: llama.cpp matches the longest added token first, ``tokenizers`` the leftmost; they differ only where two
added tokens overlap in the text ("ab" and "bcd" in "abcd"); Gemma 3's added tokens have no such pair.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from itertools import compress
from operator import itemgetter

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

SPACE = "\u2581"  # "▁": SentencePiece writes a space as this character


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``, gguf's ``TokenType``)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Entries a merge can produce; the others never reach the merge step (matched whole beforehand).
_MERGEABLE = (TokenType.NORMAL, TokenType.UNUSED, TokenType.BYTE)
_SPECIAL = (TokenType.CONTROL, TokenType.UNKNOWN)


def build_spm(
    tokens: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    *,
    add_space_prefix: bool,
    fail: Callable[[str], Exception],
) -> tokenizers.Tokenizer:
    """The backend for one SentencePiece vocabulary; ``fail(problem)`` makes the error for bad metadata."""
    if len(scores) != len(tokens):
        raise fail(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise fail(f"tokenizer.ggml.tokens has {len(tokens) - len(vocab)} duplicate entries")
    if missing := [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]:
        raise fail(
            f"the SentencePiece vocabulary lacks {len(missing)} byte tokens ({missing[0]}, ...): "
            "characters outside the vocabulary could not be encoded; re-convert the model with byte fallback"
        )
    unk = next((t for t, kind in zip(tokens, token_types, strict=True) if kind == TokenType.UNKNOWN), None)
    model = models.BPE(
        vocab=vocab,
        merges=_merges(tokens, scores, token_types, vocab),
        unk_token=unk,
        byte_fallback=True,
        fuse_unk=True,
    )
    backend = tokenizers.Tokenizer(model)
    # NOTE: no pre-tokenizer: llama.cpp merges across word boundaries within a fragment, as SentencePiece does.
    # Normalizers run on each fragment between added tokens, so Prepend gives llama.cpp's space after each.
    escape = normalizers.Replace(" ", SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if add_space_prefix else escape
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the prefix space of the first fragment is not part of the text
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    added = [
        AddedToken(token, special=kind in _SPECIAL, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind in (*_SPECIAL, TokenType.USER_DEFINED)
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


def _merges(
    tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of every mergeable entry into two entries, the highest-scoring entry's splits first
    (ties: lower id first). Two splits of one entry can never both apply, so their order does not matter."""
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    mergeable = np.isin(np.asarray(token_types), _MERGEABLE) & (lengths >= 2)
    candidate_ids = np.flatnonzero(mergeable)
    candidate_ids = candidate_ids[np.argsort(-lengths[candidate_ids], kind="stable")]  # longest first
    texts = [tokens[i] for i in candidate_ids.tolist()]
    # the candidates longer than k are texts[: num_longer[k]]
    num_longer = np.searchsorted(-lengths[candidate_ids], -np.arange(int(lengths.max())), side="left")
    owners: list[int] = []
    pairs: list[tuple[str, str]] = []
    is_entry = frozenset(vocab).__contains__  # a set probes faster than the dict
    for k in range(1, len(num_longer)):
        # NOTE: map/compress/zip keep this loop in C; it checks ~2M splits of a 262k vocabulary
        lefts = list(map(itemgetter(slice(k)), texts[: num_longer[k]]))
        with_left = list(map(is_entry, lefts))
        js = list(compress(range(len(lefts)), with_left))
        rights = list(map(itemgetter(slice(k, None)), map(texts.__getitem__, js)))
        keep = list(map(is_entry, rights))
        owners += compress(js, keep)
        pairs += compress(zip(map(lefts.__getitem__, js), rights), keep)
    owner_ids = candidate_ids[np.asarray(owners, dtype=np.int64)]
    owner_scores = np.asarray(scores, dtype=np.float64)[owner_ids]
    order = np.lexsort((owner_ids, -owner_scores)).tolist()
    return [pairs[i] for i in order]
