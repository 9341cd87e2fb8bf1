"""Applying file changes to the host crash-safely: the host tree, the ops, the journal.

A commit (the staged changes of a job), an undo (an entry's operations) and a roll-back all
come down to one thing: take a list of `Put` / `Move` operations, each saying what a path
holds now (``before``) and what it must hold (``after``), and apply them to the real
folders so that a crash at any point leaves a state the next start can settle. This module
does that; it knows nothing about overlays, brokers or jobs.

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
import errno
import fcntl
import hashlib
import os
import posixpath
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, NamedTuple, Protocol

import msgspec

from ..errors import SymlinkedFolder
from ..messages import (
    Absent,
    DirState,
    FileState,
    LinkState,
    Move,
    PathState,
    Put,
    UndoOp,
    new_job_id,
    writes_content,
)
from ..private import private_dir
from ..sandbox.mount_sources import open_source, symlink_on_path
from .blobs import BlobMissing, BlobStore

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
    "hash_fd",
    "inverse",
    "order_ops",
    "reverse_ops",
    "rollback",
    "same_state",
    "strip_mode",
)

#: Permission bits kept on the host: setuid and setgid never are (see `strip_mode`).
_KEPT_BITS: Final = 0o1777
_CHUNK: Final = 1024 * 1024
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: The owner's bits a folder needs for entries to be made in it (write, search).
_OWNER_WX: Final = 0o300
#: Folder fds a `HostTree` keeps open at most (see `HostTree.dir_fd`).
MAX_OPEN_FOLDERS: Final = 64


def strip_mode(mode: int) -> int:
    """Permission bits as committed: no setuid, no setgid (a planted setuid binary, or a
    setgid folder handing its group to what the host creates in it later)."""
    return mode & _KEPT_BITS


class Fingerprint(NamedTuple):
    """What a path looked like when planned; any change to it changes one of these."""

    dev: int
    ino: int
    mode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Fingerprint:
        return cls(st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Blocked(Exception):
    """A parent of the path is not a plain folder (a symlink, a file), or the path lies
    outside every root: it is never walked through."""


class _NotAFolder(Blocked):
    """A parent of the path is a file (or another entry that is neither a folder nor a
    symlink): nothing can be at the path."""


@dataclass(frozen=True)
class Conflict:
    """A path whose current state is not what an op expects."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


class OpConflict(Exception):
    """Applying stopped at a conflict; everything applied before it was rolled back."""

    def __init__(self, conflicts: Sequence[Conflict]) -> None:
        super().__init__("; ".join(map(str, conflicts)))
        self.conflicts = tuple(conflicts)


# --- the host tree --------------------------------------------------------------------


