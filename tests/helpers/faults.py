"""Real storage faults for tests, each undone on exit.

- `read_only(path)`: the file cannot be written by this user: immutable (``chattr +i``)
  when root, since root ignores file modes; mode 0444 otherwise.
- `file_size_limit(pid)`: the process `pid` can no longer grow any file (its soft
  ``RLIMIT_FSIZE`` set to 1 byte, by prlimit(2) from outside): every write it makes to its
  SQLite WAL, its log file, ... fails with EFBIG, as on a full disk, while other
  processes on the same files go on. CPython ignores SIGXFSZ, so the process is not
  killed by it. Only the soft limit changes, so an unprivileged user can undo it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import need


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """`path` made read-only to this process's user (see the module docstring)."""
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
        need(done.returncode == 0, f"chattr +i is not supported here: {done.stderr!r}")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o444)
        try:
            yield
        finally:
            # SQLite gives a -wal it creates meanwhile the database file's mode: undo that
            # too (the broker names such a file when it refuses to open).
            for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                if name.exists():
                    name.chmod(0o644)


def limit_file_size(pid: int) -> tuple[int, int]:
    """Stop `pid` from growing any file; returns the limits to give back."""
    before = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, before[1]))
    return before


def restore_file_size(pid: int, before: tuple[int, int]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have been killed meanwhile
        resource.prlimit(pid, resource.RLIMIT_FSIZE, before)


@contextlib.contextmanager
def file_size_limit(pid: int) -> Iterator[None]:
    """`pid` cannot grow any file inside the block (see the module docstring)."""
    before = limit_file_size(pid)
    try:
        yield
    finally:
        restore_file_size(pid, before)
