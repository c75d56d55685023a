"""The folders are the architecture: imports point down the layers, and nothing imports in a circle; and a
module holds one concept, so none grows past ``MAX_MODULE_LINES``.

Every import in src/mcp2026 counts (module level, inside functions, under ``TYPE_CHECKING``): a lower layer
that needs to call up takes a callable or a small Protocol instead. Packages on one layer may import each
other, but never both ways round, and no two modules anywhere may import each other, directly or not.
Imports inside functions are few, and each says why (an optional dependency, or a heavy one deferred).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mcp2026"

# Top to bottom; a package or top-level module imports only from its own layer or the layers below.
# cli_errors is the typer commands' shared error handler (it needs only errors, typer and rich), cli_lazy the
# group that imports a command's module when it runs (a LazyCommand's "module:attribute" counts as an import of
# that module here); sharegpt
# locates and splits the ShareGPT text that calibration (quant) and evaluation (bench) both read; compiler is
# `mcp2026 compile`'s load -> quantize -> save, beside the pipeline; export writes what loading reads, beside it.
# "mcp2026" is the package's own __init__: the public facade, importable from nowhere inside.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("mcp2026", "cli"),
    ("serve", "canary", "doctor", "bench"),
    ("pipeline", "compiler"),
    ("engine",),
    ("loading", "export"),
    ("kv", "quant", "models"),
    ("kernels",),
    ("config", "rope_types", "types", "errors", "hardware", "cli_errors", "cli_lazy", "sharegpt"),
)
RANK = {unit: len(LAYERS) - i for i, layer in enumerate(LAYERS) for unit in layer}

# Function-local imports defer an optional dependency (OpenTelemetry, llama-cpp-python, Triton) or a heavy one
# (transformers for a peer, a compiler toolchain); everything else imports at the top of its module.
MAX_FUNCTION_LOCAL_IMPORTS = 40


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def unit_of(module: str) -> str:
    """The package (or top-level module) a module belongs to: what the layer table names."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The mcp2026 modules an import statement loads (``from pkg import mod`` names the module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
        ]
    out = []
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name != module:
            out.append(name)
    return out


def _lazy_target(node: ast.AST) -> str | None:
    """The module a ``LazyCommand(name, "module:attribute", help)`` imports when its command runs."""
    if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LazyCommand"):
        return None
    target = node.args[1] if len(node.args) > 1 else None
    if isinstance(target, ast.Constant) and isinstance(target.value, str):
        return target.value.partition(":")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(_targets(module, node))
            elif (lazy := _lazy_target(node)) is not None:
                assert lazy in MODULES, f"{module}: LazyCommand names {lazy}, which is not a module"
                graph[module].add(lazy)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _edges_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    members = set(component)
    return [f"{a} -> {b}" for a in component for b in sorted(graph.get(a, ())) if b in members]


def test_every_unit_has_a_layer():
    missing = sorted({unit_of(m) for m in MODULES} - set(RANK))
    assert not missing, f"add these to LAYERS in {Path(__file__).name}: {missing}"


def test_imports_point_down():
    graph = import_graph()
    upward = [
        f"{a} ({unit_of(a)}) -> {b} ({unit_of(b)})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if RANK.get(unit_of(b), 0) > RANK.get(unit_of(a), 0)
    ]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_cycles_between_packages():
    graph = import_graph()
    units: dict[str, set[str]] = defaultdict(set)
    for a, targets in graph.items():
        units[unit_of(a)].update(unit_of(b) for b in targets if unit_of(b) != unit_of(a))
    found = cycles(units)
    assert not found, "package cycles:\n" + "\n".join(
        f"{c}: " + ", ".join(_edges_within(units, c)) for c in found
    )


def test_no_cycles_between_modules():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "module cycles:\n" + "\n".join(
        f"{c}:\n  " + "\n  ".join(_edges_within(graph, c)) for c in found
    )


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"c"}}, []),
    ],
)
def test_cycles_finds_strongly_connected_components(graph, expected):
    assert sorted(cycles(graph)) == expected


