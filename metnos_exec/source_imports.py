"""What an executor's Python files import, read from their source without running them.

`imported_modules` parses every ``.py`` file of a folder (``__pycache__`` aside) with `ast`
and lists each absolute import as (file, line, module): ``import`` and ``from ... import``
statements anywhere in the file, ``importlib.import_module("x")`` / ``__import__("x")``
(and an alias bound by ``from importlib import import_module as f``) with a literal name,
and the imports inside a literal ``exec`` / ``eval`` / ``compile`` string. What cannot be
read is refused with `BadManifest`: a file that does not parse, a computed module name or
source text, an importer reached other than by a direct call.

It decides nothing about what may be imported: `manifest.check_packable` applies that
rule at load, and `devices.packability` holds the whole contract of packability (this
check and the dry run in the sandbox). It sits beside `manifest`, below `devices/`, so
that loading a manifest needs nothing from the devices.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from .errors import BadManifest

__all__ = ("imported_modules",)

_SKIPPED_DIRS = frozenset({"__pycache__"})


def _python_files(folder: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


_IMPORTERS: Final = frozenset({"__import__", "import_module"})
#: Builtins that run source text: a literal one is read for its imports; a computed one
#: could import anything, and is refused like a computed import.
_RUNNERS: Final = frozenset({"exec", "eval", "compile"})


def _importer_names(tree: ast.AST) -> set[str]:
    """``import_module`` / ``__import__`` and every local name bound to them by
    ``from importlib import import_module as NAME``."""
    names = set(_IMPORTERS)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names.update(a.asname for a in node.names if a.name in _IMPORTERS and a.asname)
    return names


def _literal_str(node: ast.Call) -> str | None:
    first = node.args[0] if node.args else None
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def _literal_import(node: ast.Call, importers: set[str]) -> str | bool | None:
    """The module name of ``importlib.import_module("x")`` / ``__import__("x")`` (or an
    alias); ``None`` for a computed name; ``False`` when `node` is no such call."""
    fn = node.func
    named = (isinstance(fn, ast.Name) and fn.id in importers) or (
        isinstance(fn, ast.Attribute) and fn.attr in _IMPORTERS
    )
    if not named:
        return False
    return _literal_str(node)


def _unchecked_importer(node: ast.AST, importers: set[str], calls: set[int]) -> bool:
    """An importer reached some other way than a direct call (``f = importlib.import_module``,
    ``getattr(importlib, "import_module")``, ``__builtins__["__import__"]``): what it
    imports cannot be read."""
    if id(node) in calls:
        return False
    if isinstance(node, ast.Name):
        return node.id in importers
    if isinstance(node, ast.Attribute):
        return node.attr in _IMPORTERS
    return isinstance(node, ast.Constant) and node.value in _IMPORTERS


def _refuse(root: Path, rel: str, line: int, what: str) -> BadManifest:
    return BadManifest(
        f"{root}/manifest.toml: field `packable`: {rel}:{line} {what}, which cannot be "
        "checked; import it by name or set packable = false"
    )


def _imports_of(
    tree: ast.AST, root: Path, rel: str, found: list[tuple[str, int, str]], line0: int = 0
) -> None:
    importers = _importer_names(tree)
    calls = {
        id(n.func)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _literal_import(n, importers) is not False
    }
    for node in ast.walk(tree):
        line = line0 + getattr(node, "lineno", 1) - (1 if line0 else 0)
        if isinstance(node, ast.Import):
            found.extend((rel, line, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((rel, line, node.module))
        elif isinstance(node, ast.Call):
            name = _literal_import(node, importers)
            if name is None:
                raise _refuse(
                    root, rel, line, "imports a module whose name is computed at run time"
                )
            if isinstance(name, str):
                found.append((rel, line, name))
            elif isinstance(node.func, ast.Name) and node.func.id in _RUNNERS:
                source = _literal_str(node)
                if source is None:
                    raise _refuse(
                        root, rel, line, f"runs code computed at run time ({node.func.id})"
                    )
                try:
                    inner = ast.parse(source, mode="eval" if node.func.id == "eval" else "exec")
                except (SyntaxError, ValueError):
                    continue  # it fails on the server too; nothing it imports
                _imports_of(inner, root, rel, found, line)
        elif _unchecked_importer(node, importers, calls):
            raise _refuse(
                root, rel, line, "imports through a computed name (an importer not called directly)"
            )


def imported_modules(folder: str | os.PathLike[str]) -> list[tuple[str, int, str]]:
    """Every absolute import in the folder's Python files: (file, line, module).

    Raises:
        BadManifest: a file that does not parse, or an import whose name is computed.
    """
    root = Path(folder)
    found: list[tuple[str, int, str]] = []
    for path in _python_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError) as exc:
            raise BadManifest(
                f"{root}/manifest.toml: field `packable`: {rel} cannot be read for its imports "
                f"({exc}); fix it or set packable = false"
            ) from None
        _imports_of(tree, root, rel, found)
    return found
