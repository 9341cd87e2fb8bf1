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

#: How long the keeper goes on looking after its last find (see `main`).
GRACE_S = 1.0


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
    # Look again and again, until no look has found anything for GRACE_S: a monitor
    # killed mid-clone leaves a clone only the next look finds, and a child the worker
    # forked just before it died carries the mark only once it has exec'd bubblewrap
    # (its environment is given at exec), which a busy machine may delay. A single empty
    # look let that one through (seen: a bubblewrap left by a worker SIGKILLed as it
    # spawned). Bounded: what is killed cannot fork any more, and nothing is left to exec.
    now = time.monotonic()
    deadline, last_found = now + 10.0, now
    while (now := time.monotonic()) < deadline and now - last_found < GRACE_S:
        found = _marked(mark)
        if found:
            last_found = now
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)  # a look costs a read of every process's environment: pace them


if __name__ == "__main__":
    main()
