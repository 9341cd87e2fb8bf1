"""Landlock in the bwrap arm: the sandbox's read and write roots, enforced a second time.

bubblewrap decides what the guest *sees* (its mounts); landlock decides, by path, what the
guest may *do* with it, in the kernel's LSM layer, independently of the mount flags and
of file modes. It cannot be applied before bubblewrap (a landlocked process may not
mount), so the guest's first process applies it to itself before the executor's code
runs: the arm wraps the job's argv (`wrap_argv`) so that the interpreter starts with the
small program in `._landlock_guest`, which restricts itself and then runs the executor's
script in the same interpreter (no second start; the only extra import is ``_ctypes``),
or ``exec``s any other command (the domain survives ``execve``).

Rules (guest paths; a path that does not exist in the sandbox is skipped, so it stays
denied; on a file only the file rights of a row apply). Each row: path, rights, why.

* ``/``: list. The sandbox root holds only mount points; listing it reveals nothing more.
* the system trees and the interpreter's roots (`flags.SYSTEM_PATHS`): read, execute. Run
  programs and libraries; never change them.
* ``/proc``: read. The guest's own processes; no writes at all (sysctls,
  ``/proc/self/mem``, ``/proc/self/attr``).
* ``/dev``: read, write, truncate, device ioctls. ``null``, ``zero``, ``urandom``, ``tty``,
  ``pts``.
* ``/dev/shm`` and ``/tmp``: read, write. Private scratch (POSIX shared memory, temporary
  files).
* read-only mounts (the executor folder, ``fs:read`` hints): read. No execute (an
  executor runs its scripts through the interpreter), except in the read-only mount that
  holds the job's own command (a standalone interpreter's prefix): read, execute.
* writable mounts (``fs:write`` hints): read, write. No execute, no sockets, no device
  nodes.

Rights: *read* = ``READ_FILE | READ_DIR``; *write* = ``WRITE_FILE | REMOVE_DIR | REMOVE_FILE |
MAKE_DIR | MAKE_REG | MAKE_SYM | MAKE_FIFO | REFER | TRUNCATE``; *execute* = ``EXECUTE``.
Every right the kernel knows is handled (denied unless a rule grants it), so
``MAKE_SOCK``, ``MAKE_CHAR`` and ``MAKE_BLOCK`` are denied everywhere. With ABI >= 6 the
domain is also scoped: no connecting to abstract Unix sockets and no signals outside the
job (bubblewrap's init included). Network rights (ABI >= 4) are not handled: the network
namespace is that wall.

Best effort across ABI versions, as the landlock documentation describes: the guest asks
the kernel's ABI and drops the rights it does not know (``REFER`` before ABI 2: renames
and links across folders are then refused; ``TRUNCATE`` before 3; device ioctls before 5;
scoping before 6).

Limits, stated plainly: landlock rights accumulate down a tree, so a read-only mount
below a writable one (or the executor folder below the private ``/tmp``) gets write
rights from its parent's rule; the read-only bind still refuses the write there. Rules
mirror guest paths, so landlock adds nothing where bubblewrap mounted the wrong thing at
the right path. Where the kernel has no landlock, the arm runs without it and says so.
Execute is checked at ``execve`` only, not at ``mmap``: a loader (``ld.so FILE``,
``dlopen``) maps a written file as code in the job's own process and domain. A file of an
internal mount (a memfd) is not judged at all: seccomp's row 24 keeps memfds
non-executable instead.
"""

from __future__ import annotations

import ctypes
import functools
import marshal
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from .. import _libc
from ._types import SandboxJob
from .flags import PYTHON_FLAGS, SYSTEM_PATHS, guest_python

__all__ = (
    "READ",
    "SCOPE",
    "SCRIPT_ENV",
    "STEP_ENV",
    "SYSTEM_PYTHON",
    "WRITE",
    "LandlockSupport",
    "compiled_script",
    "guest_program",
    "guest_source",
    "landlock_abi",
    "landlock_rules",
    "landlock_support",
    "wrap_argv",
)

# linux/landlock.h: LANDLOCK_ACCESS_FS_*.
EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5

READ = READ_FILE | READ_DIR
WRITE = (
    WRITE_FILE
    | REMOVE_DIR
    | REMOVE_FILE
    | MAKE_DIR
    | MAKE_REG
    | MAKE_SYM
    | MAKE_FIFO
    | REFER
    | TRUNCATE
)
DEVICES = READ | WRITE_FILE | TRUNCATE | IOCTL_DEV
#: What a rule on a single file may hold.
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
#: LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL (ABI 6).
SCOPE = 0b11

# landlock_create_ruleset(2): the same number on every architecture since Linux 5.13.
_SYS_LANDLOCK_CREATE_RULESET = 444
_LANDLOCK_CREATE_RULESET_VERSION = 1


