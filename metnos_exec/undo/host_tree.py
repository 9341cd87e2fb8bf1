"""The host tree: a job's writable roots, reached only through fds, and what a path holds.

Paths are walked from the root's fd one component at a time (``O_NOFOLLOW |
O_DIRECTORY``); nothing below a root is ever resolved through a symlink (the first rule of
`metnos_exec.undo.journal`'s table). A path's state (`PathState`) and its fingerprint
(`Fingerprint`: inode, size, mtime, ctime, mode) are read here; the conflicts a check
finds (`Conflict`, `OpConflict`, `Blocked`) are named here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import stat
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from ..errors import SymlinkedFolder
from ..messages import Absent, DirState, FileState, LinkState, PathState
from ..sandbox.mount_sources import open_source, symlink_on_path

__all__ = (
    "MAX_OPEN_FOLDERS",
    "Blocked",
    "Conflict",
    "Fingerprint",
    "HostTree",
    "OpConflict",
    "conflict_message",
    "file_state",
    "fingerprints",
    "hash_fd",
    "same_state",
    "strip_mode",
)

#: Permission bits kept on the host: setuid and setgid never are (see `strip_mode`).
_KEPT_BITS: Final = 0o1777
_CHUNK: Final = 1024 * 1024
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: The owner's bits a folder needs for entries to be made in it (write, search).
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


class HostTree:
    """The writable roots of a job, reached only through fds (see
    `metnos_exec.undo.journal`'s table).

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


def fingerprints(tree: HostTree, paths: Iterable[str]) -> dict[str, Fingerprint | None]:
    """Current fingerprints of `paths` (``None`` where absent)."""
    out: dict[str, Fingerprint | None] = {}
    for path in paths:
        st = tree.lstat(path)
        out[path] = None if st is None else Fingerprint.of(st)
    return out
