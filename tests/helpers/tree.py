"""A job that leaves a process tree behind, for tree-kill and die-with-parent tests.

Usage: ``tree.py DIR [SECONDS]``. Writes ``DIR/job.pid``, then double-forks a grandchild
that calls ``setsid`` (leaving the job's process group and session, the classic daemon
escape) and writes ``DIR/grandchild.pid``; both then sleep SECONDS (default 100). A job
stops only by being killed. Pid files are written atomically (rename), so a reader that
sees one sees a whole pid.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _write(directory: str, name: str, pid: int) -> None:
    tmp = os.path.join(directory, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.rename(tmp, os.path.join(directory, name))


def main() -> None:
    directory = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 100.0
    # A job that handles SIGTERM like a polite program: record that it was asked.
    signal.signal(
        signal.SIGTERM, lambda *_: (_write(directory, "job.term", os.getpid()), os._exit(0))
    )
    middle = os.fork()
    if middle == 0:
        if os.fork() == 0:
            os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _write(directory, "grandchild.pid", os.getpid())
            time.sleep(seconds)
        os._exit(0)
    os.waitpid(middle, 0)
    _write(directory, "job.pid", os.getpid())
    time.sleep(seconds)


if __name__ == "__main__":
    main()
