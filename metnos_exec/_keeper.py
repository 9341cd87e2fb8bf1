"""The worker's keeper: kills what the worker started when the worker dies, however.

Run as ``python -I -S _keeper.py FD MARK`` (standard library only; executed as a file,
never imported) by `metnos_exec.process.start_keeper`, once per worker process, in a
session of its own and deaf to SIGINT, SIGTERM and SIGHUP. FD is the read end of a pipe
whose only write end the worker holds: records of 5 bytes, ``+`` or ``-`` and a pid
(little-endian u32), tell it which process groups the worker's children lead (each job's
process is started in a new session: its group is its pid) and which are gone. MARK
(``NAME=VALUE``) is in the environment of every bubblewrap the worker starts
(`ProcessSpec.keeper_mark`), and so of the sandbox process each one clones. End of file
means the worker is gone (exited, or SIGKILLed): every recorded group is SIGKILLed, and
every process carrying MARK, until none is left; then the keeper exits.

Why (issue 8's follow-up): bubblewrap arms its parent-death signal late, its monitor only
after it has cloned the sandbox, and the sandbox only once its set-up is done. A worker
killed before that left a bubblewrap behind, stuck forever waiting for its dead monitor,
or a sandbox that went on to run its guest with nobody to stop it. The mark finds one the
worker had not registered yet (killed between bubblewrap's exec and the record); a guest
dies with its sandbox's init (the pid namespace).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time


def _marked(mark: bytes) -> list[int]:
    found: list[int] = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
            if mark in f.read().split(b"\0"):
                found.append(int(entry))
    return found


def main() -> None:
    fd = int(sys.argv[1])
    mark = sys.argv[2].encode()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    buf = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 5:
            op, pid = buf[0:1], int.from_bytes(buf[1:5], "little")
            buf = buf[5:]
            if op == b"+":
                groups.add(pid)
            else:
                groups.discard(pid)
    for pgid in groups:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    # A monitor killed mid-clone may leave a clone found only by the next look: look
    # again until one finds nothing (bounded: what is killed cannot clone any more).
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        found = _marked(mark)
        if not found:
            break
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)  # let the killed exit (and a last clone appear) before looking again


if __name__ == "__main__":
    main()
