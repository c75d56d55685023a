"""Compile time and mask time per token of xgrammar and llguidance on the default model's tokenizer.

Steps each engine's matcher through one valid 46-token object of a nested schema, one thread, and prints the
figures docs/api.md quotes. Needs `pip install xgrammar llguidance`.
Run: python examples/structured/grammar_engines.py
"""

from __future__ import annotations

import json
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.torch as llt
import numpy as np
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from mcp2026.loading.loader import default_model_path
from mcp2026.loading.tokenizer import Tokenizer

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
TARGET = {
    "name": "Alice Smith",
    "age": 42,
    "tags": ["a", "c", "b"],
    "address": {"city": "Paris", "zip": "75001"},
}


def report(name: str, setup_s: float, compile_s: float, mask_s: list[float]) -> None:
    print(
        f"{name}: tokenizer setup {setup_s * 1e3:.0f} ms, compile {compile_s * 1e3:.1f} ms, mask per token "
        f"median {statistics.median(mask_s) * 1e6:.0f} us, p90 {np.percentile(mask_s, 90) * 1e6:.0f} us, "
        f"max {max(mask_s) * 1e6:.0f} us"
    )


def main() -> None:
    tok = Tokenizer.from_gguf(default_model_path())
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    ids = tok.encode(json.dumps(TARGET), add_special_tokens=False)
    print(f"{len(ids)} tokens, vocabulary {VOCAB}")

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=list(tok.eos_token_ids))
    setup = time.perf_counter() - t
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    for _ in range(3):  # the last of three passes: warm caches
        matcher, times = xgr.GrammarMatcher(compiled), []
        for token_id in ids:
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t)
            assert matcher.accept_token(token_id)
    report("xgrammar", setup, compile_s, times)

    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t
    bitmask = llt.allocate_token_bitmask(1, VOCAB)
    for _ in range(3):
        matcher, times = llguidance.LLMatcher(lltok, grammar), []
        for token_id in ids:
            t = time.perf_counter()
            llt.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - t)
            assert matcher.consume_token(token_id), matcher.get_error()
    report("llguidance", setup, compile_s, times)


if __name__ == "__main__":
    main()
