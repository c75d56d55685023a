"""The C++ kernel sources as files: one concept each (a size bound), one copy of each helper, all built and hashed."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from mcp2026.kernels import cpu

MAX_LINES = 800

# An inline function: `inline` (or `static inline`), a return type, then its name and "(".
_INLINE_FUNCTION = re.compile(r"^\s*(?:static\s+)?inline\s+[\w:<>,*&\s]+?\b(\w+)\s*\(", re.MULTILINE)
_COMMENT = re.compile(r"//[^\n]*")


def _cpp_files() -> list[Path]:
    return sorted([*cpu.KERNEL_DIR.glob("*.cpp"), *cpu.KERNEL_DIR.glob("*.h")])


def inline_functions(text: str) -> list[tuple[str, str]]:
    """(name, body with comments and whitespace removed) of each inline function defined in C++ text."""
    text = _COMMENT.sub("", text)
    found = []
    for match in _INLINE_FUNCTION.finditer(text):
        brace, semicolon = text.find("{", match.end()), text.find(";", match.end())
        if brace < 0 or 0 <= semicolon < brace:
            continue  # a declaration: no body here
        depth, end = 0, brace
        for end in range(brace, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        body = re.sub(r"\s+", "", text[brace : end + 1])
        found.append((match.group(1), body))
    return found


def duplicated_helpers(files: dict[str, str]) -> list[str]:
    """What is written twice: a helper name defined in more than one file, or one body under two names."""
    where: dict[str, set[str]] = {}
    bodies: dict[str, set[str]] = {}
    for file_name, text in files.items():
        for name, body in inline_functions(text):
            where.setdefault(name, set()).add(file_name)
            bodies.setdefault(body, set()).add(f"{file_name}:{name}")
    problems = [f"{name} defined in {sorted(names)}" for name, names in where.items() if len(names) > 1]
    problems += [f"one body in {sorted(owners)}" for owners in bodies.values() if len(owners) > 1]
    return problems


def test_every_kernel_source_stays_under_the_size_bound():
    sizes = {path.name: len(path.read_text().splitlines()) for path in _cpp_files()}
    too_long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_long, f"split these by concept (at most {MAX_LINES} lines a file): {too_long}"


def test_no_helper_is_defined_twice():
    files = {path.name: path.read_text() for path in _cpp_files()}
    assert sum(len(inline_functions(text)) for text in files.values()) > 50  # the pattern finds the helpers
    assert duplicated_helpers(files) == []


# What the shared helpers compute, recognised in any copy however it is named or spelled: the exp scheme's
# log2(e), the horizontal-reduction shuffle, the bf16 -> float widening.
_SHARED_IDIOMS = ("1.44269504088896341f", "_mm_movehdup_ps", "_mm256_cvtepu16_epi32", "_mm512_cvtepu16_epi32")


@pytest.mark.parametrize("idiom", _SHARED_IDIOMS)
def test_the_shared_vector_idioms_are_written_only_in_simd_h(idiom):
    assert [path.name for path in _cpp_files() if idiom in path.read_text()] == ["simd.h"]


def test_the_duplicate_check_finds_a_copied_or_renamed_helper():
    helper = (
        "inline float hsum(__m256 v) {\n  return _mm_cvtss_f32(_mm256_castps256_ps128(v));  // low lane\n}\n"
    )
    renamed = "static inline float attn_hsum(__m256 v) { return _mm_cvtss_f32(_mm256_castps256_ps128(v)); }\n"
    declared = "inline float hsum(__m256 v);\n"
    assert duplicated_helpers({"a.cpp": helper, "b.h": declared}) == []
    assert duplicated_helpers({"a.cpp": helper, "b.cpp": helper}) != []
    assert duplicated_helpers({"a.cpp": helper, "b.cpp": renamed}) != []
    assert duplicated_helpers({"a.cpp": helper + renamed}) != []
    assert inline_functions(
        "template <int M>\ninline void gemv(const float* x) {\n  if (x) { run(); }\n}\n"
    ) == [("gemv", "{if(x){run();}}")]


def test_the_build_compiles_and_hashes_every_kernel_file():
    listed = sorted(path.name for path in (*cpu.SOURCES, *cpu.HEADERS))
    assert listed == [path.name for path in _cpp_files()]
    assert all(path.suffix == ".cpp" for path in cpu.SOURCES)
    bindings = [path.name for path in cpu.SOURCES if "PYBIND11_MODULE" in path.read_text()]
    assert bindings == ["bindings.cpp"]


@pytest.mark.parametrize("edited", ["simd.h", "decode_attention.cpp", "kv_blocks.h", "gemv.cpp"])
def test_an_edit_to_any_source_or_header_changes_the_build_key(tmp_path, monkeypatch, edited):
    copies = tmp_path / "kernels"
    shutil.copytree(cpu.KERNEL_DIR, copies, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(cpu, "SOURCES", tuple(copies / path.name for path in cpu.SOURCES))
    monkeypatch.setattr(cpu, "HEADERS", tuple(copies / path.name for path in cpu.HEADERS))
    key = cpu.build_key()
    with (copies / edited).open("a") as f:
        f.write("\n")
    assert cpu.build_key() != key
