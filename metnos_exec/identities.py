"""A dedicated, unprivileged host uid for each job slot of a root worker.

Why: bubblewrap maps the guest's uid to the uid that *runs bubblewrap*. Started by a root
worker, the guest was host uid 0 for every permission check: root-only files in the
read-only system folders were readable, and root-owned kernel files such as
``/proc/sys/kernel/core_pattern`` writable (issue 8: host root code execution). isolate
and nsjail answer this the same way: each box (here, each slot of the process layer, one
per concurrent job) runs as a uid of its own that owns nothing on the host.

How, in the process layer (`metnos_exec.process.slots`, "Pooled cgroups"): a slot's spawner
thread is the only thread that forks that slot's jobs. Around each fork of a job that asks
for it (`ProcessSpec.as_slot_user`), that thread alone switches to the slot's uid and gid
with *raw* ``setresuid``/``setresgid``/``setgroups`` system calls (typed, `metnos_exec._libc`)
and back right after, to exactly the ids it had (a worker started from a login session has
supplementary groups and maybe a primary gid other than 0):
Linux credentials belong to a thread, and glibc's wrappers would change every thread of
the worker (they broadcast with a signal), the raw calls do not. The saved uid stays 0
during the switch, so the thread can come back; the child keeps the slot's uid and, at
its ``execve``, the saved uid becomes that uid too (no capability survives: bubblewrap
has no file capabilities). The first switch makes the worker's memory non-dumpable (the
kernel does that on any uid change), so no process of a slot's uid can ptrace it.

The uids: ``METNOS_SLOT_UIDS=BASE:COUNT`` (default ``1879048192:65536``, i.e.
``0x70000000`` up: above the ranges systemd gives to users, dynamic users and
containers, below 2^31), or ``off``; a worker refuses to start on anything else
(``E_CONFIG``, `slot_uid_range`), never serves with a typo as host root. A slot takes
the lowest uid of the range that no other worker holds (a lock file under
``/run/metnos-exec/uids``, held for the worker's life: two workers never share one), that
has no ``passwd`` or ``group`` entry, is none of the worker's own ids and runs no process;
its gid is the same number.

What the guest of a slot may touch on the host is then what that uid may: the read-only
system folders as any local user, and its own mounts. Those are root's files (the root
worker's user); to keep the owner rights the job had before, each one is mounted through
an *idmapped* mount that shows the worker's uid 0 as the slot's uid
(`metnos_exec.sandbox.mount_sources.StagedSources`; for a staged job, the lower layers of
its overlays, `metnos_exec.undo.overlay`), which needs the user namespace
`SlotIdentity.userns_fd` (uid 0 → the slot's uid, every other id but the slot's to
itself: `_id_map`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import grp
import os
import platform
import pwd
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, NamedTuple

from . import _libc
from .errors import BadConfig

__all__ = (
    "DEFAULT_SLOT_UIDS",
    "RUN_DIR",
    "SLOT_UIDS_ENV",
    "SlotIdentity",
    "allocate",
    "held_fds",
    "private_dir",
    "slot_uid_range",
    "slot_uids_unavailable",
    "switched",
)

SLOT_UIDS_ENV: Final = "METNOS_SLOT_UIDS"
DEFAULT_SLOT_UIDS: Final = (0x70000000, 65536)
#: Root-owned state of root workers: uid locks, staged mount points.
RUN_DIR: Final = "/run/metnos-exec"

# setgroups, setresuid, setresgid: numbered per architecture (not the new unified table).
_SYSCALLS: Final[dict[str, tuple[int, int, int]]] = {
    "x86_64": (116, 117, 119),
    "aarch64": (159, 147, 149),
}
_CLONE_NEWUSER: Final = 0x10000000
_uid_t = _gid_t = ctypes.c_uint


class _Switch(NamedTuple):
    """The raw, per-thread credential calls, typed (`metnos_exec._libc`: an untyped
    variadic ``syscall`` cut the group list's address to 32 bits)."""

    setgroups: Callable[..., int]  # (int size, const gid_t *list)
    setresuid: Callable[..., int]  # (uid_t ruid, uid_t euid, uid_t suid)
    setresgid: Callable[..., int]  # (gid_t rgid, gid_t egid, gid_t sgid)


def _switch_calls() -> _Switch | None:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    setgroups, setresuid, setresgid = numbers
    ids = (_uid_t, _uid_t, _uid_t)
    return _Switch(
        _libc.syscall(setgroups, ctypes.c_int, ctypes.POINTER(_gid_t)),
        _libc.syscall(setresuid, *ids),
        _libc.syscall(setresgid, *ids),
    )


_SWITCH: Final = _switch_calls()


#: The lowest slot uid: below are the system's own users (and uid 0, root).
_FIRST_SLOT_UID: Final = 1000
#: The highest: ``(uid_t) -1`` is no id, ``-2`` the last a user namespace may map.
_LAST_SLOT_UID: Final = 2**32 - 3
#: One number: decimal or ``0x`` hexadecimal, nothing else (no sign, no ``_``).
_NUMBER: Final = re.compile(r"0x[0-9a-f]+|[0-9]+")


def _number(text: str) -> int:
    return int(text, 16) if text.startswith("0x") else int(text, 10)


def slot_uid_range(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(base, count)`` from ``METNOS_SLOT_UIDS``, the default, or ``None`` for ``off``.

    Unset or empty is the default; ``off`` (any case) is the only way to turn them off.
    Anything else that is not ``BASE:COUNT`` within range is refused: a root worker that
    started on a typo would run every job as host root (issue 15).

    Raises:
        BadConfig: (``E_CONFIG``) the variable is neither ``off`` nor ``BASE:COUNT``,
            both numbers, COUNT at least 1, uids from 1000 (never root's 0) to 4294967293.
    """
    env = os.environ if environ is None else environ
    raw = env.get(SLOT_UIDS_ENV, "").strip().lower()
    if not raw:
        return DEFAULT_SLOT_UIDS
    if raw == "off":
        return None
    base_s, sep, count_s = raw.partition(":")
    if sep and _NUMBER.fullmatch(base_s) and _NUMBER.fullmatch(count_s):
        base, count = _number(base_s), _number(count_s)
        if base >= _FIRST_SLOT_UID and count >= 1 and base + count - 1 <= _LAST_SLOT_UID:
            return base, count
    raise BadConfig(
        f"{SLOT_UIDS_ENV}={raw!r} is not a range of slot uids; set it to BASE:COUNT (uids "
        f"BASE to BASE+COUNT-1, none below {_FIRST_SLOT_UID}, none past {_LAST_SLOT_UID}; "
        f"default {DEFAULT_SLOT_UIDS[0]}:{DEFAULT_SLOT_UIDS[1]}), or to 'off' to run a root "
        "worker's jobs as root"
    )


def slot_uids_unavailable(environ: Mapping[str, str] | None = None) -> str | None:
    """Why jobs of this worker cannot run as slot uids (``None``: they can).

    Raises:
        BadConfig: as `slot_uid_range`.
    """
    if os.geteuid() != 0:
        return "the worker is not root (its jobs run as its own uid)"
    if slot_uid_range(environ) is None:
        return f"{SLOT_UIDS_ENV}=off"
    if _SWITCH is None:
        return f"no per-thread credential switch for {platform.machine()} yet"
    return None


class SlotIdentity:
    """A slot's host uid and gid, held (its lock) until `close`.

    Attributes:
        uid: the slot's host uid.
        gid: the slot's host gid (the same number).
        userns_fd: a user namespace mapping uid and gid 0 to the slot's (`_id_map`):
            what idmapped mounts of root's folders for this slot are made with.
    """

    def __init__(self, uid: int, lock_fd: int, userns_fd: int) -> None:
        self.uid = uid
        self.gid = uid
        self.userns_fd = userns_fd
        self._lock_fd = lock_fd
        assert _SWITCH is not None  # `allocate` checked `slot_uids_unavailable`
        self._switch = _SWITCH
        _held.update((lock_fd, userns_fd))

    def close(self) -> None:
        for fd in (self.userns_fd, self._lock_fd):
            if fd >= 0:
                _held.discard(fd)
                os.close(fd)
        self.userns_fd = self._lock_fd = -1

    def __repr__(self) -> str:
        return f"SlotIdentity(uid={self.uid})"


#: fds the live identities hold (their lock, their user namespace) for the worker's life.
_held: set[int] = set()


def held_fds() -> frozenset[int]:
    """The fds slot identities keep open for as long as the worker lives (a test harness
    checking for leaked fds leaves these out)."""
    return frozenset(_held)


def _raw(call: Callable[..., int], *args: Any) -> None:
    if call(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def switched(identity: SlotIdentity) -> Iterator[None]:
    """The calling *thread* runs as `identity` inside the block (see the module doc), and
    comes back with exactly the ids it had: its uids, gids and supplementary groups (a
    worker started from a login or ``su``/``runuser`` session has some, and a primary gid
    that may not be 0).

    Raises:
        OSError: a switch failed; if coming back failed, the thread is left unusable
            (`RuntimeError`), never silently running as the slot's uid.
    """
    calls = identity._switch
    uids, gids = os.getresuid(), os.getresgid()  # this thread's own (kept per thread)
    groups = os.getgroups()
    _raw(calls.setgroups, 0, None)
    try:
        _raw(calls.setresgid, identity.gid, identity.gid, 0)
        try:
            _raw(calls.setresuid, identity.uid, identity.uid, uids[1])
        except BaseException:
            _raw(calls.setresgid, *gids)
            raise
    except BaseException:
        _restore_groups(calls, groups)
        raise
    try:
        yield
    finally:
        try:
            # uid first: back to euid 0 restores the effective capabilities the rest needs.
            _raw(calls.setresuid, *uids)
            _raw(calls.setresgid, *gids)
            _restore_groups(calls, groups)
        except OSError as exc:  # pragma: no cover - the kernel refusing root its own ids
            raise RuntimeError(f"cannot switch thread back to root: {exc}") from exc


def _restore_groups(calls: _Switch, groups: list[int]) -> None:
    arr = (_gid_t * len(groups))(*groups)
    _raw(calls.setgroups, len(groups), arr if groups else None)


# --- allocation ---------------------------------------------------------------------------

_alloc_lock = threading.Lock()


def _runs_processes(uid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    return True
    return False


def _known(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        pass
    else:
        return True
    try:
        grp.getgrgid(uid)
    except KeyError:
        return False
    return True


def private_dir(path: str, mode: int) -> None:
    """`path` as a root-owned real folder with `mode` (never through a symlink)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != 0:
        raise OSError(f"{path} is not a root-owned folder")
    os.chmod(path, mode)


#: The largest id a map may name: ``(uid_t) -1`` is no id.
_LAST_ID: Final = 2**32 - 2


def _id_map(uid: int) -> str:
    """The ``uid_map``/``gid_map`` of a slot's user namespace: 0 is `uid` on the host,
    every other id but `uid` is itself, and `uid` (as an id inside) is unmapped.

    Only 0 matters for permissions: the slot's processes are `uid` and nothing else, so
    through an idmapped mount they own what root owns, and are *others* for every other
    owner, whether that owner is mapped or not. The other ids are mapped so those files
    keep their owners through the mount: overlayfs copies a file up (a staged job of the
    slot writing it) with its owner as the lower layer shows it, and an unmapped owner
    makes the copy fail (``EOVERFLOW``), even for a file whose mode lets anyone write.
    Nothing maps to host root: a file the slot's uid creates through the mount is root's
    on disk, and no process of the slot can make one that is anybody else's.
    """
    lines = [f"0 {uid} 1"]
    if uid > 1:
        lines.append(f"1 1 {uid - 1}")
    if uid < _LAST_ID:
        lines.append(f"{uid + 1} {uid + 1} {_LAST_ID - uid}")
    return "\n".join(lines) + "\n"


def _userns(uid: int) -> int:
    """A user namespace mapping 0 to `uid` on the host (`_id_map`); its fd.

    A short-lived child unshares it and waits; we write its maps (as root we may map any
    id) and keep the namespace by fd after the child is gone.
    """
    child = subprocess.Popen(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            "import ctypes, sys\n"
            "unshare = ctypes.CDLL(None).unshare\n"
            "unshare.argtypes, unshare.restype = (ctypes.c_int,), ctypes.c_int\n"
            f"if unshare({_CLONE_NEWUSER}) != 0: sys.exit(1)\n"
            "sys.stdout.write('u'); sys.stdout.flush(); sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={},
        close_fds=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        if child.stdout.read(1) != b"u":
            raise OSError("the helper could not create a user namespace")
        mapping = _id_map(uid)
        for name, value in (("uid_map", mapping), ("setgroups", "deny"), ("gid_map", mapping)):
            with open(f"/proc/{child.pid}/{name}", "w") as f:
                f.write(value)
        return os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        if child.stdout is not None:
            child.stdout.close()
        child.kill()
        child.wait()


def allocate(environ: Mapping[str, str] | None = None) -> SlotIdentity:
    """Take the lowest free uid of the range for a slot of this worker.

    Raises:
        OSError: no free uid, or the host refused the lock folder or the namespace.
        BadConfig: as `slot_uid_range`.
    """
    reason = slot_uids_unavailable(environ)
    if reason is not None:
        raise OSError(reason)
    uid_range = slot_uid_range(environ)
    assert uid_range is not None
    base, count = uid_range
    # Never an id the worker itself holds (a gid of its session's groups, unnamed in
    # /etc/group, inside the range): the slot's gid would give the job that group.
    own = {*os.getresuid(), *os.getresgid(), *os.getgroups()}
    with _alloc_lock:
        private_dir(RUN_DIR, 0o711)
        private_dir(os.path.join(RUN_DIR, "uids"), 0o700)
        for uid in range(base, base + count):
            if uid in own:
                continue
            lock = os.open(
                os.path.join(RUN_DIR, "uids", f"{uid}.lock"),
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
            )
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock)
                continue  # another slot, of this worker or another, holds it
            if _known(uid) or _runs_processes(uid):
                os.close(lock)
                continue
            try:
                return SlotIdentity(uid, lock, _userns(uid))
            except BaseException:
                os.close(lock)
                raise
    raise OSError(f"no free slot uid in {base}..{base + count - 1} ({SLOT_UIDS_ENV})")
