"""``metnos-exec bench``: run the benchmark scripts in the repository's ``bench/`` folder.

``bench/`` is not a package (benchmarks are scripts a person may also run directly:
``python bench/queue_throughput.py``). Each ``bench/NAME.py`` exposes ``main(argv) -> int``;
files whose name starts with ``_`` are helpers (``_noop.py`` is the executor a benchmark
runs), never benchmarks. This module finds the folder — ``$METNOS_BENCH_DIR``, else the
``bench/`` next to the ``metnos_exec/`` package in a source checkout, whatever the current
folder is — loads the named files and calls them.

    metnos-exec bench                       # every benchmark, default options
    metnos-exec bench --list
    metnos-exec bench queue_throughput --echo-jobs 5000
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

__all__ = ("BENCH_DIR_ENV", "bench_dir", "list_benchmarks", "main")

#: Names another ``bench/`` folder (e.g. an installed package's users' own benchmarks).
BENCH_DIR_ENV = "METNOS_BENCH_DIR"


def bench_dir() -> Path:
    """The ``bench/`` folder to use: ``$METNOS_BENCH_DIR``, else the checkout's.

    Not the current folder's ``bench/``: run from elsewhere, that would be someone else's
    scripts (or none), and the answer would depend on where the command was typed.

    Raises:
        FileNotFoundError: the folder does not exist (the message says where it looked).
    """
    override = os.environ.get(BENCH_DIR_ENV)
    if override:
        if not Path(override).is_dir():
            raise FileNotFoundError(f"{BENCH_DIR_ENV}={override!r} is not a folder")
        return Path(override)
    folder = Path(__file__).resolve().parent.parent / "bench"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no bench/ folder at {folder}: benchmarks ship with a source checkout of "
            f"metnos-exec, not with an installed package (or set {BENCH_DIR_ENV})"
        )
    return folder


def list_benchmarks(folder: Path) -> list[str]:
    """Benchmark names in `folder` (``_helper.py`` files are not benchmarks)."""
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


def _load_main(path: Path) -> object:
    spec = importlib.util.spec_from_file_location(f"_metnos_bench_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, "main", None)


def main(argv: list[str]) -> int:
    """Run benchmarks. ``argv``: names, then options passed to each (after the names)."""
    try:
        folder = bench_dir()
    except FileNotFoundError as exc:
        sys.stderr.write(f"metnos-exec bench: {exc}\n")
        return 5
    known = list_benchmarks(folder)
    if argv[:1] == ["--list"]:
        sys.stdout.write("\n".join(known) + "\n")
        return 0
    names = []
    while argv and not argv[0].startswith("-"):
        names.append(argv.pop(0))
    for name in names:
        if name not in known:
            sys.stderr.write(f"metnos-exec bench: unknown benchmark {name!r}; known: {known}\n")
            return 2
    worst = 0
    for name in names or known:
        fn = _load_main(folder / f"{name}.py")
        if not callable(fn):
            sys.stderr.write(f"metnos-exec bench: {name}.py has no main(argv)\n")
            worst = max(worst, 2)
            continue
        sys.stdout.write(f"== {name}\n")
        sys.stdout.flush()
        code = fn(list(argv))
        worst = max(worst, int(code or 0))
    return worst
