"""Interruptible WASI sleeping: `poll_oneoff` and `clock_time_get` shadowed.

Epoch interruption only stops a guest while it runs wasm code. wasmtime's own
`poll_oneoff` blocks inside the host for as long as the guest asked (`time.sleep(10**6)`),
so neither the wall-clock deadline nor the caller's cancellation would reach it: a worker
thread and a job slot held hostage by one call.

This module shadows `poll_oneoff` in the arm's linker. Clock subscriptions are waited out
here, in slices of one epoch tick, asking the job's stop check between slices; when the
job must stop, the call returns `EINTR` and the guest's next wasm instruction meets the
epoch deadline callback, which ends it the ordinary way (no Python exception crosses the
engine). Absolute timeouts need the guest's clock to be one we can read, so
`clock_time_get` is shadowed too: realtime is the host's `time_ns()`, monotonic the host's
`monotonic_ns()`, and both CPU-time clocks the CPU time of the guest's thread since the
job started (never the worker process's, which would reveal other jobs' work).

File-descriptor subscriptions are answered "ready" at once. That is wasmtime's answer for
everything a guest here can hold (regular files in preopens, captured stdio); what is lost
is the `EBADF` event for an fd that does not exist (the host function can not reach
wasmtime's fd table). wasmtime's own implementations can not be called from here instead:
a WASI function called from the host finds no calling instance, hence no memory.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import wasmtime

__all__ = ("bind_stop_check", "install_poll_oneoff")

#: The stop check of the job running on this thread: returns why to stop, or None.
StopCheck = Callable[[], "str | None"]
_local = threading.local()

_SUB = 48  # sizeof(subscription_t)
_EVENT = 32  # sizeof(event_t)
_TAG_CLOCK = 0
_CLOCK_REALTIME, _CLOCK_MONOTONIC, _CLOCK_PROCESS_CPU, _CLOCK_THREAD_CPU = 0, 1, 2, 3
_ABSTIME = 1
_ERRNO_SUCCESS, _ERRNO_FAULT, _ERRNO_INTR, _ERRNO_INVAL, _ERRNO_NOTSUP = 0, 21, 27, 28, 58
_SLICE_S = 0.01


def bind_stop_check(check: StopCheck | None) -> None:
    """Bind (or with None, unbind) the job running on the calling thread: its stop check,
    and the thread's CPU time at its start (worker threads are reused, so the guest's CPU
    clocks count from its own start, revealing nothing of earlier jobs)."""
    _local.check = check
    _local.cpu_base = time.thread_time_ns()


def _now(clock_id: int) -> int | None:
    if clock_id == _CLOCK_REALTIME:
        return time.time_ns()
    if clock_id == _CLOCK_MONOTONIC:
        return time.monotonic_ns()
    if clock_id in (_CLOCK_PROCESS_CPU, _CLOCK_THREAD_CPU):
        return time.thread_time_ns() - int(getattr(_local, "cpu_base", 0))
    return None


def install_poll_oneoff(wt: ModuleType, linker: wasmtime.Linker, wasi_module: str) -> None:
    """Shadow `poll_oneoff` and `clock_time_get` in `linker` (after `define_wasi()`)."""
    i32, i64 = wt.ValType.i32(), wt.ValType.i64()

    def clock_time_get(caller: Any, clock_id: int, _precision: int, out_ptr: int) -> int:
        now = _now(clock_id)
        if now is None:
            return _ERRNO_INVAL
        memory = caller.get("memory")
        if not isinstance(memory, wt.Memory):
            return _ERRNO_FAULT
        try:
            memory.write(caller, struct.pack("<Q", now), out_ptr)
        except IndexError:
            return _ERRNO_FAULT
        return _ERRNO_SUCCESS

    def poll_oneoff(caller: Any, in_ptr: int, out_ptr: int, nsubs: int, nevents_ptr: int) -> int:
        if nsubs == 0:
            return _ERRNO_INVAL
        memory = caller.get("memory")
        if not isinstance(memory, wt.Memory):
            return _ERRNO_FAULT
        raw = bytes(memory.read(caller, in_ptr, in_ptr + nsubs * _SUB))
        if len(raw) != nsubs * _SUB or in_ptr < 0:
            return _ERRNO_FAULT
        events, clocks = _subscriptions(raw, nsubs)
        if not events and clocks and not _sleep_until(min(d for _, d in clocks)):
            return _ERRNO_INTR
        now = time.monotonic_ns()
        events += [(u, _ERRNO_SUCCESS, _TAG_CLOCK) for u, d in clocks if d <= now]
        out = b"".join(struct.pack("<QHB5xQH6x", u, e, t, 0, 0) for u, e, t in events)
        try:
            if out:
                memory.write(caller, out, out_ptr)
            memory.write(caller, struct.pack("<I", len(events)), nevents_ptr)
        except IndexError:
            return _ERRNO_FAULT
        return _ERRNO_SUCCESS

    linker.allow_shadowing = True
    linker.define_func(
        wasi_module,
        "poll_oneoff",
        wt.FuncType([i32, i32, i32, i32], [i32]),
        poll_oneoff,
        access_caller=True,
    )
    linker.define_func(
        wasi_module,
        "clock_time_get",
        wt.FuncType([i32, i64, i32], [i32]),
        clock_time_get,
        access_caller=True,
    )
    linker.allow_shadowing = False


def _subscriptions(
    raw: bytes, nsubs: int
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """The `nsubs` subscriptions in `raw`: the events answered at once (userdata, errno,
    type) and the clocks to wait for (userdata, host monotonic deadline)."""
    events: list[tuple[int, int, int]] = []  # (userdata, errno, type)
    clocks: list[tuple[int, int]] = []  # (userdata, host monotonic deadline)
    start = time.monotonic_ns()
    for k in range(nsubs):
        off = k * _SUB
        userdata, tag = struct.unpack_from("<QB", raw, off)
        if tag != _TAG_CLOCK:
            # fd_read / fd_write: always ready here (see the module docstring).
            events.append((userdata, _ERRNO_SUCCESS, tag))
            continue
        clock_id, timeout, _precision, flags = struct.unpack_from("<I4xQQH", raw, off + 16)
        now = _now(clock_id)
        if now is None:
            events.append((userdata, _ERRNO_INVAL, tag))
            continue
        remaining = timeout - now if flags & _ABSTIME else timeout
        if clock_id in (_CLOCK_PROCESS_CPU, _CLOCK_THREAD_CPU):
            # A sleeping thread burns no CPU time: such a wait would never end.
            events.append((userdata, _ERRNO_NOTSUP, tag))
            continue
        clocks.append((userdata, start + max(0, remaining)))
    return events, clocks


def _sleep_until(first: int) -> bool:
    """Wait until the host monotonic time `first` in slices, asking the job's stop check
    between them: False when the job must stop first."""
    check: StopCheck | None = getattr(_local, "check", None)
    while True:
        if check is not None and check() is not None:
            return False
        left = first - time.monotonic_ns()
        if left <= 0:
            return True
        time.sleep(min(left / 1e9, _SLICE_S))
