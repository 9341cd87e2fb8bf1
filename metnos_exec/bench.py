"""``metnos-exec bench``: run the benchmark scripts in the repository's ``bench/`` folder.

``bench/`` is not a package (benchmarks are scripts a person may also run directly:
``python bench/queue_throughput.py``). Each ``bench/NAME.py`` exposes ``main(argv) -> int``;
this module finds the folder (``$METNOS_BENCH_DIR``, else ``./bench``, else the one next
to the installed package in a source checkout), loads the named files and calls them.

    metnos-exec bench                       # every benchmark, default options
    metnos-exec bench --list
    metnos-exec bench queue_throughput --jobs 5000
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

__all__ = ("bench_dir", "list_benchmarks", "main")


def bench_dir() -> Path | None:
    """The ``bench/`` folder to use, or ``None`` when there is none."""
    candidates = [
        os.environ.get("METNOS_BENCH_DIR"),
        os.path.join(os.getcwd(), "bench"),
        str(Path(__file__).resolve().parent.parent / "bench"),
    ]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    return None


def list_benchmarks(folder: Path) -> list[str]:
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
    folder = bench_dir()
    if folder is None:
        sys.stderr.write("metnos-exec bench: no bench/ folder here (run from a checkout)\n")
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
