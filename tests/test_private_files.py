"""The worker's private files: private whatever the umask, and tightened when found open.

The queue database holds every job's arguments and results; the state folder the
originals of changed files (blobs) and commit journals; the caches the verified copies of
executors and compiled wasm modules. A real worker process, started under ``umask 000``,
must create all of them 0600/0700, and one started on files an earlier run left open
takes the "other" bits off them and says so (`metnos_exec.private`).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from metnos_exec.logs import iter_records
from metnos_exec.private import create_private_file, private_dir, tighten
from tests.helpers.worker_cli import wait_for_event, worker_argv


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _start(tmp_path: Path, log: Path) -> subprocess.Popen[bytes]:
    executors = tmp_path / "executors"
    executors.mkdir(exist_ok=True)
    argv = worker_argv(
        f"sqlite:///{tmp_path / 'q.db'}", executors, log, "--state-dir", str(tmp_path / "state")
    )
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "METNOS_CACHE_DIR": str(tmp_path / "cache"),
        "METNOS_ARM_OVERRIDE": "echo",
    }
    # umask 000: anything created without an explicit mode is world-readable.
    return subprocess.Popen(
        ["sh", "-c", 'umask 000; exec "$@"', "sh", *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_worker_under_umask_000_creates_its_files_private(tmp_path: Path) -> None:
    log = tmp_path / "w.jsonl"
    proc = _start(tmp_path, log)
    try:
        wait_for_event(log, "worker.started", proc)
        db = tmp_path / "q.db"
        # While the worker has it open, the database and its -wal and -shm exist.
        for suffix in ("", "-wal", "-shm"):
            assert _mode(Path(f"{db}{suffix}")) == 0o600, suffix
        state = tmp_path / "state"
        for folder in (state, state / "blobs", state / "journal"):
            assert _mode(folder) == 0o700, folder
    finally:
        _stop(proc)
    assert not [r for r in iter_records(log) if r.get("event") == "files.tightened"]


def test_a_worker_tightens_what_an_earlier_run_left_open(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        db = tmp_path / "q.db"
        sqlite3.connect(db).close()  # SQLite's own default: 0644, whatever the umask
        state = tmp_path / "state"
        for folder in (state, state / "blobs", state / "journal"):
            folder.mkdir(mode=0o777)
        cache = tmp_path / "cache"
        (cache / "verified").mkdir(parents=True, mode=0o755)
        (cache / "wasm").mkdir(mode=0o750)  # group only: a deliberate share stays
    finally:
        os.umask(old)
    assert _mode(db) == 0o644
    log = tmp_path / "w.jsonl"
    proc = _start(tmp_path, log)
    try:
        wait_for_event(log, "worker.started", proc)
        assert _mode(db) == 0o640
        for suffix in ("-wal", "-shm"):
            assert not _mode(Path(f"{db}{suffix}")) & 0o007, suffix
    finally:
        _stop(proc)
    for folder in (state, state / "blobs", state / "journal"):
        assert _mode(folder) == 0o770, folder
    assert _mode(cache / "verified") == 0o750
    assert _mode(cache / "wasm") == 0o750
    tightened = {r["path"] for r in iter_records(log) if r.get("event") == "files.tightened"}
    assert tightened >= {str(db), str(state), str(cache / "verified")}
    assert str(cache / "wasm") not in tightened


def test_private_helpers_are_exact_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o277)  # would leave the owner without write or search
    try:
        folder = private_dir(tmp_path / "a" / "b")
        assert create_private_file(folder / "f")
        assert not create_private_file(folder / "f")  # exists: left as it is
    finally:
        os.umask(old)
    assert _mode(folder) == 0o700
    assert _mode(folder / "f") == 0o600


def test_a_shared_sticky_folder_or_another_users_file_is_never_changed(tmp_path: Path) -> None:
    sticky = tmp_path / "shared"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    assert not tighten(sticky)
    assert _mode(sticky) == 0o1777
    assert not tighten(tmp_path / "missing")
    if os.geteuid() == 0:
        other = tmp_path / "theirs"
        other.write_text("")
        os.chmod(other, 0o644)
        os.chown(other, 65534, 65534)
        assert not tighten(other)
        assert _mode(other) == 0o644


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_a_new_signing_key_is_private(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from metnos_exec.devices.signing import generate_key

    old = os.umask(0)
    try:
        priv, _pub = generate_key(tmp_path / "keys" / "k")
    finally:
        os.umask(old)
    assert _mode(priv) == 0o600
    assert _mode(priv.parent) == 0o700
