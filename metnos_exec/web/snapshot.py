"""What the live view shows, read from a broker: one `overview` of the queue (the page's
and ``top``'s), one job's `detail`. Plain JSON-ready dicts: the page renders them with
``textContent``, ``top`` through `metnos_exec._terminal.visible`; nothing here escapes,
because what is safe depends on where the text lands.

Elapsed time of a running job: no broker stores when a lease was taken, so `RunningClock`
counts from the first overview that saw the delivery running (``since_seen`` true while
the job was already running when the view started: the time shown is a lower bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

import msgspec

from ..brokers import Broker
from ..brokers.presence import JobListing, WorkerInfo, is_live, unserved
from ..messages import Result

__all__ = ("RECENT", "RunningClock", "detail", "overview", "walls")

#: Finished jobs the overview lists (each costs one result read per refresh).
RECENT: Final = 20
#: Queued and running jobs the overview lists.
LISTED: Final = 50
#: Dead letters the overview lists.
DEAD: Final = 20


class RunningClock:
    """When this view first saw each delivery (job id, attempt) running."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._first: dict[tuple[str, int], float] = {}
        self._started = clock()
        self._rounds = 0

    def elapsed(self, running: list[JobListing]) -> dict[str, tuple[float, bool]]:
        """Seconds each running job has been seen running, and whether that is a lower
        bound (it was running before this view's first look)."""
        now = self._clock()
        first_round = self._rounds == 0
        self._rounds += 1
        live = {(j.job_id, j.attempt) for j in running}
        self._first = {k: v for k, v in self._first.items() if k in live}
        out = {}
        for key in live:
            seen = self._first.setdefault(key, now if not first_round else self._started)
            out[key[0]] = (max(0.0, now - seen), seen == self._started)
        return out


def walls(result: Result | None) -> dict[str, str] | None:
    """The five axes' verdicts (``kept``, ``partial``, ``not_kept``) and the arm, or
    ``None`` when the job never reached a sandbox (refused before, dead)."""
    if result is None or result.containment is None:
        return None
    report = result.containment
    out: dict[str, str] = {name: verdict.state for name, verdict in report.axes().items()}
    out["sandbox"] = report.sandbox
    return out


def _worker(w: WorkerInfo, now: float) -> dict[str, Any]:
    state = "live" if is_live(w, now) else "stopped" if w.stopped_at else "lost"
    return {
        "id": w.id,
        "state": state,
        "host": w.host,
        "pid": w.pid,
        "device": w.device,
        "executors": [e for e in w.executors if ":" not in e],  # reserved: metnos:*
        "slots": w.slots,
        "running": len(w.running),
        "version": w.version,
        "seen_s_ago": round(max(0.0, now - w.seen_at), 1),
    }


async def _recent(broker: Broker) -> list[dict[str, Any]]:
    out = []
    for j in await broker.list_jobs(states=("done", "dead"), limit=RECENT):
        result = await broker.get_result(j.job_id)
        error = result.error if result is not None else None
        out.append(
            {
                "job_id": j.job_id,
                "executor": j.executor,
                "status": j.status or (result.status if result else None),
                "finished_at": j.finished_at,
                "worker": j.worker,
                "walls": walls(result),
                "error": msgspec.to_builtins(error) if error is not None else None,
            }
        )
    return out


async def overview(broker: Broker, clock: RunningClock, *, url: str = "") -> dict[str, Any]:
    """The queue now: counts by state, running and queued jobs, recent results with their
    walls, dead letters, workers and their health, executors no live worker serves."""
    stats = await broker.stats()
    now = time.time()
    running = await broker.list_jobs(states=("running",), limit=LISTED)
    elapsed = clock.elapsed(running)
    queued = await broker.list_jobs(states=("queued",), limit=LISTED)
    workers = await broker.workers()
    waiting = unserved(await broker.queued_executors(), workers, now)
    dead = await broker.dead_letters(limit=DEAD)
    return {
        "at": now,
        "broker": url,
        "counts": msgspec.to_builtins(stats),
        "running": [
            {
                "job_id": j.job_id,
                "executor": j.executor,
                "device": j.device,
                "worker": j.worker,
                "attempt": j.attempt,
                "elapsed_s": round(elapsed.get(j.job_id, (0.0, False))[0], 1),
                "since_seen": elapsed.get(j.job_id, (0.0, False))[1],
            }
            for j in running
        ],
        "queued": [
            {"job_id": j.job_id, "executor": j.executor, "device": j.device, "attempt": j.attempt}
            for j in queued
        ],
        "recent": await _recent(broker),
        "dead": [
            {
                "job_id": d.job_id,
                "executor": d.job.executor if d.job is not None else "",
                "code": d.error.code,
                "message": d.error.message,
                "attempts": d.attempts,
                "at": d.at,
            }
            for d in dead
        ],
        "workers": [_worker(w, now) for w in workers],
        "waiting_for_a_worker": [
            {"device": device, "executor": name or None, "queued": n}
            for (device, name), n in sorted(waiting.items())
        ],
    }


async def detail(broker: Broker, job_id: str) -> dict[str, Any] | None:
    """One job: its message (arguments), state, result (output, error, stderr), the
    containment report with each axis's reason, egress, undo entries, and its dead letter;
    ``None`` for a job the queue does not know."""
    state = await broker.get_job_state(job_id)
    job = await broker.get_job(job_id)
    result = await broker.get_result(job_id)
    if state is None and job is None and result is None:
        return None
    letter = None
    if state is not None and state.state == "dead":
        letter = next((d for d in await broker.dead_letters(limit=100) if d.job_id == job_id), None)
    undo = await broker.get_undo(result.undo_ids) if result is not None else []
    report = result.containment if result is not None else None
    return {
        "job_id": job_id,
        "state": msgspec.to_builtins(state) if state is not None else None,
        "job": msgspec.to_builtins(job) if job is not None else None,
        "result": msgspec.to_builtins(result) if result is not None else None,
        "walls": walls(result),
        "containment": (
            {name: msgspec.to_builtins(v) for name, v in report.axes().items()} if report else None
        ),
        "undo": [
            {
                "id": r.entry.id,
                "method": r.entry.method,
                "roots": list(r.entry.roots),
                "ops": len(r.entry.ops),
                "undone_by": r.undone_by,
            }
            for r in undo
        ],
        "dead_letter": (
            {
                "code": letter.error.code,
                "message": letter.error.message,
                "attempts": letter.attempts,
                "raw": letter.raw.decode("utf-8", "replace") if letter.raw is not None else None,
            }
            if letter is not None
            else None
        ),
    }
