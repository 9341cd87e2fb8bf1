"""`metnos_exec.undo.folder_lock`: one committer of a folder at a time, across processes.

The holder is a real other process (a plain Python child holding `FolderLock`), as a
second worker is; where the test runs as root, also one running as another user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from metnos_exec.errors import HostFault
from metnos_exec.undo.folder_lock import FolderLock, wait_settled
from tests.conftest import need_privileged

HOLDER = """\
import sys
from metnos_exec.undo.folder_lock import FolderLock
lock = FolderLock(sys.argv[1:])
print("held", flush=True)
sys.stdin.read()  # until the test closes our stdin
lock.release()
"""

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def held_elsewhere(*roots: Path, user: str | None = None) -> Iterator[None]:
    """`roots` locked by another process (as `user`, when given) until the block ends."""
    argv = [sys.executable, "-c", HOLDER, *map(str, roots)]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd="/",
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(10) == 0
        proc.stdout.close()  # type: ignore[union-attr]


def refused(*roots: Path) -> bool:
    """Whether this process is kept out of `roots` (a short wait, then `HostFault`)."""
    try:
        FolderLock(list(map(str, roots)), wait_s=0.2).release()
    except HostFault as exc:
        assert "being changed by another commit" in exc.message
        return True
    return False


def test_a_folder_held_by_another_process_is_refused_until_released(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with held_elsewhere(a):
        assert refused(a)
        assert not refused(b)  # another folder: no wait
    assert not refused(a)


def test_nested_roots_exclude_each_other_both_ways(tmp_path: Path) -> None:
    outer = tmp_path / "data"
    inner = outer / "sub"
    inner.mkdir(parents=True)
    with held_elsewhere(outer):
        assert refused(inner)
    with held_elsewhere(inner):
        assert refused(outer)
    sibling = outer / "sibling"
    sibling.mkdir()
    with held_elsewhere(inner):
        assert not refused(sibling)  # siblings share only a shared lock on the parent


def test_the_wait_ends_when_the_holder_lets_go(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    folder.mkdir()
    lock = FolderLock([str(folder)])
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout is not None
        os.set_blocking(child.stdout.fileno(), False)
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # polling with a deadline: it must stay out
            assert child.stdout.read() in (None, b"")
            time.sleep(0.02)
        lock.release()
        os.set_blocking(child.stdout.fileno(), True)
        assert child.stdout.readline() == b"held\n"
    finally:
        lock.release()
        assert child.stdin is not None
        child.stdin.close()
        assert child.wait(10) == 0
        child.stdout.close()  # type: ignore[union-attr]


def test_wait_settled_returns_at_once_on_a_free_folder_and_refuses_a_held_one(
    tmp_path: Path,
) -> None:
    wait_settled([str(tmp_path)], wait_s=0.2)
    with held_elsewhere(tmp_path), pytest.raises(HostFault):
        wait_settled([str(tmp_path)], wait_s=0.2)


def test_another_users_worker_is_kept_out_too() -> None:
    need_privileged(os.geteuid() == 0, "needs root to run a holder as another user")
    try:
        pwd.getpwnam("metnos-ci")
    except KeyError:
        pytest.skip("no user metnos-ci to hold the lock as")
    # Outside pytest's own (root-only) temporary folder, which the other user cannot reach.
    base = Path(tempfile.mkdtemp(prefix="metnos-lock-"))
    try:
        base.chmod(0o755)
        shared = base / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        with held_elsewhere(shared, user="metnos-ci"):
            assert refused(shared)
        assert not refused(shared)
    finally:
        shutil.rmtree(base)