def test_targets_resolve_relative_and_package_imports():
    node = ast.parse("from mcp2026.kv import manager").body[0]
    assert _targets("mcp2026.engine.engine", node) == ["mcp2026.kv.manager"]
    node = ast.parse("from mcp2026.kv.manager import KVCacheManager").body[0]
    assert _targets("mcp2026.engine.engine", node) == ["mcp2026.kv.manager"]


# One concept per module keeps every module short enough to read whole: a file past this holds more than one
# concept and splits by concept (not at the line).
MAX_MODULE_LINES = 500


def modules_over(paths, limit: int) -> dict[str, int]:
    """Line count of every file in ``paths`` longer than ``limit`` lines."""
    counts = {str(p): len(p.read_text(encoding="utf-8").splitlines()) for p in paths}
    return {name: n for name, n in counts.items() if n > limit}


def test_no_module_is_over_the_line_limit():
    long = modules_over(MODULES.values(), MAX_MODULE_LINES)
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each by concept): {long}"


def test_modules_over_counts_lines(tmp_path):
    short, long = tmp_path / "short.py", tmp_path / "long.py"
    short.write_text("x = 1\n" * MAX_MODULE_LINES)
    long.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert modules_over([short, long], MAX_MODULE_LINES) == {str(long): MAX_MODULE_LINES + 1}
    assert len(MODULES) > 100  # the walk found the package


def function_local_imports(tree: ast.AST) -> list[int]:
    """First lines of the import statements inside function bodies (nested blocks and classes included)."""
    found: list[int] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child.lineno)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found


def says_why(lines: list[str], lineno: int) -> bool:
    """A comment on the import's first line, or a whole-line comment just above it, that is more than a linter
    directive (``# noqa: F401`` alone gives no reason)."""
    own = lines[lineno - 1].partition("#")[2]
    above = lines[lineno - 2].strip() if lineno >= 2 else ""
    comments = [own, above[1:] if above.startswith("#") else ""]
    reasons = [
        re.sub(r"(noqa|type:\s*ignore)(:?\s*[A-Z]+[0-9]+)*(,\s*[A-Z]+[0-9]+)*", "", c) for c in comments
    ]
    return any(re.search(r"[A-Za-z]{3}", r) for r in reasons)


def test_function_local_imports_are_few_and_say_why():
    where: list[str] = []
    silent: list[str] = []
    for path in MODULES.values():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for lineno in function_local_imports(ast.parse(text, str(path))):
            place = f"{path.relative_to(SRC.parent)}:{lineno}: {lines[lineno - 1].strip()}"
            where.append(place)
            if not says_why(lines, lineno):
                silent.append(place)
    assert len(where) <= MAX_FUNCTION_LOCAL_IMPORTS, (
        f"{len(where)} imports inside functions (at most {MAX_FUNCTION_LOCAL_IMPORTS}): move those that defer "
        "no optional or heavy dependency to the top of their module\n" + "\n".join(where)
    )
    assert not silent, "imports inside functions need a comment saying why (on the line or just above):\n" + (
        "\n".join(silent)
    )


def test_function_local_imports_finds_nested_ones_only():
    tree = ast.parse(
        "import os\n"
        "def f():\n"
        "    import json\n"
        "    if True:\n"
        "        from re import sub\n"
        "class C:\n"
        "    import sys\n"
        "    async def g(self):\n"
        "        import io\n"
    )
    assert function_local_imports(tree) == [3, 5, 9]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (["def f():", "    import torch"], False),
        (["def f():", "    import torch  # noqa: F401"], False),
        (["def f():", "    import torch  # noqa: F401  # optional: the cuda extra"], True),
        (["def f():", "    # heavy: only a build needs it", "    import torch"], True),
        (["    x = 1  # unrelated", "    import torch"], False),
    ],
)
def test_says_why_wants_a_reason(source, expected):
    assert says_why(source, len(source)) is expected


def test_lazy_commands_count_as_imports():
    graph = import_graph()
    assert "mcp2026.bench.cli" in graph["mcp2026.cli"]
    assert "mcp2026.bench.latency_cli" in graph["mcp2026.bench.cli"]
