"""What the SQLite and the Redis broker share: the lease arguments' check, the decoding of
a stored job body, the message of a lapsed lease's dead letter, and the in-process
wake-ups with the idle waits built on them (`PolledWaits`).

Wake-ups are per event loop (a RunVar) and per store (its key): a submit or ack through
any broker object on the same store in the same event loop (say, a client and a worker
embedded in one program) wakes the waiters at once. Other loops and other processes fall
back to polling, or (a store that names its ``_watch_files``, SQLite) to a write seen by
inotify (`_file_wake`); events are never touched across threads.
"""

from __future__ import annotations

from pathlib import Path

import anyio
from anyio.lowlevel import RunVar

from ..errors import BadMessage
from ..messages import (
    E_LEASE_EXPIRED,
    MAX_JOB_BYTES,
    DeadLetter,
    ErrorInfo,
    Job,
    Result,
    decode_job,
)
from ._file_wake import FileWatch
from .base import Broker

__all__ = (
    "PolledWaits",
    "check_lease_args",
    "dead_records",
    "decode_body",
    "lapsed_error",
    "notify",
    "wake_event",
)

_WAKE: RunVar[dict[tuple[str, str], anyio.Event]] = RunVar("metnos_exec.brokers.sqlite.wake")


def check_lease_args(visibility_s: float, limit: int) -> None:
    if not visibility_s > 0:
        raise ValueError(f"visibility_s must be > 0, got {visibility_s}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")


def wake_event(key: str, kind: str) -> anyio.Event:
    try:
        table = _WAKE.get()
    except LookupError:
        table = {}
        _WAKE.set(table)
    event = table.get((key, kind))
    if event is None:
        event = table[(key, kind)] = anyio.Event()
    return event


def notify(key: str, kind: str) -> None:
    try:
        table = _WAKE.get()
    except LookupError:
        return
    event = table.pop((key, kind), None)
    if event is not None:
        event.set()


def decode_body(job_id: str, body: bytes | str) -> Job | ErrorInfo:
    """The job a stored body holds, or why it cannot be one (the dead letter's error)."""
    try:
        job = decode_job(body)
    except BadMessage as exc:
        return ErrorInfo(code=exc.code, message=exc.message)
    except Exception as exc:  # decode_job promises BadMessage; belt and braces
        return ErrorInfo(
            code=BadMessage.code,
            message=f"job message rejected: {type(exc).__name__}: {exc}",
        )
    if job.id != job_id:
        return ErrorInfo(
            code=BadMessage.code,
            message=f"job message rejected: body id {job.id!r} differs from row id",
        )
    return job


def dead_records(
    *,
    job_id: str,
    job: Job | None,
    raw: bytes | None,
    error: ErrorInfo,
    attempt: int,
    worker: str,
    device: str,
    now: float,
) -> tuple[Result, DeadLetter]:
    """A dead job's ``dead`` result and its dead letter (`raw` cut to ``MAX_JOB_BYTES``)."""
    result = Result(
        job_id=job_id,
        status="dead",
        error=error,
        worker=worker,
        device=device,
        attempt=attempt,
        finished_at=now,
    )
    letter = DeadLetter(
        job_id=job_id,
        job=job,
        raw=raw[:MAX_JOB_BYTES] if raw is not None else None,
        raw_truncated=raw is not None and len(raw) > MAX_JOB_BYTES,
        error=error,
        attempts=attempt,
        at=now,
        worker=worker,
    )
    return result, letter


def lapsed_error(*, started: bool, attempt: int, lapses: int) -> ErrorInfo:
    """The ``E_LEASE_EXPIRED`` error of a job whose lease lapsed with no delivery left:
    on its last allowed started delivery, or after too many unstarted ones."""
    if started:
        message = (
            f"the lease expired on delivery {attempt}, the last allowed; "
            "its worker stopped heart-beating"
        )
    else:
        message = (
            f"the job was leased {lapses} times and never started: each time its "
            "worker was lost before launching it"
        )
    return ErrorInfo(code=E_LEASE_EXPIRED, message=message)


class PolledWaits(Broker):
    """`wait_for_work` and `wait_result` for a store other processes cannot signal: an
    in-process wake-up (keyed by ``_wake_key``), a write to one of ``_watch_files`` seen
    by inotify (`_file_wake`: another process's commit), or the next poll (every
    ``_poll`` seconds), whichever comes first.

    The work waits share one watch, kept open between them, so a commit landing between a
    worker's empty lease and its next wait is already queued on it and wakes that wait at
    once; a second task waiting for work at the same moment (rare: one leasing loop per
    worker) only polls. A result wait makes its watch before its look, for the same
    reason."""

    _wake_key: str
    _poll: float
    #: Files whose writes mean "look again" (SQLite: the database's ``-wal``); none: poll.
    _watch_files: tuple[Path, ...] = ()
    _work_watch: FileWatch | None = None
    _work_watch_busy: bool = False

    def _wake_workers(self) -> None:
        notify(self._wake_key, "work")

    def _wake_results(self) -> None:
        notify(self._wake_key, "result")

    def _open_watch(self) -> FileWatch | None:
        return FileWatch.open(self._watch_files) if self._watch_files else None

    def _close_watches(self) -> None:
        if self._work_watch is not None:
            self._work_watch.close()
            self._work_watch = None
        self._watch_files = ()  # closed: no new watch is made

    async def wait_for_work(self, timeout: float) -> None:  # noqa: ASYNC109
        event = wake_event(self._wake_key, "work")
        if self._work_watch_busy:
            watch = None
        else:
            if self._work_watch is None:
                self._work_watch = self._open_watch()
            watch = self._work_watch
        if watch is not None:
            self._work_watch_busy = True
        try:
            with anyio.move_on_after(min(timeout, self._poll)):
                await _first_of(event, watch)
        finally:
            if watch is not None:
                self._work_watch_busy = False

    async def wait_result(
        self,
        job_id: str,
        *,
        timeout: float | None,  # noqa: ASYNC109
    ) -> Result | None:
        watch = self._open_watch()
        try:
            with anyio.move_on_after(timeout if timeout is not None else float("inf")):
                while True:
                    # Registered before the look, so an ack landing in between still wakes us.
                    event = wake_event(self._wake_key, "result")
                    result = await self.get_result(job_id)
                    if result is not None:
                        return result
                    with anyio.move_on_after(self._poll):
                        await _first_of(event, watch)
            return await self.get_result(job_id)
        finally:
            if watch is not None:
                watch.close()


async def _first_of(event: anyio.Event, watch: FileWatch | None) -> None:
    """Return when `event` is set, or, with a `watch`, when it sees a write.

    With a watch the event is not waited on: a submit or ack through another broker
    object in this loop is a commit to the same file, which the watch sees as well; one
    task instead of a task group of two is most of an idle worker's CPU (measured: 15 ms of
    CPU per idle second polling alone, 20-22 with the pair, every 50 ms)."""
    if watch is None:
        await event.wait()
    else:
        await watch.changed()
