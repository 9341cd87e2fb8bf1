"""Run one job while a backend worker thread goes idle and exits; print what happened.

Usage: ``idle_thread.py BACKEND SECONDS [--no-reaper]``. Run in a fresh process so trio's
process-wide thread cache holds no thread from earlier tests. trio's idle timeout (10 s)
is shortened to 0.1 s, a worker thread is used once, and the job (``sleep SECONDS``) must
outlive that thread's exit. Prints one JSON line: ``{"returncode", "thread_exited"}``.
"""

from __future__ import annotations

import json
import sys
import threading

import anyio

from metnos_exec.process import ProcessSpec, run_process


def main(args: list[str]) -> None:
    backend, seconds, reaper = args[0], args[1], "--no-reaper" not in args
    from trio._core import _thread_cache

    _thread_cache.IDLE_TIMEOUT = 0.1
    report: dict[str, object] = {}

    async def run() -> None:
        async with anyio.create_task_group() as tg:

            async def job() -> None:
                spec = ProcessSpec(
                    argv=("sleep", seconds), env={"PATH": "/usr/bin:/bin"}, reaper=reaper
                )
                report["returncode"] = (await run_process(spec, timeout=60)).returncode

            tg.start_soon(job)
            worker = await anyio.to_thread.run_sync(threading.current_thread)
            with anyio.move_on_after(float(seconds) * 0.8):
                while worker.is_alive():  # noqa: ASYNC110 - no event exists for a thread's exit
                    await anyio.sleep(0.02)
            report["thread_exited"] = not worker.is_alive() and "returncode" not in report

    anyio.run(run, backend=backend)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
