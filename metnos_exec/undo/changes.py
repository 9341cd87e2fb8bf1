"""The change set of a staged job, read from its overlays' upper folders.

An overlay records in its upper folder exactly what the job changed: new and modified
files and links (their whole content: ``metacopy`` is off), folders it created or whose
mode it changed, *whiteouts* (a character device 0/0, or an empty file carrying the
``overlay.whiteout`` xattr) for what it deleted, and *opaque* folders (xattr
``overlay.opaque = "y"``) for a folder it deleted and made again. `plan_commit` turns that
into ordered `Put` / `Move` operations on the real folders, each with the host state it
replaces, and checks the host did not change under the job.

Commit rules (the staging half of the table in `metnos_exec.undo.journal`):

================================================  ==========================================
rule                                              threat
================================================  ==========================================
Staged files holding more bytes in all than the    sparse files or hard links: the commit
job's disk budget refuse the commit (a conflict)  writes every byte of every name (GBs on
                                                  the host from a 256 MiB budget)
Folders nested more than `MAX_DEPTH` deep refuse  a job nesting folders without end
the commit (a conflict)                           crashed the commit (recursion, fds)
More than `MAX_RECORD_BYTES` of staged names      empty files under long names: a huge
refuse the commit (a conflict)                    journal and undo entry, the worker's
                                                  memory in GB
A path (or link target) that is not valid UTF-8   a name the journal and the undo entry
refuses the commit (a conflict): nothing is       (JSON) cannot record: the commit used
applied, the job fails with its own error         to crash as a host fault
A symlink is committed as a symlink (its target   a link planted to make the *commit* write
text), never followed, on either side             or read outside the roots
setuid and setgid bits are stripped from files    a setuid binary (or setgid folder) left
and folders (noted as ``commit.filtered``)        for the host's users
A mode change that makes a host file with file    a root-only tool with capabilities
capabilities executable by more users refuses     (cap_setuid) made 0755 for every local
the commit (a conflict)                           user, its capabilities kept
Fifos, sockets and device nodes are not           device nodes reaching the host; an
committed (noted); a whiteout (char 0/0) is a     overlay marker mistaken for a file
deletion, never a node
A path the job changes whose host inode changed   clobbering what the host (a person, a sync
(ctime) since the job started, or appeared or     tool) wrote while the job ran: the whole
vanished meanwhile, is a conflict: nothing is     commit is refused (``E_COMMIT_CONFLICT``)
applied
A deleted file whose content reappears under      a rename costing a copy of the file; undo
another name is committed as a move               "moves back"
A root worker commits what the job created as     files owned by whoever ran the job: root
the owner (uid and gid) of the folder it lands    (every user's files becoming root's), or
in, and what it changed as the owner it had;      a slot's uid, which the next job of the
the staged files' own owners are never carried    slot gets (a later job owning an earlier
over (links stay the worker's: no owner kept)     one's files)
================================================  ==========================================
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import stat
from dataclasses import dataclass, field
from typing import Final

import msgspec

from ..messages import Absent, DirState, FileState, LinkState, Move, PathState, Put, UndoOp
from .blobs import BlobStore
from .journal import Blocked, Conflict, Fingerprint, HostTree, hash_fd, order_ops, strip_mode

__all__ = (
    "MAX_DEPTH",
    "MAX_RECORD_BYTES",
    "CommitPlan",
    "UpperSource",
    "change_stamp",
    "find_moves",
    "plan_commit",
    "store_originals",
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
#: Files up to this size are read into memory while hashed, and written from there.
_INLINE_MAX: Final = 64 * 1024
#: ... and at most this much in all: past it, small files too are read from their upper
#: folder when written (they were all held: a worker's memory as large as the disk budget).
INLINE_TOTAL: Final = 64 * 1024 * 1024
_CHUNK: Final = 1024 * 1024
_SETID: Final = stat.S_ISUID | stat.S_ISGID
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
class _Upper:
    state: PathState
    opaque: bool = False


@dataclass
class _Item:
    path: str
    upper: _Upper | None  # None: deleted by the job
    host: os.stat_result | None


class _Planner:
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
        self.items: list[_Item] = []
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

    # --- pass 1: what the upper folders hold, and what the host holds there --------------

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

    def walk(
        self, upper_fd: int, host_dir: str, *, host_known: bool, replaced: bool = False
    ) -> None:
        """`host_known`: the host folder exists (else every entry below is new).
        `replaced`: the folder was deleted and made again by the job (opaque, or inside
        an opaque one): what the host holds below it goes, whatever the upper holds.

        What the worker may not read below (a folder the job closed, ``chmod 0``; a
        file the worker cannot read, on an unprivileged worker) is a conflict naming the
        folder: the job's doing, never a host fault (retried for nothing)."""
        try:
            self._walk(upper_fd, host_dir, host_known=host_known, replaced=replaced)
        except PermissionError as exc:
            self.conflict(host_dir, unreadable(exc, "the worker cannot read what is in it"))

    def _walk(
        self, upper_fd: int, host_dir: str, *, host_known: bool, replaced: bool = False
    ) -> None:
        if self.too_deep(host_dir):
            return
        for entry in sorted(os.scandir(upper_fd), key=lambda e: e.name):
            self.tree.release()  # (the upper's fds are not the tree's)
            path = posixpath.join(host_dir, entry.name)
            st = entry.stat(follow_symlinks=False)
            if self.too_large(path, st.st_size if stat.S_ISLNK(st.st_mode) else 0):
                return
            host: os.stat_result | None = None
            if host_known:
                ok, host = self.host_stat(path, folder_in_upper=stat.S_ISDIR(st.st_mode))
                if not ok:
                    continue
            whiteout = self.is_whiteout(upper_fd, entry.name, st)
            if (
                host_known
                and host is None
                and not whiteout
                and self.vanished_here(upper_fd, entry.name, path, st)
            ):
                continue
            if whiteout:
                if not host_known:
                    continue  # nothing below a new folder to delete
                if host is None:
                    self.conflict(path, "deleted by the job and removed from the host meanwhile")
                    continue
                self.remove_host(path, host)
                continue
            if stat.S_ISDIR(st.st_mode):
                self.dir(upper_fd, entry.name, path, st, host, replaced=replaced)
            elif stat.S_ISREG(st.st_mode):
                if self.too_many_bytes(path, st.st_size):
                    return
                self.file(upper_fd, entry.name, path, st, host)
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(entry.name, dir_fd=upper_fd)
                self.changed(path, LinkState(target=target), host)
            else:
                self.filter(path, "special file (fifo, socket or device) not committed")

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

    def dir(
        self,
        folder: int,
        name: str,
        path: str,
        st: os.stat_result,
        host: os.stat_result | None,
        *,
        replaced: bool = False,
    ) -> None:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=folder)
        except PermissionError as exc:
            self.conflict(
                path, unreadable(exc, "the job left this folder unreadable to the worker")
            )
            return
        try:
            # Inside a folder the job made again, the overlay looks nothing up below:
            # a sub-folder there replaces the host's whole, marked or not.
            opaque = replaced or os.getxattr(fd, self.opaque_xattr) == b"y"
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP):
                os.close(fd)
                raise
            opaque = False
        try:
            mode = self.stripped(path, st, host)
            host_is_dir = host is not None and stat.S_ISDIR(host.st_mode)
            if host is None or not host_is_dir:
                self.changed(path, DirState(mode=mode), host)
                self.walk(fd, path, host_known=False)
                return
            assert host is not None
            if opaque:
                # Deleted and made again: every host entry not staged again goes.
                staged = set(os.listdir(fd))
                for child, child_st in self.host_children(path):
                    if child.rsplit("/", 1)[1] not in staged:
                        ok, _ = self.host_stat(child)
                        if ok:
                            self.remove_host(child, child_st)
            if stat.S_IMODE(host.st_mode) != mode:
                if self.changed_since(host):
                    # The job changed its mode; the host changed it (or its entries).
                    self.conflict(path, "changed on the host while the job ran")
                self.items.append(_Item(path, _Upper(DirState(mode=mode)), host))
            self.walk(fd, path, host_known=True, replaced=opaque)
        finally:
            os.close(fd)

    def file(
        self, folder: int, name: str, path: str, st: os.stat_result, host: os.stat_result | None
    ) -> None:
        mode = self.stripped(path, st, host)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        except PermissionError as exc:
            self.conflict(path, unreadable(exc, "the job left it unreadable to the worker"))
            return
        try:
            if st.st_size <= _INLINE_MAX and self.inline + st.st_size <= INLINE_TOTAL:
                data = _read_all(fd)
                self.inline += len(data)
                digest, size = hashlib.sha256(data).hexdigest(), len(data)
                self.plan.source._data[path] = data
            else:
                digest, size = hash_fd(fd)
                below = path[len(self.root) :].lstrip("/")
                self.plan.source._where[path] = (self.upper_root, below)
        finally:
            os.close(fd)
        # No mtime: a committed file is stamped when the commit writes it (setting the
        # job's would cost a write of the inode per file); originals keep theirs on undo.
        after = FileState(sha256=digest, size=size, mode=mode)
        self.changed(path, after, host)

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

    def changed(self, path: str, after: PathState, host: os.stat_result | None) -> None:
        if host is not None and stat.S_ISDIR(host.st_mode) and not isinstance(after, DirState):
            # A folder replaced by a file or a link: everything below it goes first.
            for child, child_st in self.host_children(path):
                ok, _ = self.host_stat(child)
                if ok:
                    self.remove_host(child, child_st)
        self.items.append(_Item(path, _Upper(after), host))

    def host_children(self, folder: str) -> list[tuple[str, os.stat_result]]:
        # Listed and stat'ed at once: an entry's lazy stat would use the folder's fd,
        # which the tree may close meanwhile (`HostTree.release`).
        fd = self.tree.dir_fd(folder)
        return [
            (posixpath.join(folder, entry.name), entry.stat(follow_symlinks=False))
            for entry in sorted(os.scandir(fd), key=lambda e: e.name)
        ]

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

    def remove_host(self, path: str, st: os.stat_result) -> None:
        self.tree.release()  # no fd of the tree is held across this (`host_children`)
        if stat.S_ISDIR(st.st_mode) and not self.too_deep(path):
            for child, child_st in self.host_children(path):
                ok, _ = self.host_stat(child)
                if ok:
                    self.remove_host(child, child_st)
        self.items.append(_Item(path, None, st))

    # --- pass 2: operations ----------------------------------------------------------

    def host_state(self, path: str, st: os.stat_result) -> PathState | None:
        try:
            return self.tree.state_of(path, st)
        except (Blocked, FileNotFoundError):
            self.conflict(path, "changed on the host while the commit read it")
            return None
        except PermissionError as exc:
            # A file in the job's folder the worker may not read (root's 0600 under an
            # unprivileged worker): its original cannot be kept, so the change cannot be
            # undone. The job's verdict, named: not a host fault.
            self.conflict(
                path, unreadable(exc, "the worker cannot read it to keep its original for undo")
            )
            return None

    def operations(self) -> None:
        plan = self.plan
        ops: list[UndoOp] = []
        deleted: dict[tuple[str, int], list[str]] = {}
        befores: dict[str, PathState] = {}
        for item in self.items:
            self.tree.release()
            unrecordable = _not_utf8(item)
            if unrecordable is not None:
                self.conflict(item.path, unrecordable)
                continue
            host = item.host
            before: PathState = Absent()
            if host is not None:
                found = self.host_state(item.path, host)
                if found is None:
                    if not stat.S_ISREG(host.st_mode) and not stat.S_ISLNK(host.st_mode):
                        self.conflict(
                            item.path, "a special file on the host cannot be replaced reversibly"
                        )
                    continue
                before = found
                plan.expect[item.path] = Fingerprint.of(host)
            else:
                plan.expect[item.path] = None
            befores[item.path] = before
            after = Absent() if item.upper is None else item.upper.state
            if (
                isinstance(after, FileState)
                and after.mode & _SETID
                and not (isinstance(before, FileState) and before.sha256 == after.sha256)
            ):
                # The host's bits, kept by `stripped`, on content the job wrote: never.
                kept = strip_mode(after.mode)
                self.filter(
                    item.path, f"setuid/setgid bits removed (mode {after.mode:o} -> {kept:o})"
                )
                after = msgspec.structs.replace(after, mode=kept)
            if self.tree.as_root and isinstance(after, FileState | DirState):
                after = self.owned(item.path, after, before)
            if (
                isinstance(before, FileState)
                and isinstance(after, FileState)
                and before.sha256 == after.sha256
                and after.mode & 0o111 & ~before.mode
                and self.has_capabilities(item.path)
            ):
                # The mode goes onto the host's own inode, file capabilities and all.
                self.conflict(
                    item.path,
                    "it carries file capabilities (security.capability): a job may not make "
                    "it executable by more users",
                )
                continue
            if (
                isinstance(before, FileState)
                and isinstance(after, FileState)
                and before.sha256 == after.sha256
                and before.mode == after.mode
            ):
                continue  # copied up, not changed
            if (
                isinstance(before, DirState)
                and isinstance(after, DirState)
                and before.mode == after.mode
            ):
                continue
            op = Put(path=item.path, before=before, after=after)
            if isinstance(after, Absent) and isinstance(before, FileState | LinkState):
                deleted.setdefault(_content_key(before), []).append(item.path)
            ops.append(op)
        final = find_moves(ops, deleted, befores)
        for done in final:
            if isinstance(done, Put) and isinstance(done.before, FileState):
                new = done.after
                if not (isinstance(new, FileState) and new.sha256 == done.before.sha256):
                    fp = plan.expect.get(done.path)
                    if fp is not None:
                        plan.destroyed[done.path] = (fp, done.before.sha256)
        plan.ops = order_ops(final)

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

    def owned(
        self, path: str, after: FileState | DirState, before: PathState
    ) -> FileState | DirState:
        """`after` with its owner as a root worker commits it (the module table): what
        was there keeps its owner, what is new takes its folder's."""
        if type(before) is type(after):
            assert isinstance(before, FileState | DirState)
            uid, gid = before.uid, before.gid
        else:
            folder = posixpath.dirname(path)
            owner = self.owners.get(folder)
            if owner is None:
                try:
                    st = self.tree.lstat(folder)
                except Blocked as exc:
                    st = None
                    self.conflict(folder, str(exc))
                else:
                    if st is None:
                        self.conflict(folder, "removed on the host while the commit read it")
                owner = (None, None) if st is None else (st.st_uid, st.st_gid)
                self.owners[folder] = owner
            uid, gid = owner
        if isinstance(after, DirState):
            self.owners[path] = (uid, gid)
        return msgspec.structs.replace(after, uid=uid, gid=gid)


