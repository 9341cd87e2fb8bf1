"""Undo entries sealed by the device that recorded them.

An undo entry says which folders to touch and what to put back there, and the worker
that applies it (on a root worker: as root) has only the broker's word for it. Anyone who
can write the broker's store could forge one: a producer (Redis has no per-key rights
here), a job given network access reaching an unauthenticated Redis on loopback, a local
user with the queue file's group. A forged entry with ``roots = ["/etc"]`` and an op that
puts a file or a mode there, followed by ``metnos-exec undo``, made a root worker write
outside every hint any executor declares.

So every entry a worker records carries a seal, an HMAC-SHA256 over the entry's JSON
without the seal, made with a key only that device's workers hold: ``undo.key`` in the
blob store's folder (0600, in a 0700 folder no job may reach: the state and blob folders
are among the worker's protected paths). An undo refuses, before it reads anything on
disk, an entry whose seal is missing or does not match (``E_UNDO_UNAVAILABLE``): forged,
altered in the store, or recorded by a worker with another blob store (whose originals
this worker would not have either).

What it does not do: it proves an entry came from a worker of this device, not that the
worker was right. Workers of one device share the key as they share the blob store.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Final

import msgspec

from .errors import HostFault
from .messages import UndoEntry
from .private import private_dir

__all__ = ("KEY_FILE", "UndoSeal")

#: The key's file name in the state folder.
KEY_FILE: Final = "undo.key"
_KEY_BYTES: Final = 32

_encoder = msgspec.json.Encoder()
#: `UndoSeal.beside`'s seals, by folder.
_seals: dict[Path, UndoSeal] = {}


class UndoSeal:
    """Seals and checks undo entries with the key in `folder` (made at first use)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.path = Path(folder) / KEY_FILE
        self._key: bytes | None = None

    @classmethod
    def beside(cls, folder: str | os.PathLike[str]) -> UndoSeal:
        """The seal of the blob store in `folder`, one per folder in this process: its key
        is read once, not at every commit and undo."""
        path = Path(folder)
        seal = _seals.get(path)
        if seal is None:
            seal = _seals.setdefault(path, cls(path))
        return seal

    @property
    def key(self) -> bytes:
        """The device's key, read (or made) at first use.

        Raises:
            HostFault: it cannot be read or made, or the file is not a key.
        """
        if self._key is None:
            try:
                self._key = _load_or_make(self.path)
            except (OSError, ValueError) as exc:
                raise HostFault(f"the undo key {self.path}: {exc}") from exc
        return self._key

    def _mac(self, entry: UndoEntry) -> str:
        body = _encoder.encode(msgspec.structs.replace(entry, seal=None))
        return hmac.new(self.key, body, hashlib.sha256).hexdigest()

    def seal(self, entry: UndoEntry) -> UndoEntry:
        """`entry` with its seal."""
        return msgspec.structs.replace(entry, seal=self._mac(entry))

    def holds(self, entry: UndoEntry) -> bool:
        """Whether `entry` carries this device's seal, unaltered (no key yet: it cannot,
        and one is made)."""
        return entry.seal is not None and hmac.compare_digest(entry.seal, self._mac(entry))


def _load_or_make(path: Path) -> bytes:
    """The key at `path`; made (32 random bytes, 0600, written before it is visible under
    its name) when there is none. Two workers starting at once agree: the first link wins
    and the other reads it.

    Raises:
        OSError: the key cannot be read or made; ``ValueError``: the file is not a key.
    """
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    private_dir(path.parent)
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secrets.token_bytes(_KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # never replaces one another worker made meanwhile
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return _read(path)


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        data = os.read(fd, _KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != _KEY_BYTES:
        raise ValueError(f"{path}: not an undo key ({len(data)} bytes, not {_KEY_BYTES})")
    return data
