"""Structured output: a request's ``StructuredOutputs`` compiled into a grammar (xgrammar), and the per-request
matcher whose allowed-token mask the sampler applies before picking each token.

xgrammar was chosen over llguidance by the measured mask cost per token on the default model's vocabulary
(docs/api.md, "Structured output"). xgrammar ignores JSON-schema keywords it does not implement instead of
failing, so schemas are checked against the keywords it enforces first: an output always validates.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, TimeoutError
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mcp2026.types import StructuredOutputs

log = logging.getLogger(__name__)

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
COMPILE_TIMEOUT_S = 10.0
_CACHE_SIZE = 256

# Keywords whose meaning xgrammar enforces (everything else is refused, so nothing is silently dropped).
_ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "$ref", "$defs", "definitions", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minLength", "maxLength", "pattern",
}  # fmt: skip
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "strict"}  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties")


class GrammarError(ValueError):
    """A constraint that cannot be enforced exactly; the message names the construct and where it is."""


def check_schema(schema: Any, where: str = "#", depth: int = 0) -> Any:
    """Refuse JSON-schema constructs xgrammar would not enforce; returns the schema to compile (string lengths
    rewritten as patterns). ``where`` is the JSON pointer of ``schema``, named in errors."""
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels at {where}")
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON-schema object or boolean, got {type(schema).__name__}")
    out = dict(schema)
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED:
            raise GrammarError(f"the schema keyword {key!r} at {where} is not supported by structured output")
        if key in _SUBSCHEMA_MAPS:
            if not isinstance(value, dict):
                raise GrammarError(f"{where}/{key} must be an object")
            out[key] = {
                name: check_schema(sub, f"{where}/{key}/{name}", depth + 1) for name, sub in value.items()
            }
        elif key in _SUBSCHEMA_LISTS:
            if not isinstance(value, list):
                raise GrammarError(f"{where}/{key} must be an array")
            out[key] = [check_schema(sub, f"{where}/{key}/{i}", depth + 1) for i, sub in enumerate(value)]
        elif key in _SUBSCHEMAS:
            out[key] = check_schema(value, f"{where}/{key}", depth + 1)
        elif key == "type" and "number" in ([value] if isinstance(value, str) else value or []):
            for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if bound in schema:  # xgrammar bounds integers only
                    raise GrammarError(
                        f"{bound!r} on a number at {where} is not supported (only on integers)"
                    )
    return _lengths_as_pattern(out, where)


def _lengths_as_pattern(schema: dict, where: str) -> dict:
    """xgrammar's own minLength/maxLength rule lets control characters into the string (invalid JSON), so a
    length becomes a pattern over plain characters (no quote, backslash or control character)."""
    if "minLength" not in schema and "maxLength" not in schema:
        return schema
    if "pattern" in schema:
        raise GrammarError(f"minLength/maxLength together with pattern at {where} is not supported")
    schema = dict(schema)
    low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
    if not isinstance(low, int) or not isinstance(high, int | str) or isinstance(high, bool):
        raise GrammarError(f"minLength/maxLength at {where} must be integers")
    schema["pattern"] = f'^[^"\\\\\\u0000-\\u001f]{{{low},{high}}}$'
    return schema


class GrammarCompiler:
    """Compiles ``StructuredOutputs`` for one tokenizer and vocabulary; compiled grammars are cached (LRU).

    Thread-safe: the server compiles on a worker thread to reject a bad constraint before queueing, and the
    engine's compute thread compiles again (a cache hit) when it adds the request.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import xgrammar  # deferred: a few hundred ms to import, and only structured requests need it
        from transformers import PreTrainedTokenizerFast  # deferred: heavy, needed once per engine

        self._xgr = xgrammar
        backend = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(
            backend, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self._lock = threading.Lock()
        # One worker: a compile that overruns its budget keeps running (xgrammar cannot be interrupted) and
        # later compiles queue behind it instead of piling up CPU work.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def compile(self, spec: StructuredOutputs, timeout_s: float = COMPILE_TIMEOUT_S) -> Any:
        """The compiled grammar for ``spec``; raises ``GrammarError`` naming what cannot be enforced."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        future = self._pool.submit(self._compile, spec)
        try:
            compiled = future.result(timeout=timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"compiling the constraint took longer than {timeout_s:g} s; simplify it"
            ) from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> Any:
        c = self._compiler
        try:
            if spec.json is not None:
                if len(spec.json) > MAX_SCHEMA_BYTES:
                    raise GrammarError(
                        f"the JSON schema is {len(spec.json)} bytes; the limit is {MAX_SCHEMA_BYTES}"
                    )
                schema = check_schema(json.loads(spec.json))
                return c.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
            if spec.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.grammar is not None:
                return c.compile_grammar(spec.grammar)
            choices = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice or ())
            return c.compile_grammar(f"root ::= {choices}")
        except GrammarError:
            raise
        except (RuntimeError, ValueError) as e:  # xgrammar's parse errors carry a C++ source prefix
            message = str(e).strip().splitlines()[0]
            raise GrammarError(message.split(": ", 1)[-1] if message.startswith("[") else message) from None

    def matcher(self, spec: StructuredOutputs, eos_token_ids: Sequence[int]) -> GrammarMatcher:
        return GrammarMatcher(self._xgr, self.compile(spec), self.vocab_size, eos_token_ids)


class GrammarMatcher:
    """One request's position in its grammar. It catches up with the request's output tokens lazily, so the
    engine only appends tokens (preemption keeps them, so recompute needs nothing here)."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._eos_token_ids = list(eos_token_ids)
        self._matcher = xgr.GrammarMatcher(compiled)
        self._num_accepted = 0
        self.error: str | None = None

    def fill_mask(self, output_token_ids: Sequence[int], bitmask: Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` ((ceil(V / 32),) int32, bit j of word i =
        token 32 i + j), after accepting the outputs not yet seen."""
        if len(output_token_ids) < self._num_accepted:  # outputs were taken back: so is the grammar's state
            self._matcher.rollback(self._num_accepted - len(output_token_ids))
            self._num_accepted = len(output_token_ids)
        for token_id in output_token_ids[self._num_accepted :]:
            if self.error is None and not self._matcher.accept_token(token_id):
                self.error = f"token {token_id} broke the grammar"  # a sampler bug: the mask forbade it
                log.error("structured output: %s", self.error)
            self._num_accepted += 1
        if self.error is None and not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)
            return
        bitmask[row] = 0  # only ending is left (or, after a broken grammar, the only safe move)
        for token_id in self._eos_token_ids:
            bitmask[row, token_id // 32] |= 1 << (token_id % 32)


def allocate_bitmask(num_rows: int, vocab: int) -> Tensor:
    return torch.zeros(num_rows, (vocab + 31) // 32, dtype=torch.int32)


def unpack_bitmask(bitmask: Tensor, vocab: int) -> Tensor:
    """(n, ceil(V / 32)) int32 packed masks (bit j of word i = token 32 i + j) -> (n, vocab) bool."""
    as_bytes = bitmask.contiguous().numpy().view(np.uint8)  # little-endian: byte k of a word = bits 8k..8k+7
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits).bool()
