"""Starting a wasm job's guest process: a fresh one, or a spare handed its job.

Private to the wasm arm (`metnos_exec.sandbox.wasm`, whose docstring states the walls).
A fresh process (`run_fresh`) is ``python -I -S _wasm_child.py``, started by `run_process`
with the request line and the guest's stdin on its stdin and the preopen descriptors
passed to it. A spare (`start_spare`) is the same script started ahead with ``--spare``,
waiting on a socket for exactly one job; `hand_to_spare` sends it the request and the
preopen descriptors (``SCM_RIGHTS``) and waits for its process to end. Either way the
process is killed `KILL_AFTER_S` past the job's wall deadline at the latest, and reaped
before what it wrote on its result pipe is read (`Ran`).

The preopens are opened here, by `_open_preopen`, without following a symlink anywhere
on the way; the guest's process preopens those very folders through ``/proc/self/fd/N``.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, final

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import msgspec

from ..errors import HostFault, SandboxDenied, SymlinkedFolder
from ..logs import get_logger
from ..process import ProcessResult, ProcessSpec, Stopped, run_process
from . import _wasm_child, _wasm_engine, _wasm_guest
from ._types import Mount
from ._wasm_engine import _refuse_oversized
from .mount_sources import open_source

_log = get_logger()

#: Seconds past its wall deadline after which the arm kills the guest's process itself.
#: The process's own watchdog ends it `WATCHDOG_SLACK_S` past the deadline (a compile or
#: a guest blocked in a host call: no epoch check stops those); this is the backstop.
KILL_AFTER_S: Final = 2.0
_CHILD_PATH: Final = str(Path(_wasm_child.__file__).resolve())
#: Descriptors the guest's process needs beside the guest's own files (the interpreter,
#: wasmtime's module images and I/O runtime, the pipes): added to `limits.open_files`.
_PROCESS_FDS = 32
#: The stdout and stderr a spare keeps (its process is started before its job's
#: `limits.output_bytes` is known): a job asking for more is served by a fresh process,
#: one asking for less has its output cut to its own bound here.
SPARE_OUTPUT_BYTES: Final = 1024 * 1024
#: The spare's `run_process` budget: none of its own (it waits for a job for as long as
#: the pool lives); the job that takes it sets the kill deadline on the spare's scope.
_SPARE_WAIT_S: Final = 10.0**9

_keys_lock = threading.Lock()
#: (path, size, mtime_ns, inode) -> cache key: hashing python.wasm (26 MB) costs ~15 ms.
_keys: dict[tuple[str, int, int, int], str] = {}
#: cache key -> why the module was refused (a refusal is the module's, the same each time).
_denied: dict[str, str] = {}


def module_key(source: Path, version: str) -> str:
    """The disk-cache key of `source` (see `_wasm_guest.cache_key`), memoized per file
    identity. Refuses a file over `MAX_MODULE_BYTES` from its size, before reading it."""
    try:
        st = source.stat()
    except OSError as exc:
        raise HostFault(f"wasm module {source}: cannot stat: {exc.strerror}") from exc
    _refuse_oversized(source, st.st_size)
    ident = (str(source), st.st_size, st.st_mtime_ns, st.st_ino)
    with _keys_lock:
        key = _keys.get(ident)
    if key is not None:
        return key
    try:
        with source.open("rb") as f:
            data = f.read(_wasm_engine.MAX_MODULE_BYTES + 1)
    except OSError as exc:
        raise HostFault(f"wasm module {source}: cannot read: {exc.strerror}") from exc
    _refuse_oversized(source, len(data))
    key = _wasm_guest.cache_key(data, version)
    with _keys_lock:
        _keys[ident] = key
    return key


def known_refusal(key: str) -> str | None:
    """Why the module keyed `key` was refused by an earlier job's process, if it was."""
    with _keys_lock:
        return _denied.get(key)


def process_rlimits(open_files: int | None) -> tuple[tuple[int, int, int], ...]:
    """The rlimits of a job's guest's process: no core file and, for a job with
    `open_files`, an RLIMIT_NOFILE of that plus `_PROCESS_FDS`."""
    rlimits: list[tuple[int, int, int]] = [(resource.RLIMIT_CORE, 0, 0)]
    if open_files is not None:
        # Never above the worker's own hard limit: the process could not set it.
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nofile = open_files + _PROCESS_FDS
        if hard != resource.RLIM_INFINITY:
            nofile = min(nofile, hard)
        rlimits.append((resource.RLIMIT_NOFILE, nofile, nofile))
    return tuple(rlimits)