def unreadable(exc: OSError, what: str) -> str:
    """The reason of a conflict on a path the worker may not read (`exc`: its error)."""
    return f"{what} ({exc.strerror})"


def shown_path(path: str) -> str:
    """`path` as text any encoder takes: bytes that are not UTF-8 (held by ``os`` as
    lone surrogates) spelled ``\\xff``."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _not_utf8(item: _Item) -> str | None:
    """Why `item` cannot be recorded (its path, or the target of the link it becomes,
    is not valid UTF-8: the journal and the undo entry are JSON), or ``None``."""
    upper = item.upper.state if item.upper is not None else None
    for what, text in (("name", item.path), ("link target", getattr(upper, "target", ""))):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return f"its {what} is not valid UTF-8: the commit could not record it for undo"
    return None


def _content_key(state: FileState | LinkState) -> tuple[str, int]:
    if isinstance(state, FileState):
        return state.sha256, state.mode
    return "link:" + state.target, -1


def find_moves(
    ops: list[UndoOp], deleted: dict[tuple[str, int], list[str]], befores: dict[str, PathState]
) -> list[UndoOp]:
    """Pair a deletion with a creation of the same content (and mode) as a `Move`."""
    if not deleted:
        return ops
    moved_from: dict[str, Move] = {}
    out: list[UndoOp] = []
    for op in ops:
        if (
            isinstance(op, Put)
            and isinstance(op.after, FileState | LinkState)
            and (sources := deleted.get(_content_key(op.after)))
        ):
            src = sources.pop()
            before = befores[src]
            assert isinstance(before, FileState | LinkState)
            if not isinstance(op.before, Absent):
                # The destination held something: it goes first (its blob is kept).
                out.append(Put(path=op.path, before=op.before, after=Absent()))
            moved_from[src] = Move(src=src, dst=op.path, state=before)
            out.append(moved_from[src])
            continue
        out.append(op)
    return [op for op in out if not (isinstance(op, Put) and op.path in moved_from)]


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, _CHUNK):
        chunks.append(chunk)
    return b"".join(chunks)


def change_stamp(folder: int) -> int:
    """An inode change time taken now, to tell "changed while the job ran" (ctime at or
    after it) from "changed before" (ctime before it).

    Read from a real inode change, not from a clock: since Linux 6.13, ext4, xfs, btrfs
    and tmpfs hand out *multigrain* times, fine-grained for an inode whose time was just
    read, and never earlier than the last fine-grained time handed out anywhere (a global
    floor). Two query-then-change rounds on a file of the staging tmpfs: the first lifts
    its ctime to that floor, the second gets a fresh fine-grained time and raises the
    floor to it. Every earlier change is then strictly before the stamp, every later one
    at or after it, on any multigrain file system. (On one that is not, a change in the
    coarse tick, ~1-4 ms, right after the start can go unseen.)
    """
    fd = os.open("stamp", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=folder)
    try:
        for _ in range(2):
            os.fstat(fd)
            os.ftruncate(fd, 0)
        return os.fstat(fd).st_ctime_ns
    finally:
        os.close(fd)


def plan_commit(
    tree: HostTree,
    uppers: list[tuple[str, int]],
    *,
    since_ns: int,
    xattr_prefix: str,
    max_bytes: int | None = None,
) -> CommitPlan:
    """Read the staged changes and plan their commit.

    Args:
        tree: the host's writable roots.
        uppers: ``(root, fd of its overlay's upper folder)`` for every staged root.
        since_ns: an inode change time taken when the job started (`change_stamp`): a
            host path with a ctime at or after it changed while the job ran, a conflict.
        xattr_prefix: ``"user."`` for an overlay made in a user namespace, else
            ``"trusted."``.
        max_bytes: the most the staged files may hold in all, as the commit writes them
            (the job's disk budget); ``None``: no limit.
    """
    plan = CommitPlan()
    planner = _Planner(tree, since_ns, xattr_prefix, plan)
    planner.max_bytes = max_bytes
    for root, upper in uppers:
        upper_st = os.fstat(upper)
        root_st = tree.lstat(root)
        if root_st is not None and stat.S_IMODE(upper_st.st_mode) != stat.S_IMODE(root_st.st_mode):
            mode = planner.stripped(root, upper_st, root_st)
            if mode != stat.S_IMODE(root_st.st_mode):
                planner.items.append(_Item(root, _Upper(DirState(mode=mode)), root_st))
        planner.root, planner.upper_root = root, upper
        planner.walk(upper, root, host_known=True)
    planner.vanished_conflicts()
    if not plan.conflicts:
        planner.operations()
    return plan


def store_originals(plan: CommitPlan, tree: HostTree, store: BlobStore) -> None:
    """Copy every host file the plan destroys into the blob store (before the journal).

    Raises:
        Blocked: a file changed since it was planned (the caller treats it as a conflict).
    """
    for path, (fp, sha256) in plan.destroyed.items():
        tree.release()
        try:
            fd = tree.open_file(path)
        except FileNotFoundError:
            raise Blocked(f"{path} changed on the host while the commit read it") from None
        except PermissionError as exc:
            raise Blocked(
                f"{path}: {unreadable(exc, 'the worker cannot read it to keep its original')}"
            ) from None
        try:
            got = Fingerprint.of(os.fstat(fd))
            if got != fp:
                raise Blocked(f"{path} changed on the host while the commit read it")
            digest, _ = store.put_fd(fd)
        finally:
            os.close(fd)
        if digest != sha256:
            raise Blocked(f"{path} changed on the host while the commit read it")
