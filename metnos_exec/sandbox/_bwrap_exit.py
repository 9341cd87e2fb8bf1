"""Reading back what happened in the bwrap arm: bubblewrap's JSON status documents, the
exit they mean (`map_exit`: the job's verdict, or `BwrapSetupFailed` when bubblewrap never
started the guest), and what the run used (`_usage`). The rules are the arm's module
documentation's (`metnos_exec.sandbox.bwrap`).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from ..errors import HostFault
from ..process import ProcessResult
from ._types import Failure, Killed, SandboxExit, SandboxJob, Success, Timeout, Trap, Usage

__all__ = ("BwrapSetupFailed", "map_exit", "parse_json_status")

_SIGNAL_BASE = 128
_MAX_SIGNAL = 64


class BwrapSetupFailed(HostFault):
    """bubblewrap could not build the sandbox (namespaces, mounts): no verdict on the job."""


def parse_json_status(blob: bytes) -> dict[str, Any]:
    """Merge the JSON documents bubblewrap wrote to ``--json-status-fd``.

    Raises:
        HostFault: the status stream is not what bubblewrap writes.
    """
    text = blob.decode("utf-8", errors="strict")
    decoder = json.JSONDecoder()
    merged: dict[str, Any] = {}
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return merged
        try:
            doc, pos = decoder.raw_decode(text, pos)
        except ValueError as exc:
            raise HostFault(f"unreadable bubblewrap status {text!r}: {exc}") from exc
        if not isinstance(doc, dict):
            raise HostFault(f"unexpected bubblewrap status document {doc!r}")
        merged.update(doc)


def _limit_for(sig: int, job: SandboxJob) -> str | None:
    if sig == signal.SIGXCPU and job.limits.cpu_time_s is not None:
        return "cpu_time"
    if sig == signal.SIGXFSZ and job.limits.file_size_bytes is not None:
        return "file_size"
    return None


def map_exit(job: SandboxJob, result: ProcessResult, status: dict[str, Any]) -> SandboxExit:
    """Turn what bubblewrap and the process layer saw into a `SandboxExit`.

    Only bubblewrap's own failure before the guest started is a host fault: once the
    guest runs, whatever bubblewrap reports is a verdict on the job (see the ``Trap``
    below for the one report a guest can forge).

    Raises:
        BwrapSetupFailed: bubblewrap exited without reporting a guest exit.
    """
    if result.timed_out:
        return Timeout()
    code = status.get("exit-code")
    if code is None:
        if result.returncode < 0:
            # bubblewrap itself was killed (SIGKILL from outside, or a limit that also
            # binds it), and with it the guest (it is the pid namespace's init).
            sig = -result.returncode
            return Killed(signal=sig, limit=_limit_for(sig, job))
        stderr = result.stderr.decode(errors="replace").strip()
        raise BwrapSetupFailed(
            f"bubblewrap could not set up the sandbox (exit status {result.returncode}, "
            f"no guest exit reported): {stderr[-500:] or 'no message'}"
        )
    if not isinstance(code, int) or not 0 <= code <= 255:
        # bubblewrap writes "exit-code" only once the guest was exec'd, from a value its
        # init hands the monitor over an eventfd the init keeps open (bwrap.c,
        # do_init/monitor_child). The seccomp filter refuses pidfd_getfd and ptrace, so
        # a guest cannot reach that eventfd; without the filter it can (pidfd_getfd on
        # pid 1, its own uid) and write any number. No process exit produces one
        # outside 0..255, so such a code is the guest's doing, a failure of its own,
        # never a host fault (which would be retried and blamed on the worker).
        return Trap(
            f"bubblewrap reported exit code {code!r}, which no process exit produces: the "
            "job tampered with bubblewrap's exit-status channel"
        )
    if code == 0:
        return Success()
    if _SIGNAL_BASE < code <= _SIGNAL_BASE + _MAX_SIGNAL:
        sig = code - _SIGNAL_BASE
        return Killed(signal=sig, limit=_limit_for(sig, job))
    return Failure(code=code)


def _usage(result: ProcessResult, init: Any | None) -> Usage:
    """What the run used, from the process layer's result and the init's rusage."""
    # bubblewrap's monitor reaps nothing of the guest: the guest's CPU time is in the
    # rusage of the init, which reaped it. A killed tree's processes are reaped by nobody
    # who counts them: what they had used was read just before the kill (`killed_cpu_s`,
    # their reaped children's included); the larger of the two lower bounds. Without
    # either (the init was not ours to reap, the run ended by itself) the CPU time is not
    # known, and not guessed.
    cpu = None if init is None else result.cpu_s + init.ru_utime + init.ru_stime
    if result.killed_cpu_s is not None:
        cpu = max(cpu or 0.0, result.killed_cpu_s)
    # The tree's peak as the memory cgroup counted it, when there is one; else the largest
    # single process the init reaped, or that was alive at the kill (a lower bound for a
    # tree). Never the monitor's own ru_maxrss: it execs out of the worker's memory, so it
    # reads the *worker's* high-water mark.
    peak = result.memory_peak_bytes
    if peak is None:
        single = [
            n
            for n in (
                None if init is None else init.ru_maxrss * 1024,
                result.killed_peak_rss_bytes,
            )
            if n
        ]
        peak = max(single) if single else None
    return Usage(wall_s=result.wall_s, cpu_s=cpu, peak_memory_bytes=peak)


def _drain(fd: int) -> bytes:
    # bubblewrap has exited and our copy of the write end is closed, so normally this hits
    # EOF at once. Non-blocking anyway: should any process still hold the write end, we
    # take what was written instead of hanging the worker.
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return b"".join(chunks)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