@dataclass
class Ran:
    """What the guest's process left: its verdict line (or None), whether it had loaded
    its module, and how the process ended."""

    verdict: dict[str, Any] | None
    loaded: bool
    process: ProcessResult


def _ran_from(data: bytes, proc: ProcessResult, key: str) -> Ran:
    """What the guest's process wrote on its result pipe, read."""
    lines = data.split(b"\n")
    loaded = b"L" in lines
    verdict: dict[str, Any] | None = None
    for line in lines:
        if line.startswith(b"{"):
            try:
                verdict = json.loads(line)
            except ValueError as exc:
                raise HostFault(
                    f"wasm arm: unreadable verdict from the guest's process: {exc}"
                ) from None
    if verdict is not None and "denied" in verdict:
        with _keys_lock:
            _denied[key] = str(verdict["denied"])
    return Ran(verdict, loaded, proc)


# --- a fresh process ----------------------------------------------------------------------


async def run_fresh(
    job: dict[str, Any],
    wasmtime_path: str,
    *,
    mounts: tuple[Mount, ...],
    stdin: bytes,
    rlimits: tuple[tuple[int, int, int], ...],
    output_bytes: int,
) -> Ran:
    """Run `job` (the request, its module named, its ``deadline`` set) in a process of
    its own, started now, and wait for it (killed at the deadline plus `KILL_AFTER_S` at
    the latest, or at once when the caller is cancelled)."""
    deadline = float(job["deadline"])
    fds: list[int] = []
    result_r, result_w = os.pipe2(os.O_CLOEXEC)
    try:
        for m in mounts:
            fds.append(_open_preopen(m.host))
        request = {
            **job,
            "result_fd": result_w,
            "preopens": [
                [fd, "/" + m.guest.strip("/"), m.writable]
                for fd, m in zip(fds, mounts, strict=True)
            ],
        }
        spec = ProcessSpec(
            argv=(sys.executable, "-I", "-S", _CHILD_PATH, wasmtime_path),
            env={},
            stdin=json.dumps(request).encode() + b"\n" + stdin,
            rlimits=rlimits,
            pass_fds=(result_w, *fds),
            pdeathsig=True,
            output_bytes=output_bytes,
            reaper=False,
        )
        budget = max(deadline - time.monotonic(), 0.001) + KILL_AFTER_S
        proc = await run_process(spec, timeout=budget, grace=0.1)
    finally:
        for fd in (*fds, result_w):
            os.close(fd)
        # The process is reaped (or was never started): what it wrote is all there.
        data = _read_all(result_r)
        os.close(result_r)
    return _ran_from(data, proc, str(job["key"]))


# --- spares -------------------------------------------------------------------------------


@dataclass(eq=False)
class Spare:
    """One spare guest process of the pool: started, waiting for exactly one job."""

    key: str | None
    sock: socket.socket
    result_r: int
    scope: anyio.CancelScope
    stopped: Stopped
    spawned: anyio.Event
    handed: anyio.Event
    done: anyio.Event
    result: ProcessResult | None = None
    error: BaseException | None = None
    taken: bool = False
    pid: int | None = None


@final
class SparePool:
    """`spare_processes`' state: the spares ready for a job, owned by its task group
    (`closed` once that context has exited)."""

    def __init__(self, tg: anyio.abc.TaskGroup, count: int, env: Mapping[str, str] | None) -> None:
        self.tg = tg
        self.count = count
        self.env = env
        self.token = anyio.lowlevel.current_token()
        self.ready: list[Spare] = []
        self.wanted = anyio.Event()
        self.broken: str | None = None
        self.served = 0
        self.in_use: set[Spare] = set()
        self.closed = False

    def take(self) -> Spare | None:
        if self.broken is not None or anyio.lowlevel.current_token() != self.token:
            return None  # another event loop (a test's anyio.run): not this pool's jobs
        while self.ready:
            spare = self.ready.pop(0)
            if not spare.done.is_set():
                spare.taken = True
                self.in_use.add(spare)
                self.served += 1
                self.wanted.set()
                return spare
        return None


