"""What a commit's plan is, and the checks its planner makes on each staged entry.

`CommitPlan` is what `metnos_exec.undo.changes.plan_commit` returns: the ops, the host
fingerprints they expect, the conflicts that refuse the commit, what was filtered, the
originals to keep and where the new contents come from (`UpperSource`). `PlannerChecks`
holds the planner's state and the rules of `metnos_exec.undo.changes`'s table that a single
entry is held to: changed on the host while the job ran, removed from the host meanwhile,
an overlay's markers (whiteouts, copy-up origins), setuid and setgid bits, the bounds on
names (`MAX_RECORD_BYTES`), bytes (the disk budget) and depth (`MAX_DEPTH`), file
capabilities. The walk that applies them is `metnos_exec.undo.changes`.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from typing import Final

from ..messages import FileState, PathState, UndoOp
from .host_tree import Blocked, Conflict, Fingerprint, HostTree, strip_mode

__all__ = (
    "MAX_DEPTH",
    "MAX_RECORD_BYTES",
    "CommitPlan",
    "Item",
    "PlannerChecks",
    "Upper",
    "UpperSource",
    "not_utf8",
    "shown_path",
    "unreadable",
)

#: Folders nested deeper than this below a root refuse the commit (a conflict): the
#: planner recurses, the host tree holds an fd per folder (1,500 nested folders crashed
#: the commit as a host fault, tests/adversarial: files.folders_nested_without_end).
MAX_DEPTH: Final = 128
#: Bytes of names (host paths and link targets) of the entries a job staged, at most: a
#: commit refuses more (a conflict). Each is written into the journal and the undo entry
#: and held several times in the worker's memory meanwhile, and empty files under long
#: nested names cost the staging tmpfs next to nothing (30,000 made a 940 MB undo entry
#: and took the worker to 3.7 GB; tests/adversarial: resources.commit_record_size).
MAX_RECORD_BYTES: Final = 64 * 1024 * 1024
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UpperSource:
    """The content of staged files, for the commit's `ContentSource`.

    Small files are kept in memory; a larger one is opened when the commit writes it,
    walked from its upper folder's root one component at a time without following a
    link (no fd is held per file or folder meanwhile: a job may stage any number).
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        #: path → (fd of its upper root, owned by the caller of `plan_commit`; path below)
        self._where: dict[str, tuple[int, str]] = {}

    def fetch(self, path: str, state: FileState) -> bytes | int:
        data = self._data.get(path)
        if data is not None:
            return data
        root, below = self._where[path]
        *folders, name = below.split("/")
        fd = root
        try:
            for folder in folders:
                parent, fd = fd, os.open(folder, _DIR_FLAGS, dir_fd=fd)
                if parent != root:
                    os.close(parent)
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        finally:
            if fd != root:
                os.close(fd)

    def close(self) -> None:
        self._data.clear()
        self._where.clear()


@dataclass
class CommitPlan:
    """What committing a staged job would do.

    Attributes:
        ops: the operations, in apply order.
        expect: the host fingerprint of every path an op touches (``None``: absent).
        conflicts: why the commit must be refused (empty: it may go ahead).
        filtered: ``(path, what)`` for what was not committed as staged (a stripped
            setuid bit, a fifo left out).
        destroyed: host files whose content the ops destroy, with the fingerprint and the
            digest their blob must be taken at (`store_originals`).
        source: where the new contents come from.
    """

    ops: tuple[UndoOp, ...] = ()
    expect: dict[str, Fingerprint | None] = field(default_factory=dict)
    conflicts: list[Conflict] = field(default_factory=list)
    filtered: list[tuple[str, str]] = field(default_factory=list)
    destroyed: dict[str, tuple[Fingerprint, str]] = field(default_factory=dict)
    source: UpperSource = field(default_factory=UpperSource)


@dataclass
class Upper:
    state: PathState
    opaque: bool = False


@dataclass
class Item:
    path: str
    upper: Upper | None  # None: deleted by the job
    host: os.stat_result | None


