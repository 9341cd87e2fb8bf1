"""``metnos-exec bench``: the benchmarks of ``bench/`` (`metnos_exec.bench`). `main` hands
everything after ``bench`` to them before argparse sees it; this parser is for ``bench
--help``."""

from __future__ import annotations

import argparse

from ._common import Subparsers, add_command


def _cmd_bench(ns: argparse.Namespace) -> int:
    from ..bench import main as bench_main

    return bench_main(list(ns.argv or ()))


def register(subparsers: Subparsers) -> None:
    """Add ``bench``."""
    # No shared --broker: the benchmarks that use a queue take their own (after the name).
    b = add_command(
        subparsers, "bench", "run benchmarks from bench/ (all when none named)", broker=False
    )
    b.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="NAME ...",
        help="benchmark names (e.g. queue_throughput) and their options; --list lists them",
    )
    b.set_defaults(fn=_cmd_bench)
