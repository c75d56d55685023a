"""llama.cpp's SentencePiece tokenizer ported line by line to plain Python (no ``tokenizers``), the oracle for
``loading/tokenizer_spm.py``, plus tiny SentencePiece GGUF files written with the ``gguf`` package.

The port follows llama.cpp's ``src/llama-vocab.cpp``: ``tokenizer_st_partition`` (control, unknown and
user-defined tokens cut out of the raw text, longest token text first, every occurrence left to right),
then per raw fragment a space in front when ``add_space_prefix`` and the previous fragment was a token,
spaces escaped to "▁", and ``llm_tokenizer_spm_session::tokenize``: a priority queue of adjacent pairs whose
concatenation is a vocabulary entry (highest score first, leftmost on ties), merged until none is left;
a symbol that is not an entry is spelled as <0xNN> byte tokens.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import gguf

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


class ReferenceSpm:
    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        token_types: Sequence[int],
        add_space_prefix: bool,
    ) -> None:
        self.tokens, self.scores, self.add_space_prefix = list(tokens), list(scores), add_space_prefix
        self.ids = {token: i for i, token in enumerate(tokens)}
        cut_out = [i for i, kind in enumerate(token_types) if kind in (UNKNOWN, CONTROL, USER_DEFINED)]
        self.cut_out = sorted(cut_out, key=lambda i: len(tokens[i].encode()), reverse=True)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        previous_is_token = True
        for fragment in self._partition(text):
            if isinstance(fragment, int):
                ids.append(fragment)
                previous_is_token = True
                continue
            if self.add_space_prefix and previous_is_token:
                fragment = " " + fragment
            ids += self._tokenize(fragment.replace(" ", SPACE))
            previous_is_token = False
        return ids

    def _partition(self, text: str) -> list[str | int]:
        fragments: list[str | int] = [text] if text else []
        for token_id in self.cut_out:
            content = self.tokens[token_id]
            if content not in text:
                continue
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int):
                    split.append(fragment)
                    continue
                for n, part in enumerate(fragment.split(content)):
                    if n:
                        split.append(token_id)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _tokenize(self, text: str) -> list[int]:
        symbols = [[char, i - 1, i + 1 if i + 1 < len(text) else -1] for i, char in enumerate(text)]
        queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, size)

        def try_add_pair(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            merged = symbols[left][0] + symbols[right][0]
            token_id = self.ids.get(merged)
            if token_id is not None:
                heapq.heappush(queue, (-self.scores[token_id], left, right, len(merged)))

        for i in range(1, len(symbols)):
            try_add_pair(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            left_symbol, right_symbol = symbols[left], symbols[right]
            if (
                not left_symbol[0]
                or not right_symbol[0]
                or len(left_symbol[0]) + len(right_symbol[0]) != size
            ):
                continue  # one side was merged elsewhere since this pair was queued
            left_symbol[0] += right_symbol[0]
            right_symbol[0] = ""
            left_symbol[2] = right_symbol[2]
            if right_symbol[2] >= 0:
                symbols[right_symbol[2]][1] = left
            try_add_pair(left_symbol[1], left)
            try_add_pair(left, left_symbol[2])
        ids: list[int] = []
        i = 0 if symbols else -1
        while i != -1:
            piece = symbols[i][0]
            if piece in self.ids:
                ids.append(self.ids[piece])
            else:
                ids += [self.ids[f"<0x{b:02X}>"] for b in piece.encode()]
            i = symbols[i][2]
        return ids


# ---- tiny vocabularies ---------------------------------------------------------------------------

CORPUS = """
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs into the forest.
In 2026 there were 12345 apples and 678 oranges, sold at $3.50 each. Don't stop: they'll say it's fine.
def tokenize(text):
    return [token for token in text.split() if token]  # comment
The tokenizer turns the prompt into tokens, then the model reads the tokens and writes new ones.
Héllo wörld, café naïve — 世界 世界 你好
"""

CONTROL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# as in Gemma's vocabulary: runs of whitespace are user-defined tokens (and so are some HTML tags)
USER_DEFINED_TOKENS = [
    *("\n" * n for n in range(1, 5)),
    *(" " * n for n in range(2, 9)),
    "\t",
    "\t\t",
    "<b>",
    "</b>",
]


def train_pieces(corpus: str, num_merges: int) -> list[str]:
    """SentencePiece-style BPE pieces learned from ``corpus`` (words with their leading "▁"), most frequent
    merge first, then the single characters: the order of a SentencePiece vocabulary (scores descending)."""
    words = Counter(SPACE + word for word in corpus.split())
    symbols = {word: list(word) for word in words}
    pieces: list[str] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(symbols[word], symbols[word][1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        if a + b not in pieces:
            pieces.append(a + b)
        for word, seq in symbols.items():
            merged, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            symbols[word] = merged
    chars = sorted(set("".join(words)) - set(pieces))
    return pieces + chars


def spm_vocabulary(num_merges: int = 200) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) laid out as Gemma's GGUF is: control tokens, user-defined tokens and the
    256 byte tokens first (score 0 or -1000), then pieces with scores 0, -1, -2, ... in file order."""
    pieces = train_pieces(CORPUS, num_merges)
    tokens = [*CONTROL_TOKENS, *USER_DEFINED_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [CONTROL] * len(CONTROL_TOKENS) + [USER_DEFINED] * len(USER_DEFINED_TOKENS) + [BYTE] * 256
    types += [NORMAL] * len(pieces)
    types[CONTROL_TOKENS.index("<unk>")] = UNKNOWN
    scores = [-1000.0] * (len(CONTROL_TOKENS) + len(USER_DEFINED_TOKENS)) + [0.0] * 256
    scores += [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def write_spm_gguf(
    path: Path,
    *,
    architecture: str = "gemma3",
    flags: dict[str, bool] | None = None,
    chat_template: str | None = None,
    vocabulary: tuple[list[str], list[float], list[int]] | None = None,
) -> Path:
    """A tokenizer-only GGUF holding a SentencePiece vocabulary (default ``spm_vocabulary()``), with
    ``tokenizer.ggml.<flag>`` booleans from ``flags`` (add_bos_token, add_eos_token, add_space_prefix)."""
    tokens, scores, types = vocabulary or spm_vocabulary()
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in {"context_length": 128, "embedding_length": 64, "block_count": 1}.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_uint32(f"{architecture}.attention.head_count", 1)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    for key, token in {"padding": "<pad>", "eos": "<eos>", "bos": "<bos>", "unknown": "<unk>"}.items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", CONTROL_TOKENS.index(token))
    for flag, value in (flags or {}).items():
        writer.add_bool(f"tokenizer.ggml.{flag}", value)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