class PlannerChecks:
    """The planner's state, and the checks on one staged entry (see the module docstring)."""

    def __init__(self, tree: HostTree, since_ns: int, xattr: str, plan: CommitPlan) -> None:
        self.tree = tree
        self.since_ns = since_ns
        self.whiteout_xattr = f"{xattr}overlay.whiteout"
        self.opaque_xattr = f"{xattr}overlay.opaque"
        self.origin_xattr = f"{xattr}overlay.origin"
        #: Files copied up from the host that the host no longer holds (`vanished`).
        self.vanished: list[str] = []
        self.plan = plan
        #: The root being walked (`too_deep`), and the fd of its upper folder.
        self.root = "/"
        self.upper_root = -1
        self.items: list[Item] = []
        #: Bytes of small files held in memory (`INLINE_TOTAL`).
        self.inline = 0
        #: Bytes of names of the staged entries seen (`MAX_RECORD_BYTES`).
        self.recorded = 0
        self.overflow = False
        #: Bytes of the staged files seen, and the most the commit may write (`too_many_bytes`).
        self.staged_bytes = 0
        self.max_bytes: int | None = None
        #: Folder → owner its new entries get: a host folder's own, or the one given to a
        #: folder the job created.
        self.owners: dict[str, tuple[int | None, int | None]] = {}

    def conflict(self, path: str, reason: str) -> None:
        self.plan.conflicts.append(Conflict(shown_path(path), reason))

    def filter(self, path: str, what: str) -> None:
        self.plan.filtered.append((shown_path(path), what))

    def host_stat(
        self, path: str, *, folder_in_upper: bool = False
    ) -> tuple[bool, os.stat_result | None]:
        """``(ok, lstat)``: not ok when the path cannot be walked, or changed on the host
        while the job ran (a conflict noted).

        `folder_in_upper`: the job's upper layer holds a folder here. A host folder's
        ctime moves whenever an entry is added or removed in it, which is no conflict
        with a job that only changed *other* entries: folders are checked by `dir` only
        when the job changes the folder itself (its mode).
        """
        try:
            st = self.tree.lstat(path)
        except Blocked as exc:
            self.conflict(path, str(exc))
            return False, None
        both_folders = folder_in_upper and st is not None and stat.S_ISDIR(st.st_mode)
        if st is not None and not both_folders and self.changed_since(st):
            self.conflict(path, "changed on the host while the job ran")
            return False, st
        return True, st

    def changed_since(self, st: os.stat_result) -> bool:
        return st.st_ctime_ns >= self.since_ns

    def vanished_here(self, folder: int, name: str, path: str, st: os.stat_result) -> bool:
        """Whether the upper entry `name` was copied up from the host (overlayfs marks a
        copy-up with its ``overlay.origin`` xattr, empty when the lower file system has no
        file handles) although the host holds nothing at `path` now: the host removed it
        while the job ran, and the commit would bring it back.

        A folder cannot have moved in the overlay (``redirect_dir=nofollow``: a rename is
        ``EXDEV``), so that is a conflict now. A file may have been renamed by the job (the
        copy keeps its origin); it is kept for `vanished_conflicts`, which decides once the
        job's deletions are known. A hard-linked file (``nlink`` > 1, here or on the host
        at copy-up time, which overlayfs then does not mark) cannot be told apart.
        """
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            return False
        if self.xattr(folder, name, self.origin_xattr) is None:
            return False
        if stat.S_ISDIR(st.st_mode):
            self.conflict(path, "removed from the host while the job ran")
            return True
        if st.st_nlink == 1:
            self.vanished.append(path)
        return False

    def vanished_conflicts(self) -> None:
        """Files of `vanished_here` are conflicts when the job deleted nothing from the host:
        then none of them can be a file the job renamed (a rename leaves a whiteout where
        it came from). Otherwise they cannot be told from renames and go ahead."""
        if any(item.upper is None for item in self.items):
            return
        for path in self.vanished:
            self.conflict(path, "removed from the host while the job ran")

    def is_whiteout(self, folder: int, name: str, st: os.stat_result) -> bool:
        if stat.S_ISCHR(st.st_mode):
            return st.st_rdev == 0
        if stat.S_ISREG(st.st_mode) and st.st_size == 0:
            return self.xattr(folder, name, self.whiteout_xattr) is not None
        return False

    def xattr(self, folder: int, name: str, key: str) -> bytes | None:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        try:
            return os.getxattr(f"/proc/self/fd/{fd}", key)
        except OSError as exc:
            if exc.errno in (errno.ENODATA, errno.ENOTSUP):
                return None
            if exc.errno == errno.EACCES:
                # A file or folder the job made unreadable to the worker (user xattrs
                # need read access): no marker can be told here, and reading the entry
                # itself, next, refuses it as a conflict naming it.
                return None
            raise
        finally:
            os.close(fd)

    def stripped(self, path: str, st: os.stat_result, host: os.stat_result | None) -> int:
        """`st`'s permission bits as committed: setuid and setgid go, unless the mode is
        exactly the host's own entry's (a folder copied up with its ``g+s``, a file copied
        up unchanged): a job may not add them, nor give a setuid file other bits (with no
        seccomp filter, ``chmod 4755`` of a root-only ``4700`` tool). Kept on a file whose
        content the job changed, they go in `operations`."""
        mode = stat.S_IMODE(st.st_mode)
        kept = strip_mode(mode)
        if (
            host is not None
            and stat.S_IFMT(host.st_mode) == stat.S_IFMT(st.st_mode)
            and stat.S_IMODE(host.st_mode) == mode
        ):
            kept = mode
        if kept != mode:
            self.filter(path, f"setuid/setgid bits removed (mode {mode:o} -> {kept:o})")
        return kept

    def too_large(self, path: str, target_len: int) -> bool:
        """Whether the staged names seen so far, `path` included, exceed
        `MAX_RECORD_BYTES` (a conflict noted once; the walk stops)."""
        if self.overflow:
            return True
        self.recorded += len(path) + target_len
        if self.recorded <= MAX_RECORD_BYTES:
            return False
        self.overflow = True
        self.conflict(
            path,
            f"too many or too long names: the job's changes name more than "
            f"{MAX_RECORD_BYTES >> 20} MiB of paths, more than a commit records",
        )
        return True

    def too_many_bytes(self, path: str, size: int) -> bool:
        """Whether the staged files seen so far, `path`'s included, hold more bytes than
        `max_bytes` (a conflict noted once; the walk stops). A file's holes and its hard
        links cost the staging tmpfs nothing, but the commit writes every byte of every
        name: 40 sparse 64 MiB files on a 256 MiB budget wrote 2.6 GB on the host."""
        if self.overflow:
            return True
        self.staged_bytes += size
        if self.max_bytes is None or self.staged_bytes <= self.max_bytes:
            return False
        self.overflow = True
        self.conflict(
            path,
            f"the job's files hold more than its disk budget ({self.max_bytes >> 20} MiB) "
            "once written out (sparse files, or hard links: each name is a file on the host)",
        )
        return True

    def too_deep(self, folder: str) -> bool:
        """Whether `folder` lies deeper than `MAX_DEPTH` below its root (a conflict noted):
        the planner recurses and the host tree holds an fd per folder, and a job can nest
        folders without end."""
        if folder.count("/") - self.root.count("/") <= MAX_DEPTH:
            return False
        self.conflict(folder, f"folders nested more than {MAX_DEPTH} deep are not committed")
        return True

    def has_capabilities(self, path: str) -> bool:
        """Whether the host file at `path` carries file capabilities."""
        try:
            fd = self.tree.open_file(path)
        except (Blocked, OSError):
            return True  # cannot tell: the caller refuses
        try:
            os.getxattr(fd, "security.capability")
        except OSError as exc:
            return exc.errno not in (errno.ENODATA, errno.ENOTSUP)
        finally:
            os.close(fd)
        return True


def unreadable(exc: OSError, what: str) -> str:
    """The reason of a conflict on a path the worker may not read (`exc`: its error)."""
    return f"{what} ({exc.strerror})"


def shown_path(path: str) -> str:
    """`path` as text any encoder takes: bytes that are not UTF-8 (held by ``os`` as
    lone surrogates) spelled ``\\xff``."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def not_utf8(item: Item) -> str | None:
    """Why `item` cannot be recorded (its path, or the target of the link it becomes,
    is not valid UTF-8: the journal and the undo entry are JSON), or ``None``."""
    upper = item.upper.state if item.upper is not None else None
    for what, text in (("name", item.path), ("link target", getattr(upper, "target", ""))):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return f"its {what} is not valid UTF-8: the commit could not record it for undo"
    return None
