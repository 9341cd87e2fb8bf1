"""The worker's private files: created 0600/0700 whatever the umask, loosened ones tightened.

What lives there: the queue database (every job's arguments and results) and its ``-wal``
and ``-shm``, the state folder (blobs: the originals of changed files; journals), the
cache of verified executors and compiled wasm modules, signing keys. Another local user
must not read them, nor write them (a planted blob, journal or compiled module is code or
content the worker would trust).

Rules (tested in ``tests/test_private_files.py``, through a real worker process):

* **Created private, exactly.** `private_dir` / `create_private_file` set the mode with
  ``chmod`` after creating: a umask can only take bits away, so ``mkdir(path, 0o700)`` under
  ``umask 0o277`` would give a folder its own owner cannot write, and one created by
  SQLite, ``open()`` or ``Path.mkdir`` under ``umask 0`` is world-readable.
* **Existing ones tightened, said aloud.** At start the worker checks what it already
  has. A folder or file it owns that other users may read, write or search loses those
  bits (``o-rwx``) and a ``files.tightened`` warning names it. Group bits are left as they
  are and named in the same warning: a group shared on purpose (a producer in another
  account submitting to the same queue) stays shared, by decision of whoever set it.
  One the worker does not own is not changed (``files.exposed`` warning): it may be
  another user's queue the worker was pointed at; nor is a shared sticky folder such as
  ``/tmp`` named as a state folder.
* **Where.** The queue database when a worker (or producer) opens it to create, and its
  ``-wal``/``-shm``; the state folder, ``blobs/`` and ``journal/`` (`Staging`,
  `BlobStore`, `Journal`); the verified-executor cache and the wasm module cache when a
  worker starts and when they are made; a new signing key and its folder. A folder being
  private is what protects the files in it: their own modes are left as they are.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from .errors import BadConfig
from .logs import get_logger

__all__ = ("check_folder", "create_private_file", "private_dir", "private_file", "tighten")

_log = get_logger()

_OTHER = stat.S_IRWXO
_GROUP = stat.S_IRWXG


def tighten(path: str | os.PathLike[str]) -> bool:
    """Take the "other" bits off `path` (no symlink followed) when this process owns it;
    log what stays open. Returns whether the mode changed; a missing path is nothing."""
    p = os.fspath(path)
    try:
        st = os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):  # missing, or under a file
        return False
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & (_OTHER | _GROUP):
        return False
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        if mode & _OTHER:
            _log.warning(
                "files.exposed",
                path=p,
                mode=oct(mode),
                detail="other users can reach this private file; it is not ours to change",
            )
        return False
    if not mode & _OTHER:
        return False  # group bits only: a deliberate share, left alone
    if st.st_mode & stat.S_ISVTX:
        # A shared folder (/tmp) named as a state folder: never narrowed under its users.
        _log.warning(
            "files.exposed",
            path=p,
            mode=oct(mode),
            detail="a shared (sticky) folder holds private files; give them a folder of their own",
        )
        return False
    new = mode & ~_OTHER
    try:
        os.chmod(p, new)
    except OSError as exc:  # a read-only file system, say: it stays as it is, said aloud
        _log.warning("files.exposed", path=p, mode=oct(mode), detail=f"cannot tighten: {exc}")
        return False
    _log.warning(
        "files.tightened",
        path=p,
        was=oct(mode),
        now=oct(new),
        detail="other users could reach a private file of the worker"
        + ("; its group still can" if new & _GROUP else ""),
    )
    return True


def private_dir(path: str | os.PathLike[str]) -> Path:
    """`path` as a folder: created 0700 (exactly) when missing, with its missing parents
    (0700 too); tightened (see `tighten`) when it exists."""
    p = Path(path)
    missing = [a for a in reversed(p.parents) if not a.exists()]
    for ancestor in missing:  # 0700 too, set exactly: a umask may not lock us out
        with contextlib.suppress(FileExistsError):
            os.mkdir(ancestor, 0o700)
            os.chmod(ancestor, 0o700)
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        tighten(p)
        return p
    os.chmod(p, 0o700)
    return p


def create_private_file(path: str | os.PathLike[str], *, tighten_existing: bool = True) -> bool:
    """Create `path` empty, 0600 exactly, unless it exists (then `tighten` it, unless
    `tighten_existing` is false). Returns whether it was created."""
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        if tighten_existing:
            tighten(p)
        return False
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return True


def private_file(path: str | os.PathLike[str]) -> None:
    """`tighten` `path` if it exists (a file something else creates, e.g. SQLite's)."""
    tighten(path)


def check_folder(path: str | os.PathLike[str], *, what: str, fix: str) -> None:
    """Refuse a folder of the worker it could not use, before anything is made.

    `path`, or the nearest of its parents that exists, must be a folder this process can
    write and search (and read, for `path` itself). Creates and changes nothing.

    Raises:
        BadConfig: naming `what` (``"cache folder"``), `path`, the problem and `fix`.
    """
    p = Path(path)
    problem = "no folder above it exists"
    for candidate in (p, *p.parents):
        try:
            st = os.stat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            continue  # missing, or under a file: the file is found further up
        except OSError as exc:  # EACCES: a folder above it cannot be searched
            problem = f"{candidate}: {exc.strerror}"
            break
        if not stat.S_ISDIR(st.st_mode):
            problem = f"{candidate} is a file, not a folder"
        elif not os.access(candidate, os.W_OK | os.X_OK | (os.R_OK if candidate == p else 0)):
            problem = f"{candidate} is not {'readable and ' if candidate == p else ''}writable "
            problem += "by this user, or is on a read-only file system"
        else:
            return
        break
    raise BadConfig(f"the worker's {what} {p} cannot be used: {problem}; {fix}")
