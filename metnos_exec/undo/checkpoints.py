"""Checkpoints: a named mark in a device's undo journal, sealed like its entries.

A checkpoint is a job on the queue (``executor = "metnos:checkpoint"``, routed to the
device like an undo). ``create`` writes a mark: its name, the device, and a *boundary*,
a fresh entry id (ULIDs sort by creation time), so every entry the device seals later
sorts after it. The mark is a file in ``checkpoints/`` beside the undo key, sealed with
that key (an HMAC over the mark without its seal): a mark altered on disk, or copied
from another device, is refused before anything is read below the roots.

Which entries came after a mark is read from the device's own entry log (``entries/``,
written by `UndoSeal.seal` for every entry: commits, backups, undos, restores), each one
checked against its seal. Whether an entry *stands* (its job's stored result lists it) is
the broker's word, as for the recovery of a journal; the restore itself is
`metnos_exec.undo.restore`.

Limits: a commit whose entry was sealed in the same millisecond as the mark, by another
worker of the device, may fall on either side of it (ULIDs order across processes to the
millisecond); the log is written without a flush of its own, so a power loss (not a
crash) may drop the last entries from it, and a restore then does not undo those jobs.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgspec

from ..errors import BadArguments, CheckpointUnknown, HostFault, UndoUnavailable
from ..messages import UndoEntry, new_job_id
from ..private import private_dir
from .seal import ENTRIES_DIR, UndoSeal

__all__ = ("CHECKPOINTS_DIR", "CheckpointBook", "CheckpointMark", "checkpoint_job_args")

#: The marks' folder name, beside the undo key.
CHECKPOINTS_DIR: Final = "checkpoints"
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: The actions of a checkpoint job.
ACTIONS: Final = ("create", "list", "diff", "restore")


def checkpoint_job_args(action: str, name: str | None = None) -> dict[str, str]:
    """The arguments of a checkpoint job."""
    return {"action": action} if name is None else {"action": action, "name": name}


class CheckpointMark(msgspec.Struct, frozen=True, kw_only=True):
    """One checkpoint of a device.

    Attributes:
        name: its name (``[A-Za-z0-9][A-Za-z0-9._-]{0,63}``).
        device: the device whose journal it marks.
        boundary: an entry id made when it was created: later entries sort after it.
        job_id: the checkpoint job that made it.
        created_at: unix seconds.
        seal: HMAC-SHA256 over the mark without it, with the device's undo key.
    """

    v: int = 1
    name: str
    device: str
    boundary: str
    job_id: str
    created_at: float
    seal: str | None = None


_encoder = msgspec.json.Encoder()
_mark_decoder = msgspec.json.Decoder(CheckpointMark)
_entry_decoder = msgspec.json.Decoder(UndoEntry)


def check_name(name: object) -> str:
    """`name` if it is a checkpoint name, else `BadArguments`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadArguments(
            f"checkpoint name {name!r} is not [A-Za-z0-9][A-Za-z0-9._-]{{0,63}} (letters, "
            "digits, '.', '_', '-'; at most 64)"
        )
    return name


