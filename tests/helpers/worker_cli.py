"""Real `metnos-exec worker` processes for tests: the command line, and waiting for a
record in its log."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from metnos_exec.logs import iter_records


def worker_argv(broker: str, executors: Path | str, log: Path, *extra: str) -> list[str]:
    """``python -m metnos_exec worker`` on `broker` with `executors`, logging to `log`."""
    return [
        sys.executable,
        "-m",
        "metnos_exec",
        "worker",
        "--broker",
        broker,
        "--executors",
        str(executors),
        "--log-file",
        str(log),
        *extra,
    ]


def wait_for_event(
    log: Path, event: str, proc: subprocess.Popen[Any] | None = None, timeout: float = 20
) -> dict[str, Any]:
    """The first `event` record in `log`, polled with a deadline; fails if `proc` exits."""
    deadline = time.monotonic() + timeout
    while True:
        if log.exists():
            for rec in iter_records(log, event=event):
                return rec
        assert proc is None or proc.poll() is None, f"the worker exited ({proc.returncode})"
        assert time.monotonic() < deadline, f"no {event} in {log} within {timeout} s"
        time.sleep(0.02)  # polling a log file, with a deadline