class HostTree:
    """The writable roots of a job, reached only through fds (see the module table).

    Args:
        roots: absolute, symlink-free folders (the planner resolved them); a root that is
            now a symlink is refused.
        as_root: restore owners (``uid``/``gid``) too; only root may.
    """

    def __init__(self, roots: Iterable[str], *, as_root: bool | None = None) -> None:
        self.roots = tuple(sorted({posixpath.normpath(r) for r in roots}, key=len, reverse=True))
        self.as_root = os.geteuid() == 0 if as_root is None else as_root
        self._fds: OrderedDict[str, int] = OrderedDict()
        #: Evicted from `_fds`, closed by `release` (a caller may still be using one).
        self._retired: list[int] = []

    def close(self) -> None:
        fds, self._fds = self._fds, OrderedDict()
        self.release()
        for fd in fds.values():
            os.close(fd)

    def release(self) -> None:
        """Close the folder fds `dir_fd` evicted from its cache. Only where no fd this tree
        gave out is still in use: between two operations (every user of this class
        uses the fds `dir_fd` and `split` give at once, within one operation)."""
        retired, self._retired = self._retired, []
        for fd in retired:
            os.close(fd)

    def __enter__(self) -> HostTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def root_of(self, path: str) -> str:
        for root in self.roots:
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return root
        raise Blocked(f"{path} is outside the job's folders")

    def dir_fd(self, folder: str) -> int:
        """An fd on `folder`, walked from its root without following any symlink.

        Raises:
            Blocked: a component is a symlink or not a folder.
            FileNotFoundError: a component does not exist.
        """
        fd = self._fds.get(folder)
        if fd is not None:
            self._fds.move_to_end(folder)
            return fd
        root = self.root_of(folder)
        if folder == root:
            fd = _open_root(root)
        else:
            parent = self.dir_fd(posixpath.dirname(folder))
            name = posixpath.basename(folder)
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            except (NotADirectoryError, OSError) as exc:
                if isinstance(exc, FileNotFoundError):
                    raise
                # ELOOP or ENOTDIR (a symlink under O_NOFOLLOW, a file): never walked
                # through. A file is told from a link: nothing can lie below a file, so
                # `lstat` finds nothing there (an undo that turns a file back into a
                # folder looks for the folder's entries first).
                blocked = Blocked
                with contextlib.suppress(OSError):
                    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                    if not stat.S_ISLNK(st.st_mode):
                        blocked = _NotAFolder
                raise blocked(f"{folder} is not a plain folder ({exc.strerror})") from exc
        self._fds[folder] = fd
        # At most MAX_OPEN_FOLDERS kept: a job may create or touch any number of folders,
        # and the worker's open files are bounded (1,500 folders made a commit fail under
        # a service's 1,024; tests/adversarial: files.many_folders). The least recently
        # used is evicted, and closed at the next `release`.
        while len(self._fds) > MAX_OPEN_FOLDERS:
            self._retired.append(self._fds.popitem(last=False)[1])
        return fd

    def forget(self, folder: str) -> None:
        """Drop cached fds at and below `folder` (after it was removed or renamed)."""
        prefix = folder.rstrip("/") + "/"
        for path in [p for p in self._fds if p == folder or p.startswith(prefix)]:
            os.close(self._fds.pop(path))

    def split(self, path: str) -> tuple[int, str]:
        """``(fd of the parent folder, last component)``."""
        return self.dir_fd(posixpath.dirname(path)), posixpath.basename(path)

    def lstat(self, path: str) -> os.stat_result | None:
        """The path's own lstat, or ``None`` when nothing is there (nor its parent, or a
        parent is a file).

        Raises:
            Blocked: a parent is a symlink.
        """
        if path in self.roots:
            return os.fstat(self.dir_fd(path))
        try:
            parent, name = self.split(path)
            return os.stat(name, dir_fd=parent, follow_symlinks=False)
        except (FileNotFoundError, _NotAFolder):
            return None

    def state(self, path: str) -> PathState | None:
        """What is at `path`, content hashed; ``None`` for a special file (fifo, socket,
        device), which no op handles."""
        st = self.lstat(path)
        if st is None:
            return Absent()
        return self.state_of(path, st)

    def state_of(self, path: str, st: os.stat_result) -> PathState | None:
        if stat.S_ISREG(st.st_mode):
            return file_state(st, *self.hash_file(path, st))
        if stat.S_ISLNK(st.st_mode):
            parent, name = self.split(path)
            return LinkState(target=os.readlink(name, dir_fd=parent))
        if stat.S_ISDIR(st.st_mode):
            return DirState(mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid)
        return None

    def open_file(self, path: str, st: os.stat_result | None = None) -> int:
        """A read-only fd on the regular file at `path` (checked to be the same inode as
        `st` when given)."""
        parent, name = self.split(path)
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
        )
        got = os.fstat(fd)
        if not stat.S_ISREG(got.st_mode) or (
            st is not None and (got.st_ino, got.st_dev) != (st.st_ino, st.st_dev)
        ):
            os.close(fd)
            raise Blocked(f"{path} changed while it was read")
        return fd

    def hash_file(self, path: str, st: os.stat_result | None = None) -> tuple[str, int]:
        fd = self.open_file(path, st)
        try:
            return hash_fd(fd)
        finally:
            os.close(fd)


