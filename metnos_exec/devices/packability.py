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
   The reading is `source_imports.imported_modules` and the rule `manifest.check_packable`,
   which `manifest.load_manifest` applies: both sit below ``devices/`` (a manifest loads
   without it) and are re-exported here.
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

import os
import sys
from typing import TYPE_CHECKING, Final

import msgspec

from ..errors import BadManifest
from ..manifest import PYTHON_WASM_ABSENT, check_packable
from ..source_imports import imported_modules

if TYPE_CHECKING:  # pragma: no cover
    from ..manifest import Executor
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
