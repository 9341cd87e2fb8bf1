"""The content-addressed blob store."""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

import pytest

from metnos_exec.undo.blobs import BlobMissing, BlobStore


def test_put_names_a_blob_by_its_sha256_and_deduplicates(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "b")
    digest = store.put_bytes(b"hello")
    assert digest == hashlib.sha256(b"hello").hexdigest()
    assert store.path(digest).read_bytes() == b"hello"
    src = tmp_path / "src"
    src.write_bytes(b"hello")
    fd = os.open(src, os.O_RDONLY)
    try:
        assert store.put_fd(fd) == (digest, 5)
    finally:
        os.close(fd)
    assert [p.name for p in (tmp_path / "b" / "sha256").rglob("*") if p.is_file()] == [digest]
    assert list((tmp_path / "b" / "tmp").iterdir()) == []


def test_the_store_is_private(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "b")
    digest = store.put_bytes(b"a user's file")
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o700
    assert stat.S_IMODE(store.path(digest).stat().st_mode) == 0o600


def test_open_reads_a_blob_and_a_missing_one_is_a_host_fault(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "b")
    digest = store.put_bytes(b"x" * 3_000_000)
    fd = store.open(digest)
    try:
        assert len(os.read(fd, 4_000_000)) == 3_000_000
    finally:
        os.close(fd)
    with pytest.raises(BlobMissing, match="not in the store"):
        store.open("0" * 64)
    with pytest.raises(ValueError, match="not a SHA-256"):
        store.path("../../etc/passwd")


def test_collect_keeps_what_entries_need_and_what_is_young(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "b")
    needed, old, young = (store.put_bytes(x) for x in (b"needed", b"old", b"young"))
    past = time.time() - 7200
    for digest in (needed, old):
        os.utime(store.path(digest), (past, past))
    stats = store.collect({needed}, min_age_s=3600)
    assert (stats.removed, stats.removed_bytes, stats.kept) == (1, 3, 2)
    assert store.has(needed) and store.has(young) and not store.has(old)
    # Storing the same content again refreshes its age: it is in use again.
    store.put_bytes(b"needed")
    assert store.collect(set(), min_age_s=3600).removed == 0


# Run in a child: the file size limit is per process, and the kernel's answer to a write
# that crosses it is the one a filling disk gives: a short count first, an error next.
_PUT_UNDER_A_LIMIT = """
import os, resource, signal, sys
from metnos_exec.undo.blobs import BlobStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = BlobStore(sys.argv[1])
fd = os.open(sys.argv[2], os.O_RDONLY)
resource.setrlimit(resource.RLIMIT_FSIZE, (49152, resource.RLIM_INFINITY))
try:
    digest, size = store.put_fd(fd)
except OSError as exc:
    print("refused", exc.errno)
else:
    print("stored", digest, size)
"""


@pytest.mark.parametrize("size", [300_000, 3_000_000])  # one read, and several
def test_a_short_write_never_leaves_a_blob_under_its_name(tmp_path: Path, size: int) -> None:
    """Found by the chaos run (the state folder on a 2 MiB tmpfs): a blob of 290 kB was
    stored as its first 48 kB under the SHA-256 of the whole, because a short write was
    taken for a whole one. An undo would have restored the truncated file, and every later
    commit of that content reused the truncated blob (deduplicated by name)."""
    import subprocess
    import sys

    data = os.urandom(size)
    src = tmp_path / "src"
    src.write_bytes(data)
    root = tmp_path / "blobs"
    out = subprocess.run(
        [sys.executable, "-c", _PUT_UNDER_A_LIMIT, str(root), str(src)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out[0] == "refused", out
    store = BlobStore(root)
    digest = hashlib.sha256(data).hexdigest()
    assert not store.has(digest)
    assert list((root / "tmp").iterdir()) == []
    # Once there is room, the same content is stored whole.
    fd = os.open(src, os.O_RDONLY)
    try:
        assert store.put_fd(fd) == (digest, size)
    finally:
        os.close(fd)
    assert hashlib.sha256(store.path(digest).read_bytes()).hexdigest() == digest
