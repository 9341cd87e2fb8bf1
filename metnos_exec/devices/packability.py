"""Packability: can this executor really run on a device?

A manifest says ``packable = true`` (the default) when the executor may be shipped to a
remote device, which has nothing but a Python and the executor's own folder (spec sections
7 and 10). That claim is checked, not trusted:

1. **At load, by reading the code.** Every ``.py`` file of the folder (``__pycache__``
   aside) is parsed with `ast` and each import's top-level module must be in the standard
   library (`sys.stdlib_module_names`) or a module or package inside the folder. Relative
   imports stay inside the folder. ``importlib.import_module("x")`` / ``__import__("x")``
   (an alias bound by ``from importlib import import_module as f`` too) with a literal
   name are checked like imports; with a computed name they cannot be, and are refused,
   as is an importer reached any other way (``f = importlib.import_module``,
   ``getattr(m, "__import__")``, ``__builtins__["__import__"]``). ``exec`` / ``eval`` /
   ``compile`` of a literal string are read like the file; of a computed one, refused.
   Not seen (by this check nor the dry run, which looks up only the names found here):
   a file loaded by path (``spec_from_file_location``, ``runpy.run_path``, a ``sys.path``
   edit) and native libraries through ``ctypes``. This is a routing check against
   mistakes, not a wall; the device's sandbox is the wall. A violation is `BadManifest`
   (``E_BAD_MANIFEST``) naming the file, the line and the import, with the fix (make it
   stdlib-only, or ``packable = false``).
2. **At worker start, by a dry run in the sandbox** (`dry_run`): the worker's native arm
   runs ``python -I -S`` in the executor's folder and asks `importlib.util.find_spec` for
   each imported top-level module, without importing anything. ``-I -S`` keep every
   site-packages out, as on a device: a name the static check let through (a module this
   interpreter lacks) fails here and the executor is refused the same way.

``wasm`` executors import nothing but WASI (the arm links nothing else): always packable.
``wasm-python`` executors get the static check, with the modules the pinned python.wasm
lacks refused by name (`PYTHON_WASM_ABSENT`: ``ctypes``, ``ssl``, ``multiprocessing``,
...); their dry run would need the 5 s runtime compile and is left out.

A non-packable executor is server-only: `plan.plan_invocation` pins its jobs to the server
and `client.Client.submit` refuses to queue one for a device.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Final

import msgspec

from ..errors import BadManifest

if TYPE_CHECKING:  # pragma: no cover
    from ..manifest import Executor, Manifest
    from ..sandbox._types import Sandbox, SandboxJob

__all__ = (
    "DRY_RUN_SCRIPT",
    "PYTHON_WASM_ABSENT",
    "check_packable",
    "dry_run",
    "dry_run_job",
    "imported_modules",
)

#: Run in the sandbox by `dry_run`: reads module names (JSON) on stdin, prints those that
#: cannot be found. `find_spec` of a top-level name locates it without executing it.
DRY_RUN_SCRIPT: Final = (
    "import importlib.util, json, sys\n"
    "sys.path.insert(0, '.')\n"
    "print(json.dumps([m for m in json.load(sys.stdin) "
    "if importlib.util.find_spec(m) is None]))\n"
)

_SKIPPED_DIRS = frozenset({"__pycache__"})

#: Standard-library modules (public names of `sys.stdlib_module_names`) that the pinned
#: python.wasm (CPython 3.12.0 for WASI, `PYTHON_WASM_SHA256`) does not have or cannot
#: import, measured by `find_spec` and `import_module` inside it. A ``wasm-python``
#: executor gets no dry run, so its load check refuses these by name.
PYTHON_WASM_ABSENT: Final = frozenset(
    {
        "antigravity", "asynchat", "asyncore", "ctypes", "curses", "distutils", "ensurepip",
        "fcntl", "grp", "idlelib", "imp", "lib2to3", "lzma", "mmap", "msilib", "msvcrt",
        "multiprocessing", "nis", "nt", "ossaudiodev", "pwd", "pydoc_data", "readline",
        "resource", "rlcompleter", "smtpd", "spwd", "ssl", "syslog", "termios", "tkinter",
        "turtle", "turtledemo", "uu", "venv", "webbrowser", "winreg", "winsound", "xdrlib",
    }
)  # fmt: skip


def _python_files(folder: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _is_local(folder: Path, top: str) -> bool:
    return (folder / f"{top}.py").is_file() or (folder / top).is_dir()


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


def check_packable(manifest: Manifest, folder: str | os.PathLike[str]) -> list[str]:
    """Check a ``packable`` executor's imports; return its top-level module names.

    Raises:
        BadManifest: naming the file, line and module that is neither the standard
            library nor inside the folder.
    """
    if not manifest.packable or manifest.runtime == "wasm":
        return []
    root = Path(folder)
    tops: dict[str, None] = {}
    for rel, line, module in imported_modules(root):
        top = module.partition(".")[0]
        if _is_local(root, top):
            tops.setdefault(top, None)
            continue
        if manifest.runtime == "wasm-python" and top in PYTHON_WASM_ABSENT:
            raise BadManifest(
                f"{root}/manifest.toml: field `packable`: {rel}:{line} imports `{module}`, "
                "which python.wasm (CPython 3.12 for WASI, the runtime of `wasm-python`) "
                "does not have, so no device could run it; use another module, runtime "
                '"python", or packable = false'
            )
        if top in sys.stdlib_module_names:
            tops.setdefault(top, None)
            continue
        raise BadManifest(
            f"{root}/manifest.toml: field `packable`: {rel}:{line} imports `{module}`, which "
            "is neither the standard library nor a file in the executor's folder, so a "
            "device could not run it; use only the standard library or set packable = false"
        )
    return list(tops)


_missing_decoder = msgspec.json.Decoder(list[str])


def dry_run_job(executor: Executor, *, python: str | None = None) -> SandboxJob | None:
    """The sandbox job of `dry_run`, or ``None`` when `executor` needs none."""
    from ..sandbox._types import Mount, ResourceLimits, SandboxJob

    manifest = executor.manifest
    if not manifest.packable or manifest.runtime != "python":
        return None
    modules = check_packable(manifest, executor.path)
    folder = os.path.realpath(executor.path)
    interpreter = os.path.realpath(python or sys.executable)
    mounts = [Mount(host=folder, guest=folder, writable=False)]
    if python is not None:  # a standalone build: its prefix, as `plan_invocation` mounts it
        prefix = os.path.dirname(os.path.dirname(interpreter))
        mounts.append(Mount(host=prefix, guest=prefix, writable=False))
    return SandboxJob(
        argv=(interpreter, "-I", "-S", "-c", DRY_RUN_SCRIPT),
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"},
        stdin=msgspec.json.encode(modules),
        mounts=tuple(mounts),
        cwd=folder,
        limits=ResourceLimits(wall_time_s=30.0),
    )


async def dry_run(executor: Executor, arm: Sandbox, *, python: str | None = None) -> None:
    """Ask the sandbox whether every module `executor` imports can be found there.

    Args:
        executor: a ``python`` executor (others return at once).
        arm: the native arm to run in (bubblewrap, else the direct arm).
        python: the interpreter its jobs use (default the worker's own).

    Raises:
        BadManifest: a module the sandbox cannot find (named), or a dry run that failed.
    """
    from ..sandbox._types import Success

    job = dry_run_job(executor, python=python)
    if job is None:
        return
    outcome = await arm.run(job)
    where = f"{executor.path}/manifest.toml: field `packable`"
    if not isinstance(outcome.exit, Success):
        raise BadManifest(
            f"{where}: the dry run in the sandbox failed ({outcome.exit}): "
            f"{outcome.stderr.decode(errors='replace')[-300:]}"
        )
    try:
        missing = _missing_decoder.decode(outcome.stdout)
    except msgspec.DecodeError:
        raise BadManifest(f"{where}: the dry run printed {outcome.stdout[:200]!r}") from None
    if missing:
        raise BadManifest(
            f"{where}: the dry run in the sandbox cannot find `{missing[0]}` (imported by the "
            "executor): a device could not run it; use only the standard library or set "
            "packable = false"
        )