async def start_spare(
    pool: SparePool, cache_dir: Path, wasmtime_path: str, key: str | None
) -> Spare:
    """Start one spare of `pool` (loading the module keyed `key` ahead, from `cache_dir`)
    and return it once its process is spawned, its ends of the socket and result pipe
    closed here.

    Raises:
        HostFault: the process ended before it was spawned.
    """
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    result_r, result_w = os.pipe2(os.O_CLOEXEC)
    spare = Spare(
        key=key,
        sock=parent,
        result_r=result_r,
        scope=anyio.CancelScope(),
        stopped=Stopped(),
        spawned=anyio.Event(),
        handed=anyio.Event(),
        done=anyio.Event(),
    )
    start = {
        "key": key,
        "cache_dir": str(cache_dir),
        "sock_fd": child.fileno(),
        "result_fd": result_w,
    }

    ends = [True]

    def close_child_ends() -> None:
        if ends.pop():
            child.close()
            os.close(result_w)
        ends.append(False)

    async def wait_for_job(pid: int, _members: object) -> None:
        # The child holds its ends now: ours are closed, so a dead spare reads as EOF
        # and a write to it as EPIPE, never a hang.
        close_child_ends()
        spare.pid = pid
        spare.spawned.set()
        await spare.handed.wait()

    spec = ProcessSpec(
        argv=(
            sys.executable,
            "-I",
            "-S",
            _CHILD_PATH,
            wasmtime_path,
            "--spare",
            json.dumps(start),
        ),
        env={},
        rlimits=((resource.RLIMIT_CORE, 0, 0),),
        pass_fds=(child.fileno(), result_w),
        pdeathsig=True,
        output_bytes=SPARE_OUTPUT_BYTES,
        reaper=False,
        on_spawn=wait_for_job,
    )
    pool.tg.start_soon(_serve, pool, spare, spec, close_child_ends)
    await spare.spawned.wait()
    if spare.done.is_set():
        raise HostFault(f"wasm arm: a spare process did not start: {spare.error}")
    return spare


async def _serve(
    pool: SparePool, spare: Spare, spec: ProcessSpec, close_child_ends: Callable[[], None]
) -> None:
    """The spare's process, from its start to its reaping (in the pool's task group)."""
    try:
        with spare.scope:
            spare.result = await run_process(
                spec, timeout=_SPARE_WAIT_S, grace=0.1, stopped=spare.stopped
            )
    except Exception as exc:  # said to the job that took it (a host fault)
        spare.error = exc
    finally:
        close_child_ends()
        pool.in_use.discard(spare)
        spare.done.set()
        spare.spawned.set()
        if not spare.taken:
            spare.sock.close()
            os.close(spare.result_r)
            if not pool.closed and pool.broken is None:
                # Ended before any job (its start-up failed): not started again and
                # again; jobs start their own processes, which say why.
                pool.broken = "a spare process ended before its job"
                _log.warning(
                    "sandbox.spare_failed",
                    arm="wasm",
                    error=f"{pool.broken}: {spare.error or spare.result}",
                )
            pool.wanted.set()


async def hand_to_spare(
    spare: Spare,
    job: dict[str, Any],
    *,
    mounts: tuple[Mount, ...],
    stdin: bytes,
    rlimits: tuple[tuple[int, int, int], ...],
    output_bytes: int,
) -> Ran:
    """Give `job` (the request, its module named, its ``deadline`` set) to `spare` and
    wait for its process to end (killed at the deadline plus `KILL_AFTER_S` at the
    latest, or at once when the caller is cancelled)."""
    deadline = float(job["deadline"])
    nofile = next((soft for res, soft, _ in rlimits if res == resource.RLIMIT_NOFILE), None)
    fds: list[int] = []
    try:
        # The kill deadline holds from here, the hand-off included.
        # (In the event loop's clock: trio's is offset from time.monotonic.)
        spare.scope.deadline = anyio.current_time() + (deadline + KILL_AFTER_S - time.monotonic())
        try:
            for m in mounts:
                fds.append(_open_preopen(m.host))
            head = {
                **job,
                "nofile": nofile,
                "mounts": [["/" + m.guest.strip("/"), m.writable] for m in mounts],
            }
            data = json.dumps(head).encode() + b"\n" + stdin
            await anyio.to_thread.run_sync(_send_job, spare.sock, fds, data, deadline)
        finally:
            for fd in fds:
                os.close(fd)  # the spare holds its own copies
        spare.handed.set()
        await spare.done.wait()
    except BaseException:
        # Cancelled (or the hand-off failed): the spare's process is killed and
        # reaped before this goes on.
        with anyio.CancelScope(shield=True):
            spare.scope.cancel()
            spare.handed.set()
            await spare.done.wait()
        raise
    finally:
        spare.sock.close()
        result = _read_all(spare.result_r)
        os.close(spare.result_r)
    return _ran_from(result, _spare_result(spare, output_bytes), str(job["key"]))