def _open_root(root: str) -> int:
    """A root, opened with no symlink anywhere on its path (not only its last component):
    a parent swapped for a link after the job started (by another job's commit, which may
    write the folder above) would send the writes wherever the link points.

    Raises:
        Blocked: a component of the root is a symlink, or the root is not a folder (or
            gone).
    """
    try:
        held = open_source(root)
    except SymlinkedFolder:
        link = symlink_on_path(root) or root
        raise Blocked(f"root {root} is now reached through the symlink {link}") from None
    except OSError as exc:
        raise Blocked(f"root {root} cannot be opened as a plain folder: {exc}") from exc
    try:
        return os.open(".", _DIR_FLAGS, dir_fd=held)
    except OSError as exc:
        raise Blocked(f"root {root} cannot be opened as a plain folder: {exc}") from exc
    finally:
        os.close(held)


def file_state(st: os.stat_result, sha256: str, size: int) -> FileState:
    """The `FileState` of a regular file whose lstat is `st` and content hash `sha256`."""
    return FileState(
        sha256=sha256,
        size=size,
        mode=stat.S_IMODE(st.st_mode),
        mtime_ns=st.st_mtime_ns,
        uid=st.st_uid,
        gid=st.st_gid,
    )


def conflict_message(what: str, conflicts: Sequence[Conflict], *, limit: int = 10) -> str:
    """``"<what>: /a (reason); /b (reason) and 3 more"``."""
    shown = "; ".join(map(str, conflicts[:limit]))
    more = f" and {len(conflicts) - limit} more" if len(conflicts) > limit else ""
    return f"{what}: {shown}{more}"


