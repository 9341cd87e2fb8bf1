"""The step executor: one op applied to the host, each of its steps a crash point.

`Applier` applies a `Put` or a `Move` as `metnos_exec.undo.journal`'s table says: new files
``O_EXCL``, replaced ones through a temp file and ``rename``, moves as ``link`` +
``unlink``, metadata (mode, owner, mtime, the access ACL of what a file replaces) set on
the fd. Where the content comes from is a `ContentSource` (`BlobSource`: the blob store).
It checks nothing: `metnos_exec.undo.journal.apply_ops` checks before each op, and
`metnos_exec.undo.rollback` decides what reverting takes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
from typing import Final, Protocol

from ..messages import Absent, DirState, FileState, LinkState, Move, UndoOp, writes_content
from .blobs import BlobStore
from .crash_points import step
from .host_tree import Blocked, HostTree

__all__ = ("Applier", "BlobSource", "ContentSource", "temp_name", "write_content")

_CHUNK: Final = 1024 * 1024


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


def temp_name(tag: str, index: int) -> str:
    return f".metnos-{tag}-{index}.tmp"


def write_content(dst: int, content: bytes | int) -> None:
    if isinstance(content, bytes):
        view = memoryview(content)
        while view:
            step("write")
            view = view[os.write(dst, view) :]
        return
    try:
        while chunk := os.read(content, _CHUNK):
            view = memoryview(chunk)
            while view:
                step("write")
                view = view[os.write(dst, view) :]
    finally:
        os.close(content)


class Applier:
    """Applies ops one at a time (`metnos_exec.undo.journal`'s table); remembers what it
    did for a roll-back."""

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
            step("chmod")
            os.fchmod(fd, state.mode)
        if self.tree.as_root and state.uid is not None and state.gid is not None:
            # Most files already have their owner (made by root in root's folder): an
            # fstat is cheaper than a chown, which also rewrites the inode.
            st = os.fstat(fd)
            if (st.st_uid, st.st_gid) != (state.uid, state.gid):
                step("chown")
                os.fchown(fd, state.uid, state.gid)
        if isinstance(state, FileState) and state.mtime_ns is not None:
            step("utime")
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
        step("create")
        fd = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            state.mode if exact else 0o600,
            dir_fd=parent,
        )
        try:
            write_content(fd, self.source.fetch(path, state))
            if acl is not None:
                step("setxattr")
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
            step("link")
            os.link(sn, dn, src_dir_fd=sp, dst_dir_fd=dp, follow_symlinks=False)
            step("unlink")
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
                step("rmdir")
                os.rmdir(name, dir_fd=parent)
                tree.forget(path)
            elif not isinstance(before, Absent):
                step("unlink")
                os.unlink(name, dir_fd=parent)
            return
        if isinstance(after, DirState):
            if isinstance(before, Absent):
                step("mkdir")
                os.mkdir(name, 0o700, dir_fd=parent)
            self._meta(tree.dir_fd(path), after)
            return
        if isinstance(after, LinkState):
            if isinstance(before, Absent):
                step("symlink")
                os.symlink(after.target, name, dir_fd=parent)
            else:
                tmp = temp_name(self.tag, index)
                step("symlink")
                os.symlink(after.target, tmp, dir_fd=parent)
                step("rename")
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
            tmp = temp_name(self.tag, index)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=parent)  # left by a crash of an earlier attempt
            # New content goes into a new inode: the old one's ACL (named users and
            # groups) goes with it, or its owning group would gain the mask's rights.
            self._new_file(parent, tmp, path, after, acl=_acl_of(parent, name))
            step("rename")
            os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        if self.fsync:
            self.written.add(posixpath.dirname(path))

    def sync(self) -> None:
        if self.fsync:
            for folder in sorted(self.written):
                self.tree.release()
                os.fsync(self.tree.dir_fd(folder))
