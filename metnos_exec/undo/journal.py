"""Applying file changes to the host crash-safely: the host tree, the ops, the journal.

A commit (the staged changes of a job), an undo (an entry's operations) and a roll-back all
come down to one thing: take a list of `Put` / `Move` operations, each saying what a path
holds now (``before``) and what it must hold (``after``), and apply them to the real
folders so that a crash at any point leaves a state the next start can settle. This module
does that; it knows nothing about overlays, brokers or jobs.

Here a list is applied (`apply_ops`) and the journal kept (`Journal`, one file per
application in flight); the rest lives beside it, each name importable from here too:
`metnos_exec.undo.host_tree` (the roots walked through fds, a path's state and
fingerprint, the conflicts), `metnos_exec.undo.order` (the order ops are applied in, their
inverse), `metnos_exec.undo.applier` (the steps of one op), `metnos_exec.undo.rollback`
(reverting from whatever a crash left) and `metnos_exec.undo.crash_points` (the test hooks).

Rules, each against the threat it answers:

=====================================================  ======================================
rule                                                   threat
=====================================================  ======================================
Paths are walked from the root's fd one component at   a symlink planted (by the job, or
a time, ``O_NOFOLLOW | O_DIRECTORY``; nothing below a  swapped in by someone on the host)
root is ever resolved through a symlink; links are     makes a write land outside the roots
created and removed as links, never followed
Every op checks the path's current state first (by     clobbering a change made on the host
fingerprint: inode, size, mtime, ctime, mode) and      after the plan was made
stops at the first difference
Content that an op destroys is in the blob store       a crash or a conflict half-way with no
before the journal is written; the journal is          way back
written (temp file, rename) before the first op
Every op is idempotent-checkable: a roll-back looks    a crash between two ops, or inside one
at each path and reverts it only when it holds the     (between a folder's ``mkdir`` and its
op's ``after``, or what a crash between two of its     ``chmod``: the folder was taken for
steps leaves (a folder made, its mode not yet set; a   someone else's, the file it replaced
file written, its mode not yet set); a roll-back cut   lost), or inside a roll-back
short is finished by the next (its temp files too)
New files are created ``O_EXCL``; replaced ones go     a reader (or a crash) seeing half a
through a temp file and ``rename``; moves are          file; a move clobbering a file that
``link`` + ``unlink`` (never replace)                  appeared meanwhile
A journal is owned by the process holding its          recovering a commit that is still
``flock``; recovery takes only unlocked journals       running in another worker
A journal names its queue and device; recovery         another queue's worker, looking the
settles only its own queue's and device's              job up in its own queue, rolling back
                                                       a commit acknowledged there
=====================================================  ======================================

Order (`order_ops`): type changes are split into a removal and a creation, a new folder
without its owner's write and search bits into its creation with them and a mode change,
then: removals of
files and links, new folders (parents first), moves, new and changed files and links,
removals of folders (children first), the creations that replace those folders, folder
mode changes (last, so a folder made read-only does not block the ops inside it; one made
writable goes first). The reverse of a list (`reverse_ops`) is the inverse of each op put
through the same order, so undo, redo and roll-back share one code path.

Crash points: every step that changes the host or a journal (a ``mkdir``, a ``chmod``, one
``write``, a ``rename``...) is a point where a test can make the process die (`CRASH_ENV`);
``tests/undo/test_crash_points.py`` kills a mixed commit, its undo, the undo of that undo and a
recovery at each of them in turn, and after the next recovery finds the tree exactly as
before (or, once the result was stored, as after): never a mix.

Durability: the journal and every new file survive a crash of the worker (page cache).
With ``fsync=True`` the journal is flushed before the first op and every written file
before the journal is removed, so they also survive a power loss.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ..messages import Absent, Move, Put, UndoOp, new_job_id
from ..private import private_dir
from .applier import Applier, BlobSource, ContentSource, write_content
from .blobs import BlobStore
from .crash_points import CRASH_ENV, CRASH_EXIT, PAUSE_ENV, crash_at, pause_for_test, step
from .host_tree import (
    MAX_OPEN_FOLDERS,
    Blocked,
    Conflict,
    Fingerprint,
    HostTree,
    OpConflict,
    conflict_message,
    file_state,
    fingerprints,
    hash_fd,
    same_state,
    strip_mode,
)
from .order import inverse, order_ops, reverse_ops
from .rollback import below_no_folder, op_path, rollback

__all__ = (
    "CRASH_ENV",
    "CRASH_EXIT",
    "BlobSource",
    "Blocked",
    "Conflict",
    "ContentSource",
    "Fingerprint",
    "MAX_OPEN_FOLDERS",
    "HostTree",
    "Journal",
    "JournalHandle",
    "JournalRecord",
    "OpConflict",
    "PAUSE_ENV",
    "apply_ops",
    "below_no_folder",
    "conflict_message",
    "crash_at",
    "file_state",
    "fingerprints",
    "hash_fd",
    "inverse",
    "order_ops",
    "reverse_ops",
    "rollback",
    "same_state",
    "strip_mode",
)


def _check(tree: HostTree, op: UndoOp, expect: dict[str, Fingerprint | None]) -> Conflict | None:
    """Is the host still as planned for `op`? (fingerprints taken by the planner)."""
    paths = (op.src, op.dst) if isinstance(op, Move) else (op.path,)
    for path in paths:
        if path not in expect:
            continue
        try:
            st = tree.lstat(path)
        except Blocked as exc:
            return Conflict(path, str(exc))
        want = expect[path]
        got = None if st is None else Fingerprint.of(st)
        if got is not None and want is not None and stat.S_ISDIR(want.mode):
            # A folder's times and size move with the entries our own ops add and remove:
            # it is the same folder if it is the same inode with the same mode.
            same = (got.dev, got.ino, got.mode) == (want.dev, want.ino, want.mode)
        else:
            same = got == want
        if not same:
            what = "appeared" if want is None else "is gone" if got is None else "changed"
            return Conflict(path, f"{what} on the host since it was checked")
    return None


def apply_ops(
    tree: HostTree,
    ops: Sequence[UndoOp],
    *,
    source: ContentSource,
    store: BlobStore,
    expect: dict[str, Fingerprint | None],
    tag: str,
    fsync: bool = False,
) -> None:
    """Apply `ops` (already ordered) to the host.

    Before each op the paths it touches are compared with `expect` (fingerprints the
    caller took when it planned; ``None`` = must be absent; a path missing from `expect` is
    not compared, e.g. a folder the ops themselves created). On a difference, or any error,
    everything applied so far is rolled back (content from `store`) and the error raised.

    Raises:
        OpConflict: the host changed since the plan; nothing stays applied.
        OSError, Blocked: the host refused an op; nothing stays applied.
    """
    applier = Applier(tree, source, tag=tag, fsync=fsync)
    done: list[UndoOp] = []
    pause_at = len(ops) // 2 if os.environ.get(PAUSE_ENV) else -1
    try:
        for index, op in enumerate(ops):
            tree.release()
            if index == pause_at:
                pause_for_test(os.environ[PAUSE_ENV])
            # A creation where nothing may be is its own check: O_EXCL, mkdir, symlink and
            # link all fail on an existing name (an lstat each would be ~10 % of a small
            # commit).
            exclusive = isinstance(op, Put) and isinstance(op.before, Absent)
            if not exclusive:
                conflict = _check(tree, op, expect)
                if conflict is not None:
                    raise OpConflict([conflict])
            # Listed first: a roll-back also covers an op that failed half-way (it
            # reverts only what it finds changed).
            done.append(op)
            try:
                applier.apply(op, index)
            except FileExistsError:
                done.pop()  # nothing of it was made: the name was someone else's
                raise OpConflict(
                    [Conflict(op_path(op), "appeared on the host since it was checked")]
                ) from None
            # Once applied, a path's new state is ours: later ops on it compare nothing.
            for path in (op.src, op.dst) if isinstance(op, Move) else (op.path,):
                expect.pop(path, None)
        applier.sync()
    except BaseException:
        leftovers = rollback(tree, done, store=store, tag=tag)
        if leftovers:
            raise OpConflict(leftovers) from None
        raise


# --- the journal ----------------------------------------------------------------------


class JournalRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a commit in progress is doing, written before its first op.

    Attributes:
        v: format version.
        id: unique id of this application.
        job_id: the job whose stored result settles it: when that result lists
            `entry_id`, the changes stand; otherwise they are rolled back.
        entry_id: the undo entry this application records.
        roots: the folders the ops lie in.
        ops: the ops, in the order applied.
        pid: the process that applies them.
        queue: the queue of the job (`Broker.queue_id`; empty in journals written before
            journals named it): only a worker of that queue settles it.
        device: the device the job ran on (empty: not recorded): only its workers
            settle it (their blob store holds what a roll-back puts back).
    """

    v: int = 1
    id: str = msgspec.field(default_factory=new_job_id)
    job_id: str
    entry_id: str
    roots: tuple[str, ...]
    ops: tuple[UndoOp, ...]
    pid: int = msgspec.field(default_factory=os.getpid)
    queue: str = ""
    device: str = ""