def hash_fd(fd: int) -> tuple[str, int]:
    """SHA-256 (hex) and size of what `fd` holds from its offset on."""
    digest = hashlib.sha256()
    size = 0
    while chunk := os.read(fd, _CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def same_state(current: PathState | None, expected: PathState) -> bool:
    """Whether `current` is `expected` for conflict purposes: kind, content, target and
    permission bits; mtime and owner are restored but never compared."""
    if current is None:
        return False
    if isinstance(expected, FileState):
        return (
            isinstance(current, FileState)
            and current.sha256 == expected.sha256
            and current.mode == expected.mode
        )
    if isinstance(expected, DirState):
        return isinstance(current, DirState) and current.mode == expected.mode
    return current == expected


# --- order and inverse ----------------------------------------------------------------


def inverse(op: UndoOp) -> UndoOp:
    if isinstance(op, Move):
        return Move(src=op.dst, dst=op.src, state=op.state)
    return Put(path=op.path, before=op.after, after=op.before)


def _split(op: UndoOp) -> Iterator[UndoOp]:
    """A type change becomes a removal and a creation (never one step on the host). A
    folder made without its owner's write and search bits is made with them and given its
    mode with the other mode changes, last: a worker that is not root could not make the
    folder's entries in it (the commit of a job that made a read-only folder with
    contents failed as a host fault)."""
    pieces: tuple[UndoOp, ...] = (op,)
    if (
        isinstance(op, Put)
        and not isinstance(op.before, Absent)
        and not isinstance(op.after, Absent)
        and type(op.before) is not type(op.after)
    ):
        pieces = (
            Put(path=op.path, before=op.before, after=Absent()),
            Put(path=op.path, before=Absent(), after=op.after),
        )
    for piece in pieces:
        if (
            isinstance(piece, Put)
            and isinstance(piece.before, Absent)
            and isinstance(piece.after, DirState)
            and piece.after.mode & _OWNER_WX != _OWNER_WX
        ):
            made = msgspec.structs.replace(piece.after, mode=piece.after.mode | _OWNER_WX)
            yield Put(path=piece.path, before=Absent(), after=made)
            yield Put(path=piece.path, before=made, after=piece.after)
        else:
            yield piece


def _depth(path: str) -> int:
    return path.count("/")


def order_ops(ops: Iterable[UndoOp]) -> tuple[UndoOp, ...]:
    """The safe order to apply `ops` in (see the module docstring)."""
    split = [piece for op in ops for piece in _split(op)]
    removed_dirs = {
        op.path
        for op in split
        if isinstance(op, Put) and isinstance(op.before, DirState) and isinstance(op.after, Absent)
    }

    def key(op: UndoOp) -> tuple[int, int, str]:
        if isinstance(op, Move):
            phase = 6 if op.dst in removed_dirs else 3
            return phase, 0, op.dst
        before, after = op.before, op.after
        if isinstance(before, DirState) and isinstance(after, DirState):
            opens = after.mode & 0o200 and not before.mode & 0o200
            return (0 if opens else 7), -_depth(op.path), op.path
        if isinstance(after, Absent):
            if isinstance(before, DirState):
                return 5, -_depth(op.path), op.path
            return 1, 0, op.path
        if isinstance(after, DirState):
            return 2, _depth(op.path), op.path
        if isinstance(before, Absent) and op.path in removed_dirs:
            return 6, 0, op.path
        return 4, 0, op.path

    return tuple(sorted(split, key=key))


def reverse_ops(ops: Iterable[UndoOp]) -> tuple[UndoOp, ...]:
    """The ops that take the host back from the ``after`` of `ops` to their ``before``."""
    return order_ops(inverse(op) for op in ops)


# --- content --------------------------------------------------------------------------


class ContentSource(Protocol):
    """Where the content of a file an op writes comes from."""

    def fetch(self, path: str, state: FileState) -> bytes | int:
        """The content for `path`: the bytes, or an fd (read from offset 0, closed by the
        caller)."""
        ...


class BlobSource:
    """Content from the blob store (undo, redo, roll-back)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store

    def fetch(self, path: str, state: FileState) -> bytes | int:
        return self.store.open_checked(state.sha256, state.size)


# --- applying -------------------------------------------------------------------------


def _read_umask() -> int | None:
    """This process's umask, read without changing it (``os.umask`` would, for every
    thread at once); ``None`` when the kernel does not say (before Linux 4.7)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


#: Read once: a worker does not change its umask while it runs.
_UMASK: Final = _read_umask()
#: A file's POSIX access ACL (named users and groups, the mask), as an extended attribute.
_ACL: Final = "system.posix_acl_access"