def _spare_result(spare: Spare, output_bytes: int) -> ProcessResult:
    """How the spare's process ended, its output cut to the job's own bound."""
    if spare.error is not None:
        raise spare.error
    proc = spare.result
    if proc is None:
        # The kill deadline passed: `run_process` killed and reaped it (what it had
        # written is in `stopped`), which is its timeout.
        if spare.stopped.result is None or not spare.scope.cancelled_caught:
            raise HostFault(
                "wasm arm: the spare process was stopped before its job ended (the "
                "spare pool closed)"
            )
        proc = msgspec.structs.replace(spare.stopped.result, timed_out=True)
    if len(proc.stdout) > output_bytes or len(proc.stderr) > output_bytes:
        proc = msgspec.structs.replace(
            proc,
            stdout=proc.stdout[:output_bytes],
            stderr=proc.stderr[:output_bytes],
            stdout_truncated=proc.stdout_truncated or len(proc.stdout) > output_bytes,
            stderr_truncated=proc.stderr_truncated or len(proc.stderr) > output_bytes,
        )
    return proc


def _send_job(sock: socket.socket, fds: list[int], data: bytes, deadline: float) -> None:
    """Hand a spare its job: one byte with the preopen descriptors, then `data`, then end
    of stream (on a worker thread; bounded by the job's deadline plus `KILL_AFTER_S`).

    Raises:
        HostFault: the spare is gone or does not read (the job is not run twice: its
            process is killed and the job fails as a host fault, retried elsewhere).
    """
    try:
        sock.settimeout(max(deadline + KILL_AFTER_S - time.monotonic(), 0.001))
        socket.send_fds(sock, [b"J"], fds)
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError as exc:
        raise HostFault(f"wasm arm: cannot hand the job to its spare process: {exc}") from exc


# --- what both read and open --------------------------------------------------------------


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _open_preopen(host: str) -> int:
    """Open the folder `host` for a preopen without following a symlink on the way.

    Returns:
        An ``O_PATH`` fd of the folder (``O_CLOEXEC``, the caller closes it), checked to
        be what ``/proc/self/fd/<fd>`` shows: the path wasmtime is given.

    Raises:
        SymlinkedFolder: a component of `host` is a symlink (the bwrap arm's refusal).
        SandboxDenied: `host` is not an existing folder this worker may reach.
        HostFault: the kernel refused for another reason, or ``/proc`` is not this
            process's procfs.
    """
    try:
        fd = open_source(host)
    except SymlinkedFolder:
        raise
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        raise SandboxDenied(
            f"mount {host!r}: the wasm arm can preopen existing directories only"
        ) from None
    except OSError as exc:
        raise HostFault(f"cannot open mount source {host}: {exc}") from exc
    try:
        opened = os.fstat(fd)
        if not stat.S_ISDIR(opened.st_mode):
            raise SandboxDenied(
                f"mount {host!r}: the wasm arm can preopen existing directories only"
            )
        try:
            shown = os.stat(f"/proc/self/fd/{fd}")
        except OSError as exc:
            raise HostFault(f"wasm arm: /proc/self/fd is not usable here: {exc}") from exc
        if (shown.st_dev, shown.st_ino) != (opened.st_dev, opened.st_ino):
            raise HostFault(
                f"wasm arm: /proc/self/fd/{fd} does not show the folder opened for {host}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd
