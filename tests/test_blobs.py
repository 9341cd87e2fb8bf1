"""The content-addressed blob store."""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

import pytest

from metnos_exec.blobs import BlobMissing, BlobStore


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