def _acl_of(parent: int, name: str) -> bytes | None:
    """The access ACL of `name` in `parent` (``None``: it has none, or its file system
    keeps none). Read through the folder's fd, the name not followed: no open of a file
    the worker may not read."""
    try:
        return os.getxattr(f"/proc/self/fd/{parent}/{name}", _ACL, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
            return None
        raise


def _temp_name(tag: str, index: int) -> str:
    return f".metnos-{tag}-{index}.tmp"


def _write_content(dst: int, content: bytes | int) -> None:
    if isinstance(content, bytes):
        view = memoryview(content)
        while view:
            _step("write")
            view = view[os.write(dst, view) :]
        return
    try:
        while chunk := os.read(content, _CHUNK):
            view = memoryview(chunk)
            while view:
                _step("write")
                view = view[os.write(dst, view) :]
    finally:
        os.close(content)


class _Applier:
    """Applies ops one at a time (module table); remembers what it did for a roll-back."""

    def __init__(
        self,
        tree: HostTree,
        source: ContentSource,
        *,
        tag: str,
        fsync: bool = False,
    ) -> None:
        self.tree = tree
        self.source = source
        self.tag = tag
        self.fsync = fsync
        self.written: set[str] = set()  # folders to fsync at the end

    def _meta(self, fd: int, state: FileState | DirState, *, chmod: bool = True) -> None:
        if chmod:
            _step("chmod")
            os.fchmod(fd, state.mode)
        if self.tree.as_root and state.uid is not None and state.gid is not None:
            # Most files already have their owner (made by root in root's folder): an
            # fstat is cheaper than a chown, which also rewrites the inode.
            st = os.fstat(fd)
            if (st.st_uid, st.st_gid) != (state.uid, state.gid):
                _step("chown")
                os.fchown(fd, state.uid, state.gid)
        if isinstance(state, FileState) and state.mtime_ns is not None:
            _step("utime")
            os.utime(fd, ns=(state.mtime_ns, state.mtime_ns))

    def _new_file(
        self, parent: int, name: str, path: str, state: FileState, *, acl: bytes | None = None
    ) -> None:
        """Create `name` with `state`'s content and metadata; `acl`: the access ACL of the
        file it replaces, carried over (it sets the group bits: the mode is set after)."""
        # Created with its final mode when the umask lets it through unchanged: one
        # syscall (and one inode update in the file system's journal) less per file,
        # which is a third of a small file's commit.
        exact = acl is None and _UMASK is not None and state.mode & ~_UMASK & 0o777 == state.mode
        _step("create")
        fd = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            state.mode if exact else 0o600,
            dir_fd=parent,
        )
        try:
            _write_content(fd, self.source.fetch(path, state))
            if acl is not None:
                _step("setxattr")
                os.setxattr(fd, _ACL, acl)
            self._meta(fd, state, chmod=not exact)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def apply(self, op: UndoOp, index: int) -> None:
        tree = self.tree
        if isinstance(op, Move):
            sp, sn = tree.split(op.src)
            dp, dn = tree.split(op.dst)
            # link + unlink: never replaces what may have appeared at dst meanwhile.
            _step("link")
            os.link(sn, dn, src_dir_fd=sp, dst_dir_fd=dp, follow_symlinks=False)
            _step("unlink")
            os.unlink(sn, dir_fd=sp)
            return
        path, before, after = op.path, op.before, op.after
        if path in tree.roots:
            # A root is a mount point in the sandbox: only its mode can have changed.
            if isinstance(after, DirState):
                self._meta(tree.dir_fd(path), after)
                return
            raise Blocked(f"{path} is a root: it can only change mode")
        parent, name = tree.split(path)
        if isinstance(after, Absent):
            if isinstance(before, DirState):
                _step("rmdir")
                os.rmdir(name, dir_fd=parent)
                tree.forget(path)
            elif not isinstance(before, Absent):
                _step("unlink")
                os.unlink(name, dir_fd=parent)
            return
        if isinstance(after, DirState):
            if isinstance(before, Absent):
                _step("mkdir")
                os.mkdir(name, 0o700, dir_fd=parent)
            self._meta(tree.dir_fd(path), after)
            return
        if isinstance(after, LinkState):
            if isinstance(before, Absent):
                _step("symlink")
                os.symlink(after.target, name, dir_fd=parent)
            else:
                tmp = _temp_name(self.tag, index)
                _step("symlink")
                os.symlink(after.target, tmp, dir_fd=parent)
                _step("rename")
                os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            return
        assert isinstance(after, FileState)
        if isinstance(before, Absent):
            self._new_file(parent, name, path, after)
        elif not writes_content(op):
            fd = tree.open_file(path)
            try:
                self._meta(fd, after)
            finally:
                os.close(fd)
        else:
            tmp = _temp_name(self.tag, index)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=parent)  # left by a crash of an earlier attempt
            # New content goes into a new inode: the old one's ACL (named users and
            # groups) goes with it, or its owning group would gain the mask's rights.
            self._new_file(parent, tmp, path, after, acl=_acl_of(parent, name))
            _step("rename")
            os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        if self.fsync:
            self.written.add(posixpath.dirname(path))

    def sync(self) -> None:
        if self.fsync:
            for folder in sorted(self.written):
                self.tree.release()
                os.fsync(self.tree.dir_fd(folder))


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
    applier = _Applier(tree, source, tag=tag, fsync=fsync)
    done: list[UndoOp] = []
    pause_at = len(ops) // 2 if os.environ.get(PAUSE_ENV) else -1
    try:
        for index, op in enumerate(ops):
            tree.release()
            if index == pause_at:
                _pause_for_test(os.environ[PAUSE_ENV])
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
                    [Conflict(_op_path(op), "appeared on the host since it was checked")]
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


