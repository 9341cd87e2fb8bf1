"""The house's rules, checked on the code (issue 16): every module sits in a row of
ARCHITECTURE.md's layer table and imports only rows below it (imports inside functions
count), no cycle between units, no module over ~600 lines (data tables aside) and no
function over ~80 lines (its docstring aside).

Each check is parametrized by unit, so ``-k process`` checks one room."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "metnos_exec"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layers() -> dict[str, int]:
    """unit -> layer, from ARCHITECTURE.md's table (`name` for a module, `name/` for a
    package, `metnos_exec` for the package's own __init__)."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers: dict[str, int] = {}
    for row in re.finditer(r"^\| (\d+) \| ([^|]+) \|", section, re.M):
        for unit in re.findall(r"`([^`]+)`", row.group(2)):
            layers[unit] = int(row.group(1))
    return layers


LAYERS = _layers()


def unit_of(module: str) -> str:
    """The unit a module belongs to: its first-level package (``process/``) or itself."""
    if module == "metnos_exec":
        return "metnos_exec"
    parts = module.split(".")
    first = parts[1]
    if (PKG / first).is_dir():
        return first + "/"
    return first


def _imports(module: str) -> set[str]:
    """Every metnos_exec module `module` imports, anywhere in its body."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [
                f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix
                for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != module:
                out.add(target)
    return out


UNITS = sorted({unit_of(m) for m in MODULES})


def test_every_unit_has_a_row() -> None:
    missing = [u for u in UNITS if u not in LAYERS]
    assert not missing, f"units missing from ARCHITECTURE.md's layer table: {missing}"


@pytest.mark.parametrize("unit", UNITS)
def test_a_unit_imports_only_rows_below(unit: str) -> None:
    bad = []
    for module in MODULES:
        if unit_of(module) != unit:
            continue
        for target in _imports(module):
            other = unit_of(target)
            if other != unit and LAYERS.get(other, -1) > LAYERS.get(unit, -1):
                bad.append(f"{module} -> {target} (layer {LAYERS.get(other)})")
    assert not bad, f"{unit} (layer {LAYERS.get(unit)}) imports upward:\n" + "\n".join(bad)


def test_no_cycle_between_units() -> None:
    edges: dict[str, set[str]] = {u: set() for u in UNITS}
    for module in MODULES:
        for target in _imports(module):
            if unit_of(target) != unit_of(module):
                edges[unit_of(module)].add(unit_of(target))
    cycles = []
    for a in UNITS:
        for b in edges[a]:
            if a in _reach(edges, b):
                cycles.append(f"{a} -> {b} -> ... -> {a}")
    assert not cycles, "cycles between units:\n" + "\n".join(cycles)


def _reach(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _is_data(node: ast.stmt) -> bool:
    """A top-level table: an assignment whose value is a literal tuple, list, dict or set."""
    value = getattr(node, "value", None)
    return isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
        value, (ast.Tuple, ast.List, ast.Dict, ast.Set)
    )


def module_lines(path: Path) -> int:
    text = path.read_text(encoding="utf-8")
    data = sum(
        node.end_lineno - node.lineno + 1  # type: ignore[operator]
        for node in ast.parse(text).body
        if _is_data(node)
    )
    return len(text.splitlines()) - data


def long_functions(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            skip = node.body[0].end_lineno - node.body[0].lineno + 1 if doc is not None else 0  # type: ignore[operator]
            length = node.end_lineno - node.lineno + 1 - skip  # type: ignore[operator]
            if length > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    return out


@pytest.mark.parametrize("unit", UNITS)
def test_no_module_over_the_limit(unit: str) -> None:
    big = [
        f"{p.relative_to(ROOT)}: {module_lines(p)} lines"
        for m, p in MODULES.items()
        if unit_of(m) == unit and module_lines(p) > MAX_MODULE_LINES
    ]
    assert not big, f"modules over {MAX_MODULE_LINES} lines (data tables aside):\n" + "\n".join(big)


@pytest.mark.parametrize("unit", UNITS)
def test_no_function_over_the_limit(unit: str) -> None:
    long = [f for m, p in MODULES.items() if unit_of(m) == unit for f in long_functions(p)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