class CheckpointBook:
    """The checkpoints and the entry log of the blob store in `folder`."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.seal = UndoSeal.beside(self.folder)
        self.marks = self.folder / CHECKPOINTS_DIR

    def _sealed(self, mark: CheckpointMark) -> CheckpointMark:
        body = _encoder.encode(msgspec.structs.replace(mark, seal=None))
        return msgspec.structs.replace(mark, seal=self.seal.mac(body))

    def _holds(self, mark: CheckpointMark) -> bool:
        return mark.seal is not None and self._sealed(mark).seal == mark.seal

    def create(self, name: str, *, device: str, job_id: str) -> CheckpointMark:
        """Mark the journal now. A name taken is refused, unless by this same job (a
        redelivery after its worker died: the mark it wrote is returned).

        Raises:
            BadArguments: not a name, or taken; HostFault: the folder cannot be written.
        """
        check_name(name)
        with contextlib.suppress(CheckpointUnknown):
            old = self.get(name, device=device)
            if old.job_id == job_id:
                return old
            raise BadArguments(
                f"checkpoint {name!r} exists on device {device!r} (made by job "
                f"{old.job_id}); pick another name"
            )
        mark = self._sealed(
            CheckpointMark(
                name=name,
                device=device,
                boundary=new_job_id(),
                job_id=job_id,
                created_at=time.time(),
            )
        )
        path = self.marks / f"{name}.mark"
        tmp = self.marks / f".{name}.{os.getpid()}.tmp"
        try:
            private_dir(self.marks)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, _encoder.encode(mark))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise BadArguments(f"checkpoint {name!r} was made meanwhile") from None
            finally:
                os.unlink(tmp)
        except OSError as exc:
            raise HostFault(f"the checkpoints folder {self.marks}: {exc}") from exc
        return mark

    def get(self, name: str, *, device: str) -> CheckpointMark:
        """The mark `name` of `device`, its seal checked.

        Raises:
            CheckpointUnknown: none of that name here; UndoUnavailable: altered (its seal
                does not hold) or another device's.
        """
        check_name(name)
        try:
            data = (self.marks / f"{name}.mark").read_bytes()
        except FileNotFoundError:
            raise CheckpointUnknown(
                f"no checkpoint {name!r} on device {device!r} (see `metnos-exec checkpoint list`)"
            ) from None
        except OSError as exc:
            raise HostFault(f"the checkpoints folder {self.marks}: {exc}") from exc
        try:
            mark = _mark_decoder.decode(data)
        except msgspec.DecodeError:
            mark = None
        if mark is None or not self._holds(mark) or mark.name != name:
            raise UndoUnavailable(
                f"checkpoint {name!r} has no valid seal of this device (altered in "
                f"{self.marks}?); nothing was changed"
            )
        if mark.device != device:
            raise CheckpointUnknown(
                f"checkpoint {name!r} marks device {mark.device!r}, not {device!r}"
            )
        return mark

    def listed(self, *, device: str) -> list[CheckpointMark]:
        """This device's checkpoints, oldest first (an altered mark is left out)."""
        try:
            names = sorted(p.name[: -len(".mark")] for p in self.marks.glob("*.mark"))
        except OSError:
            return []
        marks: list[CheckpointMark] = []
        for name in names:
            with contextlib.suppress(CheckpointUnknown, UndoUnavailable, BadArguments):
                marks.append(self.get(name, device=device))
        return sorted(marks, key=lambda m: m.boundary)

    def entries_after(self, mark: CheckpointMark) -> list[UndoEntry]:
        """The entries this device sealed after `mark`, in the order they were sealed.

        Raises:
            UndoUnavailable: one does not hold its seal (altered in the log): nothing
                is undone on an entry nobody can vouch for.
        """
        folder = self.folder / ENTRIES_DIR
        try:
            names = sorted(n for n in os.listdir(folder) if n > mark.boundary)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise HostFault(f"the undo entry log {folder}: {exc}") from exc
        entries: list[UndoEntry] = []
        for name in names:
            if name.startswith("."):
                continue
            try:
                entry = _entry_decoder.decode((folder / name).read_bytes())
            except (OSError, msgspec.DecodeError):
                entry = None
            if entry is None or entry.id != name or not self.seal.holds(entry):
                raise UndoUnavailable(
                    f"undo entry {name} in {folder} has no valid seal of this device "
                    "(altered?); nothing was changed"
                )
            if entry.device == mark.device:
                entries.append(entry)
        return entries


def roots_of(entries: Sequence[UndoEntry]) -> tuple[str, ...]:
    """The folders `entries` touch, each once."""
    return tuple(dict.fromkeys(root for e in entries for root in e.roots))