#: Test hook (the crash-safety acceptance test): set to a path, the first commit that
#: reaches the middle of its ops creates that file and stops there for good, so the test
#: can SIGKILL the worker mid-commit. Later commits see the file and do not stop.
PAUSE_ENV: Final = "METNOS_TEST_PAUSE_COMMIT"


#: Test hook (the crash-point tests, ``tests/undo/test_crash_points.py``): ``N`` makes this
#: process die (``os._exit``: no clean-up, as a kill) just before its N-th step (from 0)
#: that changes the host or a journal (a ``mkdir``, a ``chmod``, one ``write`` of a file's
#: content, a ``rename``...); ``NAME:K``, before the K-th step called NAME. Read at import;
#: a test that forks sets it with `crash_at`.
CRASH_ENV: Final = "METNOS_TEST_CRASH_AT"
#: The exit status of a process the crash hook stopped.
CRASH_EXIT: Final = 86


@dataclass
class _CrashPoint:
    at: int
    name: str | None
    seen: int = 0


_crash: _CrashPoint | None = None


def crash_at(spec: str | None) -> None:
    """Set this process's crash point (see `CRASH_ENV`); ``None`` or ``""``: none."""
    global _crash
    if not spec:
        _crash = None
        return
    name, _, at = spec.rpartition(":")
    _crash = _CrashPoint(int(at), name or None)


def _step(name: str) -> None:
    """The process is about to take step `name` (see `CRASH_ENV`)."""
    point = _crash
    if point is None or (point.name is not None and point.name != name):
        return
    if point.seen == point.at:
        os.write(2, f"metnos-test-crash: before step {point.at} ({name})\n".encode())
        os._exit(CRASH_EXIT)
    point.seen += 1


crash_at(os.environ.get(CRASH_ENV))


def _pause_for_test(marker: str) -> None:
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    threading.Event().wait()  # until the test kills this process


def rollback(
    tree: HostTree,
    applied: Sequence[UndoOp],
    *,
    store: BlobStore,
    tag: str,
) -> list[Conflict]:
    """Revert `applied` (in reverse), each path only when it holds what the op left there
    (or a partial creation of it). Returns the paths left alone because they hold neither
    the op's ``before`` nor its ``after`` (someone else changed them)."""
    left: list[Conflict] = []
    applier = _Applier(tree, BlobSource(store), tag=f"{tag}-rb")
    earlier = _earlier_states(applied)
    found: dict[str, PathState] = {}
    for op in applied:
        found.setdefault(op.src if isinstance(op, Move) else op.path, _found_by(op))
    for index, op in reversed(list(enumerate(applied))):
        tree.release()
        # Temp files of an interrupted replace, and of an interrupted roll-back's.
        if isinstance(op, Put):
            for temp in (_temp_name(tag, index), _temp_name(f"{tag}-rb", index)):
                with contextlib.suppress(OSError, Blocked):
                    parent, _ = tree.split(op.path)
                    os.stat(temp, dir_fd=parent, follow_symlinks=False)
                    _step("unlink")
                    os.unlink(temp, dir_fd=parent)
        try:
            undo = _revert_step(tree, op, earlier[index], store)
        except Blocked as exc:
            if _creates(op) and below_no_folder(_op_path(op), found):
                # Below a file or link the ops replace by a folder, which is not a folder
                # (yet, or again): the op never ran, or was reverted with it.
                continue
            left.append(Conflict(op.path if isinstance(op, Put) else op.dst, str(exc)))
            continue
        if isinstance(undo, Conflict):
            left.append(undo)
        elif undo is not None:
            try:
                applier.apply(undo, index)
            except (OSError, Blocked, BlobMissing) as exc:
                left.append(Conflict(_op_path(op), f"roll-back failed: {exc}"))
    return left


