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

The seal covers every field of the entry, ``job_id`` and ``device`` included, so an
entry is bound to its job: an undo also refuses an entry that its job's result lists but
that belongs to another job (a result "grafted" onto someone else's entry in the broker).

What the seal cannot cover is the entry's *state*: a broker's ``undone_by`` can be reset
by whoever writes the store (the entry stays sealed), and a second undo of the same
job then deleted files the user had made since. So whether an entry is undone is kept
beside the blobs too, by the device that did it (`UndoLedger`, ``undone/`` in the blob
store's folder, out of every job's reach like the key): a mark per undo applied, made
before its first op (an undo rolled back removes it; one that crashed is settled by the
recovery of its journal). The broker can still refuse an undo (its ``undone_by``), it
can no longer allow one the device has marked undone.

What it does not do: it proves an entry came from a worker of this device, not that the
worker was right. Workers of one device share the key as they share the blob store.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import msgspec

from ..errors import HostFault, UndoUnavailable
from ..messages import UndoEntry
from ..private import private_dir

__all__ = (
    "ENTRIES_DIR",
    "KEY_FILE",
    "UNDONE_DIR",
    "UndoClaim",
    "UndoLedger",
    "UndoSeal",
    "UndoneMark",
)

#: The key's file name in the state folder.
KEY_FILE: Final = "undo.key"
_KEY_BYTES: Final = 32

_encoder = msgspec.json.Encoder()
#: `UndoSeal.beside`'s seals, by folder.
_seals: dict[Path, UndoSeal] = {}
#: The ledger's folder name, in the blob store's folder (beside the key).
UNDONE_DIR: Final = "undone"
#: The device's log of the entries it sealed, in the blob store's folder.
ENTRIES_DIR: Final = "entries"
#: How deep an undo-of-an-undo chain is followed (a genuine one is as deep as people
#: nested undos; the marks are this device's own, so a loop cannot be made).
_MAX_CHAIN: Final = 64
_SAFE_ID: Final = re.compile(r"[0-9A-Za-z_-]{1,128}")


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
        """`entry` with its seal, also kept in the device's entry log (``entries/`` beside
        the key, one file per entry, read by checkpoint restores: which entries a device
        made after a checkpoint is the device's word, not the broker's).

        Raises:
            HostFault: the log cannot be written (before any op: nothing changed).
        """
        sealed = msgspec.structs.replace(entry, seal=self._mac(entry))
        folder = self.path.parent / ENTRIES_DIR
        try:
            private_dir(folder)
            _write_new(folder / _safe(sealed.id), _encoder.encode(sealed), True, sync=False)
        except OSError as exc:
            raise HostFault(f"the undo entry log {folder}: {exc}") from exc
        return sealed

    def mac(self, body: bytes) -> str:
        """The HMAC of `body` with the device's key (checkpoint marks are sealed so)."""
        return hmac.new(self.key, body, hashlib.sha256).hexdigest()

    def holds(self, entry: UndoEntry) -> bool:
        """Whether `entry` carries this device's seal, unaltered (no key yet: it cannot,
        and one is made)."""
        return entry.seal is not None and hmac.compare_digest(entry.seal, self._mac(entry))


class UndoneMark(msgspec.Struct, frozen=True, kw_only=True):
    """One undo applied on this device (a file in `UndoLedger`'s folder).

    Attributes:
        entry: the entry it undid.
        job_id: that entry's job.
        undo_job: the undo job that applied it.
        redo: the undo job's own entry: the entry stays undone while this one is not
            undone in turn ("undo the undo").
        at: unix seconds.
    """

    entry: str
    job_id: str
    undo_job: str
    redo: str
    at: float = 0.0


_mark_decoder = msgspec.json.Decoder(UndoneMark)
_names_decoder = msgspec.json.Decoder(list[str])


@dataclass
class UndoClaim:
    """The marks one undo made (`UndoLedger.claim`): `keep` once its result is stored,
    `release` when it is rolled back."""

    ledger: UndoLedger
    redo: str
    marks: list[Path] = field(default_factory=list)

    def keep(self) -> None:
        """The undo stands: its marks stay, the list recovery would need goes."""
        with contextlib.suppress(FileNotFoundError):
            self.ledger.pointer(self.redo).unlink()

    def release(self) -> None:
        """The undo was rolled back (or never applied): its marks go."""
        for path in self.marks:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self.keep()


class UndoLedger:
    """Which entries this device undid, kept beside its blobs (see the module docstring).

    Layout, in ``<blob folder>/undone/`` (0700): ``<entry id>.<n>`` holds the n-th undo
    of that entry (an `UndoneMark`, JSON); ``<redo id>.redo`` lists the marks an undo in
    flight made, for the recovery of its journal (`settled`), and goes when it is kept.
    An entry is undone when its latest mark stands: that mark's redo is not undone in
    turn (by its own latest mark that stands, and so on).
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder) / UNDONE_DIR

    @classmethod
    def beside(cls, folder: str | os.PathLike[str]) -> UndoLedger:
        """The ledger of the blob store in `folder`."""
        return cls(folder)

    def pointer(self, redo: str) -> Path:
        return self.folder / f"{_safe(redo)}.redo"

    def _latest(self, entry_id: str) -> tuple[int, UndoneMark | None]:
        """``(n, mark)`` of the entry's latest mark (``(0, None)``: never undone here)."""
        n = 0
        mark: UndoneMark | None = None
        while True:
            try:
                data = (self.folder / f"{_safe(entry_id)}.{n + 1}").read_bytes()
            except FileNotFoundError:
                return n, mark
            except OSError as exc:
                raise HostFault(f"the undo ledger {self.folder}: {exc}") from exc
            try:
                mark = _mark_decoder.decode(data)
            except msgspec.DecodeError as exc:
                raise HostFault(
                    f"the undo ledger {self.folder}: mark {entry_id}.{n + 1} is unreadable "
                    f"({exc}); nothing was changed"
                ) from None
            n += 1

    def undone_by(self, entry_id: str) -> UndoneMark | None:
        """The mark that keeps `entry_id` undone now (``None``: it is not, here).

        Raises:
            UndoUnavailable: the chain of undos of undos is deeper than anyone nests.
            HostFault: the ledger cannot be read.
        """
        chain: list[UndoneMark] = []
        _, mark = self._latest(entry_id)
        while mark is not None:
            chain.append(mark)
            if len(chain) > _MAX_CHAIN:
                raise UndoUnavailable(
                    f"entry {entry_id}: more than {_MAX_CHAIN} nested undos in "
                    f"{self.folder}; nothing was changed"
                )
            _, mark = self._latest(mark.redo)
        # The last mark stands (its redo was not undone); each one before it is undone by
        # the one after: the first stands when the chain's length is odd.
        return chain[0] if len(chain) % 2 else None

    def claim(self, entries: Sequence[UndoEntry], *, undo_job: str, redo: str) -> UndoClaim:
        """Mark `entries` undone by `undo_job` (whose entry is `redo`), before its first op.

        A mark left by an earlier attempt of the same undo job (it died before applying
        anything, or its roll-back was not recorded) is taken over.

        Raises:
            UndoUnavailable: one is undone already, or another undo claimed it meanwhile.
            HostFault: the ledger cannot be written.
        """
        plan: list[tuple[Path, UndoneMark, bool]] = []
        stale: list[Path] = []
        for entry in entries:
            n, latest = self._latest(entry.id)
            if latest is not None and latest.undo_job == undo_job:
                n -= 1  # our own earlier attempt's mark: replaced
                stale.append(self.pointer(latest.redo))
            else:
                standing = self.undone_by(entry.id)
                if standing is not None:
                    raise UndoUnavailable(
                        f"job {entry.job_id} was already undone by job {standing.undo_job} "
                        f"on this device (recorded in {self.folder}); undo that job to bring "
                        "its changes back"
                    )
            mark = UndoneMark(
                entry=entry.id, job_id=entry.job_id, undo_job=undo_job, redo=redo, at=time.time()
            )
            path = self.folder / f"{_safe(entry.id)}.{n + 1}"
            plan.append((path, mark, latest is not None and latest.undo_job == undo_job))
        claim = UndoClaim(self, redo)
        try:
            private_dir(self.folder)
            # The list first: a crash after it leaves nothing recovery cannot find.
            _write_new(self.pointer(redo), _encoder.encode([p.name for p, _, _ in plan]), True)
            for path, mark, replace in plan:
                try:
                    _write_new(path, _encoder.encode(mark), replace)
                except FileExistsError:
                    claim.release()
                    raise UndoUnavailable(
                        f"job {mark.job_id} is being undone by another undo job on this "
                        f"device meanwhile (mark {path}); nothing was changed"
                    ) from None
                claim.marks.append(path)
            for path in stale:
                if path != self.pointer(redo):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
        except OSError as exc:
            claim.release()
            raise HostFault(f"the undo ledger {self.folder}: {exc}") from exc
        return claim

    def settled(self, redo: str, *, kept: bool) -> None:
        """The journal of the undo whose entry is `redo` was recovered: its marks stay
        (`kept`) or go. A commit's journal has no list here: nothing happens."""
        try:
            names = _names_decoder.decode(self.pointer(redo).read_bytes())
        except (FileNotFoundError, ValueError, msgspec.DecodeError):
            return
        claim = UndoClaim(self, redo)
        if not kept:
            for name in names:
                path = self.folder / name
                try:
                    mark = _mark_decoder.decode(path.read_bytes())
                except (OSError, msgspec.DecodeError):
                    continue
                if mark.redo == redo:  # not a later undo's, made at the same name
                    claim.marks.append(path)
        claim.release()


def _safe(entry_id: str) -> str:
    """`entry_id` as a file name (ids are ULIDs; anything else is not one of ours)."""
    if not _SAFE_ID.fullmatch(entry_id):
        raise UndoUnavailable(f"undo entry id {entry_id!r} is not one this device makes")
    return entry_id


def _write_new(path: Path, data: bytes, replace: bool, *, sync: bool = True) -> None:
    """Write `path` whole before it is visible (temp file, then link: an existing one is
    `FileExistsError`, unless `replace`); flushed to disk unless not `sync`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if replace:
            os.rename(tmp, path)
        else:
            os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


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