_record_encoder = msgspec.json.Encoder()
_record_decoder = msgspec.json.Decoder(JournalRecord)


@dataclass(eq=False)
class JournalHandle:
    """A journal held by this process (its ``flock``); `close` removes it."""

    path: Path
    record: JournalRecord
    fd: int
    closed: bool = field(default=False)

    def close(self, *, remove: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if remove:
                step("journal.remove")
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
        finally:
            os.close(self.fd)  # releases the flock


class Journal:
    """Commit journals in `folder`, one file per application in flight.

    Args:
        folder: created (private) when missing; shared by the workers of one machine, so
            any of them can recover a journal whose owner died.
        fsync: flush each journal before the first op (power-loss safety).
    """

    def __init__(self, folder: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.folder = Path(folder)
        self.fsync = fsync
        private_dir(self.folder)
        #: The queue whose jobs' journals are written here (`JournalRecord.queue`): set
        #: by the worker serving it; a record naming none is stamped with it.
        self.queue = ""

    def begin(self, record: JournalRecord) -> JournalHandle:
        """Write `record` durably enough (see the module docstring), lock it, return it."""
        if self.queue and not record.queue:
            record = msgspec.structs.replace(record, queue=self.queue)
        final = self.folder / f"{record.id}.journal"
        tmp = self.folder / f".{record.id}.tmp"
        step("journal.create")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            write_content(fd, _record_encoder.encode(record))
            if self.fsync:
                os.fsync(fd)
            # Renamed only once complete: a journal that exists is a journal that parses.
            step("journal.rename")
            os.rename(tmp, final)
            if self.fsync:
                dfd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        return JournalHandle(final, record, fd)

    def orphans(self) -> tuple[list[JournalHandle], list[tuple[str, str]]]:
        """Journals whose owner is gone (their lock could be taken), now held by us, and
        ``(path, why)`` for those that cannot be read (left in place, not held).

        Temp files of a journal never completed are removed on the way (nothing was
        applied before the rename).
        """
        found: list[JournalHandle] = []
        unreadable: list[tuple[str, str]] = []
        for path in sorted(self.folder.iterdir()):
            temp = path.name.startswith(".") and path.name.endswith(".tmp")
            if not temp and not path.name.endswith(".journal"):
                continue
            fd = self._lock(path)
            if fd is None:
                continue
            if temp:
                JournalHandle(path, _NO_RECORD, fd).close()
                continue
            try:
                record = _record_decoder.decode(os.pread(fd, os.fstat(fd).st_size, 0))
            except (OSError, msgspec.DecodeError) as exc:
                os.close(fd)
                unreadable.append((str(path), str(exc)))
                continue
            found.append(JournalHandle(path, record, fd))
        return found, unreadable

    @staticmethod
    def _lock(path: Path) -> int | None:
        """An fd holding `path`'s lock, or ``None`` (gone, or its owner is alive)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd


_NO_RECORD = JournalRecord(job_id="", entry_id="", roots=(), ops=())
