"""What the live view costs a worker: jobs/s draining no-op jobs, the view polled or not.

Issue 20, acceptance 4 (the view's part): a real ``metnos-exec worker --burst`` (the echo
arm: no sandbox, so the queue and the supervisor are all there is to slow down) drains
``--jobs`` queued jobs from a fresh SQLite queue. In the *polled* arm a real
``metnos-exec web`` on the same queue has its JSON endpoint (``/api/overview``, what the
page fetches) polled every ``--interval`` seconds, as an open browser tab does; in the
*quiet* arm no view runs. The arms alternate in every round, their order swapped each
round so that a drift of the machine falls on both. Jobs/s is read from the worker's own
log (its ``job.finished`` records, first to last), so the bench adds no reader of its own.
Reported: the medians and the cost, ``1 - polled / quiet`` (the target: at most 3 %).

Usage: python bench/web_cost.py [--jobs N] [--rounds R] [--interval S]
       (a smoke: --jobs 300 --rounds 1)
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from metnos_exec.brokers.sqlite import SQLiteBroker  # noqa: E402
from metnos_exec.logs import iter_records  # noqa: E402
from metnos_exec.messages import Job  # noqa: E402

MANIFEST = 'name = "noop"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'


async def _fill(db: Path, jobs: int) -> None:
    async with SQLiteBroker(db) as broker:
        for start in range(0, jobs, 1000):
            await broker.submit_many([Job(executor="noop") for _ in range(min(1000, jobs - start))])


def _env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HOME": str(tmp / "home"),
        "METNOS_RETENTION_DAYS": "never",
    }


def _start_view(tmp: Path, url: str, tag: str) -> tuple[subprocess.Popen[bytes], str]:
    err = tmp / f"{tag}.web.err"
    with open(err, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "metnos_exec", "web", "--broker", url, "--bind",
             "127.0.0.1:0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=out, env=_env(tmp),
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while b"serving on " not in err.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the view did not start: {err.read_text()}")
        time.sleep(0.02)
    base = err.read_text().split("serving on ", 1)[1].split()[0].rstrip("/")
    return proc, base


def _poll(base: str, interval: float, stop: threading.Event, count: list[int]) -> None:
    while not stop.is_set():
        with urllib.request.urlopen(f"{base}/api/overview", timeout=10) as r:
            r.read()
        count[0] += 1
        stop.wait(interval)


def _jobs_per_s(log: Path) -> float:
    stamps = [
        datetime.datetime.fromisoformat(rec["ts"].replace("Z", "+00:00")).timestamp()
        for rec in iter_records(log, event="job.finished")
    ]
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        raise SystemExit(f"too few finished jobs in {log} to time")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _drain(tmp: Path, jobs: int, polled: bool, interval: float, tag: str) -> tuple[float, int]:
    db = tmp / f"{tag}.db"
    anyio.run(_fill, db, jobs)
    url = f"sqlite:///{db}"
    view = None
    stop = threading.Event()
    polls = [0]
    poller = None
    if polled:
        view, base = _start_view(tmp, url, tag)
        poller = threading.Thread(target=_poll, args=(base, interval, stop, polls), daemon=True)
        poller.start()
    log = tmp / f"{tag}.jsonl"
    try:
        worker = subprocess.run(
            [sys.executable, "-m", "metnos_exec", "worker", "--broker", url, "--executors",
             str(tmp / "executors"), "--log-file", str(log), "--arm", "echo", "--burst"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=_env(tmp), timeout=900,
        )  # fmt: skip
        if worker.returncode != 0:
            raise SystemExit(f"the worker failed ({worker.returncode}); see {log}")
    finally:
        stop.set()
        if poller is not None:
            poller.join(15)
        if view is not None:
            view.send_signal(signal.SIGTERM)
            view.wait(30)
    return _jobs_per_s(log), polls[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=5000, help="jobs drained per arm and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    ns = ap.parse_args(argv)
    quiet: list[float] = []
    polled: list[float] = []
    polls_total = 0
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        (tmp / "executors" / "noop").mkdir(parents=True)
        (tmp / "executors" / "noop" / "manifest.toml").write_text(MANIFEST)
        (tmp / "executors" / "noop" / "main.py").write_text("")
        (tmp / "home").mkdir()
        for r in range(ns.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for on in order:
                rate, polls = _drain(tmp, ns.jobs, on, ns.interval, f"r{r}-{int(on)}")
                (polled if on else quiet).append(rate)
                polls_total += polls
    q, p = statistics.median(quiet), statistics.median(polled)
    print(f"worker draining {ns.jobs} no-op jobs (echo arm, SQLite), median of {ns.rounds}")

    def rounds(xs: list[float]) -> str:
        return ", ".join(f"{x:.0f}" for x in xs)

    print(f"  quiet (no view):             {q:8.1f} jobs/s  rounds: {rounds(quiet)}")
    print(f"  view polled every {ns.interval:g} s:     {p:8.1f} jobs/s  rounds: {rounds(polled)}")
    print(f"  polls answered: {polls_total}")
    print(f"  cost: {(1 - p / q) * 100:+.1f} % (target: at most 3 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
