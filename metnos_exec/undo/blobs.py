"""A content-addressed blob store: the originals of everything a job modified or deleted.

One file per blob, named by the SHA-256 of its content, under ``<root>/sha256/<2 hex>/``.
Undo entries name blobs by hash (`FileState.sha256`); restoring a file is copying its blob
back. A blob is written once, whatever number of entries need it (deduplication is the
name), and it is never modified: ``put`` writes a temporary file, hashes as it copies, then
links it under its name (``link(2)`` fails if the name exists, so two writers of the same
content never clobber each other).

Durability: blobs survive a crash of the worker (the kernel's page cache outlives the
process); with ``fsync=True`` they are also flushed before ``put`` returns, so they survive
a power loss (the commit journal then fsyncs too, see `metnos_exec.undo.journal`).

Retention (`collect`): a blob is deleted only when no entry in ``keep`` needs it *and* it is
older than ``min_age_s``. The age guard covers a commit in flight: its blobs are written
before its undo entry is stored, and each ``put`` of an existing blob refreshes its mtime.
The folder is private (0700): blobs are copies of the user's files.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Final

import msgspec

from ..errors import HostFault
from ..private import private_dir

__all__ = ("BlobMissing", "BlobStore", "CollectStats")

_CHUNK: Final = 1024 * 1024
_HEX: Final = frozenset("0123456789abcdef")


class BlobMissing(HostFault):
    """A blob an undo entry needs is not in this worker's store (or its content is wrong).

    A host fault, not a verdict on the job: the store was pruned by hand, lives on another
    machine, or the disk lost it.
    """


class CollectStats(msgspec.Struct, frozen=True):
    """What `BlobStore.collect` did: blobs and bytes removed, blobs kept."""

    removed: int
    removed_bytes: int
    kept: int


def _check_digest(digest: str) -> None:
    # The digest becomes a file name: only 64 lowercase hex characters may.
    if len(digest) != 64 or not _HEX.issuperset(digest):
        raise ValueError(f"not a SHA-256 hex digest: {digest!r}")


class BlobStore:
    """Blobs under `root` (created, private, when missing).

    Args:
        root: the store's folder.
        fsync: flush every new blob (and its folder) to disk before `put` returns.
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self._objects = self.root / "sha256"
        self._tmp = self.root / "tmp"
        for folder in (self.root, self._objects, self._tmp):
            private_dir(folder)

    def path(self, digest: str) -> Path:
        """Where the blob `digest` lives (whether or not it exists)."""
        _check_digest(digest)
        return self._objects / digest[:2] / digest

    def has(self, digest: str, *, size: int | None = None) -> bool:
        """Whether the store holds the blob `digest` (of `size` bytes, when given: a blob
        of another size is not the content its name says)."""
        try:
            st = os.stat(self.path(digest))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)

    def open_checked(self, digest: str, size: int) -> int:
        """`open`, refusing a blob whose size is not `size`.

        Raises:
            BlobMissing: absent, or of another size (cut short: its content is wrong).
        """
        fd = self.open(digest)
        actual = os.fstat(fd).st_size
        if actual != size:
            os.close(fd)
            raise BlobMissing(
                f"blob {digest} in {self.root} holds {actual} bytes, not the {size} it was "
                "stored with (wrong size: its content is not the original)"
            )
        return fd

    def put_fd(self, fd: int) -> tuple[str, int]:
        """Store what `fd` holds from its current offset to its end.

        Returns:
            The content's SHA-256 (hex) and its size in bytes.
        """
        digest = hashlib.sha256()
        size = 0

        def copy(tmp_fd: int) -> None:
            nonlocal size
            while chunk := os.read(fd, _CHUNK):
                digest.update(chunk)
                # A full disk (or a file size limit) first answers with a short count,
                # not an error: the rest is written, or the error raised, by the loop.
                _write_all(tmp_fd, chunk)
                size += len(chunk)

        tmp = self._write_temp(copy)
        return self._adopt(tmp, digest.hexdigest()), size

    def put_bytes(self, data: bytes) -> str:
        """Store `data`; return its SHA-256 (hex)."""
        digest = hashlib.sha256(data).hexdigest()
        if self._touch(digest):
            return digest
        return self._adopt(self._write_temp(lambda tmp_fd: _write_all(tmp_fd, data)), digest)

    def open(self, digest: str) -> int:
        """An fd (read-only) on the blob `digest`.

        Raises:
            BlobMissing: the store does not hold it.
        """
        try:
            return os.open(self.path(digest), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise BlobMissing(
                f"blob {digest} is not in the store at {self.root} (pruned, or written by a "
                "worker on another machine)"
            ) from None

    def collect(self, keep: Collection[str], *, min_age_s: float = 3600.0) -> CollectStats:
        """Delete blobs not in `keep` and older than `min_age_s`; temporaries too.

        Args:
            keep: digests some stored undo entry still needs.
            min_age_s: never delete a blob younger than this (a commit in flight writes its
                blobs before its entry is stored).
        """
        cut = time.time() - min_age_s
        removed = removed_bytes = kept = 0
        for folder in sorted(self._objects.iterdir()):
            if not folder.is_dir():
                continue
            for blob in folder.iterdir():
                try:
                    st = blob.lstat()
                except FileNotFoundError:
                    continue
                if blob.name in keep or st.st_mtime >= cut:
                    kept += 1
                    continue
                with contextlib.suppress(FileNotFoundError):
                    blob.unlink()
                    removed += 1
                    removed_bytes += st.st_size
        for tmp in self._tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if tmp.lstat().st_mtime < cut:
                    tmp.unlink()
        return CollectStats(removed=removed, removed_bytes=removed_bytes, kept=kept)

    # --- internals ---------------------------------------------------------------------

    def _write_temp(self, write: Callable[[int], None]) -> Path:
        """A new temporary file filled by `write` (flushed with ``fsync``); its path."""
        path = self._tmp / f"{os.getpid()}-{os.urandom(8).hex()}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            write(fd)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            path.unlink()
            raise
        os.close(fd)
        return path

    def _touch(self, digest: str) -> bool:
        """Refresh an existing blob's mtime (so `collect` spares it); ``False`` if absent."""
        try:
            os.utime(self.path(digest))
        except FileNotFoundError:
            return False
        return True

    def _adopt(self, tmp: Path, digest: str) -> str:
        final = self.path(digest)
        try:
            try:
                os.link(tmp, final)
            except FileNotFoundError:
                final.parent.mkdir(mode=0o700, exist_ok=True)
                os.link(tmp, final)
        except FileExistsError:
            # Same content stored before (or by another writer a moment ago).
            self._touch(digest)
        finally:
            tmp.unlink()
        if self.fsync:
            _fsync_dir(final.parent)
        return digest


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