def _found_by(op: UndoOp) -> PathState:
    return op.state if isinstance(op, Move) else op.before


def _creates(op: UndoOp) -> bool:
    """Whether `op` makes something where nothing was (a move makes its ``dst``)."""
    return isinstance(op, Move) or isinstance(op.before, Absent)


def _op_path(op: UndoOp) -> str:
    return op.dst if isinstance(op, Move) else op.path


def below_no_folder(path: str, found: Mapping[str, PathState]) -> bool:
    """Whether a parent of `path` is, by `found` (what a list of ops finds at its paths),
    a file or a symlink: a folder the ops make again in its place, and nothing of theirs
    is below it until they do."""
    parent = posixpath.dirname(path)
    while parent != path:
        state = found.get(parent)
        if state is not None and not isinstance(state, DirState | Absent):
            return True
        path, parent = parent, posixpath.dirname(parent)
    return False


def _earlier_states(ops: Sequence[UndoOp]) -> list[tuple[PathState, ...]]:
    """For each op, what the ops before it found and left at its path (its ``dst`` for a
    move): a type change, or a folder made and then given its mode, is two ops on one
    path; a crash in the first leaves half of its ``after``, and a roll-back cut short
    may have put back its ``before`` already."""
    seen: dict[str, list[PathState]] = {}
    out: list[tuple[PathState, ...]] = []
    for op in ops:
        path = _op_path(op)
        out.append(tuple(seen.get(path, ())))
        if isinstance(op, Move):
            seen.setdefault(op.src, []).extend((op.state, Absent()))
            seen.setdefault(op.dst, []).append(op.state)
        else:
            seen.setdefault(path, []).extend((op.before, op.after))
    return out


def _partial(current: PathState | None, target: PathState) -> bool:
    """Whether `current` may be `target` created in place and cut short by a crash: a
    folder whose mode or owner is not set yet (``mkdir``, then ``chmod``, ``chown``), a
    file shorter than it or with all of its content but not its mode or owner yet
    (created ``O_EXCL`` and written in place). A link is made in one step."""
    if isinstance(target, DirState):
        return isinstance(current, DirState)
    if isinstance(target, FileState) and isinstance(current, FileState):
        return current.size < target.size or current.sha256 == target.sha256
    return False


def _begins(
    tree: HostTree, path: str, current: PathState, original: PathState, store: BlobStore | None
) -> bool:
    """Whether the file at `path` (`current`, shorter than `original`) holds the first
    bytes of `original` (its blob in `store`): a restore cut short, not someone's file.
    Anything else (a folder) is `_partial` enough."""
    if not (isinstance(current, FileState) and isinstance(original, FileState)):
        return True
    if current.sha256 == original.sha256:
        return True
    if store is None:
        return False
    try:
        blob = store.open_checked(original.sha256, original.size)
    except BlobMissing:
        return False
    try:
        fd = tree.open_file(path)
    except (OSError, Blocked):
        os.close(blob)
        return False
    try:
        left = current.size
        while left:
            mine = os.read(fd, min(left, _CHUNK))
            if not mine or os.read(blob, len(mine)) != mine:
                return False
            left -= len(mine)
        return True
    finally:
        os.close(fd)
        os.close(blob)


def _any_of(current: PathState | None, states: Iterable[PathState]) -> bool:
    """Whether `current` is one of `states`, or one cut short (`_partial`)."""
    return any(same_state(current, s) or _partial(current, s) for s in states)


