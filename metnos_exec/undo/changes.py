"""The change set of a staged job, read from its overlays' upper folders.

An overlay records in its upper folder exactly what the job changed: new and modified
files and links (their whole content: ``metacopy`` is off), folders it created or whose
mode it changed, *whiteouts* (a character device 0/0, or an empty file carrying the
``overlay.whiteout`` xattr) for what it deleted, and *opaque* folders (xattr
``overlay.opaque = "y"``) for a folder it deleted and made again. `plan_commit` turns that
into ordered `Put` / `Move` operations on the real folders, each with the host state it
replaces, and checks the host did not change under the job.

The walk of the upper folders (pass 1) and the ops it yields (pass 2) are here; what a plan
holds (`CommitPlan`) and the checks each staged entry is held to are in
`metnos_exec.undo.change_checks`.

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
from typing import Final

import msgspec

from ..messages import Absent, DirState, FileState, LinkState, Move, PathState, Put, UndoOp
from .blobs import BlobStore
from .change_checks import (
    MAX_DEPTH,
    MAX_RECORD_BYTES,
    CommitPlan,
    Item,
    PlannerChecks,
    Upper,
    UpperSource,
    not_utf8,
    unreadable,
)
from .host_tree import Blocked, Fingerprint, HostTree, hash_fd, strip_mode
from .order import order_ops

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

#: Files up to this size are read into memory while hashed, and written from there.
_INLINE_MAX: Final = 64 * 1024
#: ... and at most this much in all: past it, small files too are read from their upper
#: folder when written (they were all held: a worker's memory as large as the disk budget).
INLINE_TOTAL: Final = 64 * 1024 * 1024
_CHUNK: Final = 1024 * 1024
_SETID: Final = stat.S_ISUID | stat.S_ISGID
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Planner(PlannerChecks):
    """Reads the staged entries (pass 1, `walk`) and turns them into ops (pass 2,
    `operations`)."""

    # --- pass 1: what the upper folders hold, and what the host holds there --------------
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
                self.items.append(Item(path, Upper(DirState(mode=mode)), host))
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

    def changed(self, path: str, after: PathState, host: os.stat_result | None) -> None:
        if host is not None and stat.S_ISDIR(host.st_mode) and not isinstance(after, DirState):
            # A folder replaced by a file or a link: everything below it goes first.
            for child, child_st in self.host_children(path):
                ok, _ = self.host_stat(child)
                if ok:
                    self.remove_host(child, child_st)
        self.items.append(Item(path, Upper(after), host))

    def host_children(self, folder: str) -> list[tuple[str, os.stat_result]]:
        # Listed and stat'ed at once: an entry's lazy stat would use the folder's fd,
        # which the tree may close meanwhile (`HostTree.release`).
        fd = self.tree.dir_fd(folder)
        return [
            (posixpath.join(folder, entry.name), entry.stat(follow_symlinks=False))
            for entry in sorted(os.scandir(fd), key=lambda e: e.name)
        ]

    def remove_host(self, path: str, st: os.stat_result) -> None:
        self.tree.release()  # no fd of the tree is held across this (`host_children`)
        if stat.S_ISDIR(st.st_mode) and not self.too_deep(path):
            for child, child_st in self.host_children(path):
                ok, _ = self.host_stat(child)
                if ok:
                    self.remove_host(child, child_st)
        self.items.append(Item(path, None, st))

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
            unrecordable = not_utf8(item)
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
                planner.items.append(Item(root, Upper(DirState(mode=mode)), root_st))
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