def landlock_abi() -> tuple[int | None, str | None]:
    """The landlock ABI version (``landlock_create_ruleset(NULL, 0, VERSION)``).

    Returns:
        ``(abi, None)`` when supported, else ``(None, reason)``.
    """
    create_ruleset = _libc.syscall(
        _SYS_LANDLOCK_CREATE_RULESET, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32
    )
    abi = create_ruleset(None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 0:
        err = ctypes.get_errno()
        return None, f"landlock_create_ruleset: {os.strerror(err)}"
    return int(abi), None


class LandlockSupport(msgspec.Struct, frozen=True):
    """Whether, and how, the bwrap arm landlocks its guests here.

    Attributes:
        abi: the kernel's landlock ABI; ``None`` when landlock cannot be applied.
        python: the interpreter that runs the in-guest step (``None``: none usable).
        ctypes_path: its ``_ctypes`` extension when it is the worker's own interpreter
            (``""``: the step imports it).
        phrase: for reports: the ABI, or why landlock is not applied.
    """

    abi: int | None
    python: str | None
    ctypes_path: str
    phrase: str


#: Where the step's interpreter comes from when the worker's own is not reachable (an
#: unprivileged worker whose interpreter lives under a private home): any CPython >= 3.8
#: with ``_ctypes`` runs the step.
SYSTEM_PYTHON = "/usr/bin/python3"


@functools.cache
def landlock_support() -> LandlockSupport:
    """What this host offers for the in-guest step, decided once per process.

    The step runs in the worker's own base interpreter (`flags.guest_python`, the one
    ``python`` executors run in, so their script runs in the same process after it), or
    in `SYSTEM_PYTHON` when the worker cannot reach its own (bubblewrap, with the worker's
    identity, could not mount it either).
    """
    abi, error = landlock_abi()
    if abi is None:
        return LandlockSupport(None, None, "", f"landlock unavailable ({error})")
    own = guest_python()
    if os.access(own, os.X_OK):
        try:
            import _ctypes
        except ImportError as exc:  # pragma: no cover - an interpreter built without libffi
            return LandlockSupport(None, None, "", f"landlock not applied: no _ctypes ({exc})")
        return LandlockSupport(
            abi, own, str(getattr(_ctypes, "__file__", "")), f"landlock ABI {abi}"
        )
    if os.access(SYSTEM_PYTHON, os.X_OK):
        return LandlockSupport(abi, SYSTEM_PYTHON, "", f"landlock ABI {abi}")
    return LandlockSupport(
        None, None, "", "landlock not applied: no Python interpreter the sandbox can run"
    )


def landlock_rules(
    job: SandboxJob,
    *,
    interpreter_roots: Sequence[str],
    exists: Callable[[str], bool] = os.path.exists,
    readlink: Callable[[str], str | None] = lambda _path: None,
    isdir: Callable[[str], bool] = os.path.isdir,
) -> tuple[tuple[int, str], ...]:
    """The rules for `job`: ``(rights, guest path)`` pairs, as the module's table says.

    Args:
        job: the job; its mounts give the read and write roots.
        interpreter_roots: the interpreter's prefixes the arm mounts read-only.
        exists: host path check for the fixed system trees (the arm's cached one); the
            job's mounts are left to the guest, which skips what is not there.
        readlink: the arm's cached symlink check: a system tree that is a symlink
            (``/bin`` -> ``usr/bin``) needs no rule of its own (each rule is a few system
            calls in every job), its target's rule covers it.
        isdir: host folder check for the job's mounts: a mount of a single file gets only
            the rights a file can hold (the kernel refuses folder rights on a file). Not
            asked for a staged mount (an overlay, always a folder).
    """
    rules: dict[str, int] = {"/": READ_DIR}
    for path in (*SYSTEM_PATHS, *interpreter_roots):
        if exists(path) and readlink(path) is None:
            rules[path] = rules.get(path, 0) | READ | EXECUTE
    rules["/proc"] = READ
    rules["/dev"] = DEVICES
    rules["/dev/shm"] = READ | WRITE
    rules["/tmp"] = READ | WRITE
    command = os.path.normpath(job.argv[0]) if job.argv else ""
    for mount in job.mounts:
        guest = os.path.normpath(mount.guest)
        rights = READ | (WRITE if mount.writable else 0)
        if not mount.writable and (command + "/").startswith(guest.rstrip("/") + "/"):
            # The job's own command lives here (a standalone interpreter's prefix).
            rights |= EXECUTE
        # A staged mount is a staging overlay, always a folder, on the staging namespace's
        # side, where the worker cannot look.
        if not mount.staged and not isdir(mount.host):
            rights &= FILE_RIGHTS
        rules[guest] = rules.get(guest, 0) | rights
    return tuple((rights, path) for path, rights in rules.items())


@functools.cache
def guest_source() -> str:
    """The text of the in-guest step (`._landlock_guest`)."""
    return (Path(__file__).parent / "_landlock_guest.py").read_text(encoding="utf-8")


#: Environment variables that carry compiled code into the guest: the step itself, and
#: the executor's script. Not arguments: CPython decodes every argument through the locale
#: at start-up (~0.4 ms for the step's ~23 KB of hex), the environment it only copies. The
#: step removes both before the job runs.
STEP_ENV = "METNOS_LANDLOCK_STEP"
SCRIPT_ENV = "METNOS_LANDLOCK_SCRIPT"

#: The ``-c`` loader of the marshalled step (the collector waits: see the step).
_LOADER = (
    "import gc,marshal,posix;gc.disable();"
    f"exec(marshal.loads(bytes.fromhex(posix.environ[b'{STEP_ENV}'].decode())))"
)


@functools.cache
def _marshalled_step() -> str:
    code = compile(
        guest_source(), "<metnos-exec landlock step>", "exec", optimize=2, dont_inherit=True
    )
    return marshal.dumps(code).hex()


def guest_program(python: str | None = None) -> tuple[str, dict[str, str]]:
    """The in-guest step: the interpreter's ``-c`` program, and the environment it needs.

    For the worker's own interpreter (`flags.guest_python`, the default), the step's code
    compiled here and marshalled (`STEP_ENV`) behind a one-line loader: compiling its ~200
    lines would cost every job ~1 ms of CPU, unmarshalling a few tens of microseconds (the
    marshal format is the interpreter's own, hence only for the same one). For any other
    interpreter, the source.
    """
    if python is not None and python != guest_python():
        return guest_source(), {}
    return _LOADER, {STEP_ENV: _marshalled_step()}


#: A compiled script is passed only below this size (hex characters): one environment
#: string may hold 128 KiB (MAX_ARG_STRLEN); a bigger script is compiled in the guest.
MAX_COMPILED_HEX = 64 * 1024


@functools.lru_cache(maxsize=256)
def _compiled(path: str, _stamp: tuple[int, int, int, int]) -> str:
    """`path` compiled as ``python -I -S path`` would, marshalled, hex; ``""`` when the
    guest should compile it itself: unreadable, too big, or the compiler has something to
    say (a syntax error, a warning: the guest must say it, where the job's stderr is).

    Cached by the file's identity and modification (`_stamp`), so a changed script is
    compiled again.
    """
    try:
        with open(path, "rb") as f:
            source = f.read()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            code = compile(source, path, "exec", dont_inherit=True, optimize=0)
    except (OSError, SyntaxError, ValueError, Warning):
        return ""
    compiled = marshal.dumps(code).hex()
    return compiled if len(compiled) <= MAX_COMPILED_HEX else ""


def compiled_script(path: str) -> str:
    """`_compiled` for the script as it is now (one ``stat``)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return _compiled(path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def wrap_argv(
    argv: Sequence[str],
    rules: Sequence[tuple[int, str]],
    *,
    python: str,
    ctypes_path: str,
    scope: int = SCOPE,
) -> tuple[tuple[str, ...], dict[str, str]]:
    """`argv` behind the in-guest landlock step, and the environment the step needs.

    A job of the form ``(python, *PYTHON_FLAGS, script, *args)`` (what `plan` builds for
    a ``python`` executor; ``(python, "-I", "-S", script)`` too) runs its script in the
    same interpreter after the step, with the script's folder first on ``sys.path`` when
    the flags keep it there (as ``python -E -s -S script`` does), compiled
    here when `python` is the worker's own interpreter (`SCRIPT_ENV`: it saves the guest
    the compile); any other command is ``exec``ed by the step.

    Args:
        argv: the job's command.
        rules: `landlock_rules`.
        python: the interpreter that runs the step, as the guest sees it.
        ctypes_path: that interpreter's ``_ctypes`` extension (``""``: import it).
        scope: landlock scopes to request (ABI >= 6).

    Returns:
        ``(argv, env)``: the command bubblewrap execs, and variables to add to the job's
        environment (the step removes them).
    """
    program, env = guest_program(python)
    n = 0
    if argv and argv[0] == python:
        if tuple(argv[1 : 1 + len(PYTHON_FLAGS)]) == PYTHON_FLAGS:
            n = 1 + len(PYTHON_FLAGS)
        elif tuple(argv[1:3]) == ("-I", "-S"):
            n = 3
    run = n > 0 and len(argv) > n and not argv[n].startswith("-")
    if run and env:
        compiled = compiled_script(argv[n])
        if compiled:
            env = {**env, SCRIPT_ENV: compiled}
    # "run": ``-I`` keeps the script's folder off sys.path; "runpath": put it first.
    mode = ("runpath" if n != 3 else "run") if run else "exec"
    spec: list[str] = [mode, ctypes_path, str(scope)]
    for rights, path in rules:
        spec += [str(rights), path]
    target = tuple(argv[n:]) if run else tuple(argv)
    return (python, "-I", "-S", "-c", program, *spec, "--", *target), env