def _exact(tree: HostTree, current: PathState | None, expected: PathState) -> bool:
    """`same_state`, and the metadata a roll-back restores too: the mtime when it was
    recorded, the owner when this process restores owners."""
    if not same_state(current, expected):
        return False
    if (
        isinstance(expected, FileState)
        and isinstance(current, FileState)
        and expected.mtime_ns is not None
        and current.mtime_ns != expected.mtime_ns
    ):
        return False
    if tree.as_root and isinstance(expected, FileState | DirState) and expected.uid is not None:
        assert isinstance(current, FileState | DirState)
        return (current.uid, current.gid) == (expected.uid, expected.gid)
    return True


def _revert_step(
    tree: HostTree,
    op: UndoOp,
    earlier: Sequence[PathState] = (),
    store: BlobStore | None = None,
) -> UndoOp | Conflict | None:
    """The op that reverts `op` given what the host holds now; ``None``: nothing to do.

    The host may hold `op`'s ``after`` (revert it), its ``before`` (nothing to do), or a
    state a crash left half-way (the module table): `op` cut short (`_partial`: what it
    was creating is removed), an earlier roll-back of `op` cut short (its ``before`` is
    finished), or, on a path two ops change (a type change), what an earlier roll-back
    put back for the op before it (`earlier`: left to that op).
    """
    if isinstance(op, Move):
        src, dst = tree.lstat(op.src), tree.lstat(op.dst)
        if (
            src is not None
            and dst is not None
            and (src.st_ino, src.st_dev) == (dst.st_ino, dst.st_dev)
        ):
            # Crashed between link and unlink (of the move, or of its roll-back): drop
            # the new name.
            return Put(path=op.dst, before=op.state, after=Absent())
        if src is None and dst is not None and same_state(tree.state(op.dst), op.state):
            return inverse(op)
        if src is not None and (dst is None or _any_of(tree.state(op.dst), earlier)):
            return None
        return Conflict(op.dst, "neither where the move left it nor where it found it")
    current = tree.state(op.path)
    if same_state(current, op.after):
        return inverse(op)
    if _exact(tree, current, op.before):
        return None
    if current is None:
        return Conflict(op.path, "is now a special file")
    if not isinstance(current, Absent) and (
        same_state(current, op.before)
        or (
            isinstance(op.after, Absent)
            and _partial(current, op.before)
            and _begins(tree, op.path, current, op.before, store)
        )
    ):
        # A roll-back of `op` cut short: the content is back but not yet its mode, owner
        # or mtime, or a removed folder or file made again but not finished.
        return Put(path=op.path, before=current, after=op.before)
    if isinstance(op.before, Absent) and _partial(current, op.after):
        # A creation cut short by the crash.
        return Put(path=op.path, before=current, after=Absent())
    if _any_of(current, earlier):
        return None  # an earlier op's roll-back was under way: that op takes it from here
    if (
        isinstance(op.before, FileState)
        and isinstance(op.after, FileState)
        and not writes_content(op)
        and isinstance(current, FileState)
        and current.sha256 == op.after.sha256
    ):
        # Metadata only, half applied (mode set, mtime not): put the old metadata back.
        return Put(path=op.path, before=current, after=op.before)
    return Conflict(op.path, "changed by someone else since")


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
                _step("journal.remove")
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
        _step("journal.create")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_content(fd, _record_encoder.encode(record))
            if self.fsync:
                os.fsync(fd)
            # Renamed only once complete: a journal that exists is a journal that parses.
            _step("journal.rename")
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


def fingerprints(tree: HostTree, paths: Iterable[str]) -> dict[str, Fingerprint | None]:
    """Current fingerprints of `paths` (``None`` where absent)."""
    out: dict[str, Fingerprint | None] = {}
    for path in paths:
        st = tree.lstat(path)
        out[path] = None if st is None else Fingerprint.of(st)
    return out
