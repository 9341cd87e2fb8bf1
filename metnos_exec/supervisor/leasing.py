"""Leasing: the lease loop, the heartbeats, the cancel polls, and the run slots.

The lease loop takes jobs for free slots (and ``prefetch`` ahead) and starts each in its
own task (`_job_task`); while the store fails it leases nothing new. One heartbeat task
beats every running job's lease (a lost lease stops the run); one cancel-poll task asks
the broker, for all running jobs at once, which are to be cancelled; one progress task
stores the latest progress each running job reported, when it changed. `_Slots` hands the
run slots out in lease order.
"""

from __future__ import annotations

from collections import deque

import anyio
import anyio.abc
import structlog

from ..logs import get_logger
from ..messages import Progress
from ..process import reap_orphans
from .settle import Settling
from .state import _Running

__all__ = ("Leasing",)

_log = get_logger()


class _Slots:
    """``concurrency`` run slots, handed out in lease order.

    Jobs leased together are prepared in their own tasks, and the backends schedule
    tasks in no promised order (trio shuffles them on purpose): a plain semaphore would
    let a later job of a batch start first, breaking the broker's priority order. Here a
    job launches when it is the oldest leased job not yet launched *and* a slot is free.
    A job that leaves before launching (rejected, cancelled, drained) is dropped from
    the line. Only the job at the head of the line is ever woken: a batch of 64 leases
    must not cost 64 wake-ups per launch.
    """

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._line: deque[_Running] = deque()
        self._waiting: dict[_Running, anyio.Event] = {}

    def enqueue(self, running: _Running) -> None:
        running.in_line = True
        self._line.append(running)

    def drop(self, running: _Running) -> None:
        # The flag, not `deque.remove`: every job passes here, and almost none is still
        # in the line (a scan and a ValueError per job showed in profiles).
        if running.in_line:
            running.in_line = False
            self._line.remove(running)
            self._wake_head()

    def _ready(self, running: _Running) -> bool:
        return self._free > 0 and bool(self._line) and self._line[0] is running

    def head_waits_for_mark(self) -> bool:
        """The next job to launch was leased ahead (it marks itself started first)."""
        return bool(self._line) and not self._line[0].lease.started

    async def acquire(self, running: _Running) -> None:
        """Wait for `running`'s turn and a free slot (pair with `release`)."""
        if not self._ready(running):
            try:
                while not self._ready(running):
                    event = self._waiting[running] = anyio.Event()
                    await event.wait()
            except BaseException:
                self.drop(running)
                raise
            finally:
                self._waiting.pop(running, None)
        # No checkpoint on the fast path: the arm's run is the next one, and a cancel
        # between here and the caller's ``try`` would leak the slot.
        self._line.popleft()
        running.in_line = False
        self._free -= 1
        self._wake_head()

    def release(self) -> None:
        self._free += 1
        self._wake_head()

    def _wake_head(self) -> None:
        if self._free > 0 and self._line:
            event = self._waiting.get(self._line[0])
            if event is not None:
                event.set()


class Leasing(Settling):
    """The supervisor's layer that leases jobs and keeps their leases (module docstring)."""

    def _init_parts(self) -> None:
        super()._init_parts()
        self._lease_scope: anyio.CancelScope | None = None
        #: Jobs leased and not yet done running (launched or waiting for a slot, up to
        #: ``concurrency + prefetch``); see `_vacate`.
        self._busy = 0
        #: Run slots: held from launch to the end of the run.
        self._slots = _Slots(self.concurrency)
        self._slot_freed = anyio.Event()
        # With many slots, leasing one job each time one finishes turns every lease into
        # a transaction of one; waiting for a quarter of the slots keeps batches large.
        # With few slots (native jobs) every free slot is filled at once.
        concurrency = self.concurrency
        self._lease_min = max(1, concurrency // 4) if concurrency >= 16 else 1

    @property
    def free_slots(self) -> int:
        """Run slots no leased job holds (``/metrics``)."""
        return max(0, self.concurrency - self._busy)

    async def _lease_loop(self, tg: anyio.abc.TaskGroup, *, burst: bool) -> None:
        while not self._draining and self.fatal_error is None:
            if self._unstored or self._store_failures:
                # The store failed: lease nothing new until it works again. Results that
                # cannot be stored must not pile up behind new work; the settlements
                # waiting are the probe, else the next lease is (after a backoff).
                await self._wait_for_store()
                if self._draining:
                    break
                if self._unstored:
                    continue
            free = self.concurrency + self.prefetch - self._busy
            if free <= 0 or (self._busy and free < self._lease_min):
                await self._wait_slot()
                continue
            # Not cancellable by drain: a lease taken by a call we abandoned half-way
            # would sit unserved until its visibility window ran out.
            try:
                # The broker logs the jobs it settles while leasing (``job.bad_message``,
                # ``job.dead_lettered``): they carry this context, and no arm ran them.
                with structlog.contextvars.bound_contextvars(
                    worker=self.worker_id, device=self.device, sandbox=None
                ):
                    leases = await self.broker.lease(
                        self.worker_id,
                        visibility_s=self.visibility_s,
                        device=self.device,
                        limit=free,
                        # Those for free run slots launch now and count at once; the
                        # rest wait for a slot and count once marked (`_mark_started`).
                        started=max(0, self.concurrency - self._busy),
                        executors=self.served,
                    )
            except Exception as exc:
                # The store is down or busy: keep the worker (and its running jobs)
                # alive; the loop above backs off before it tries again.
                self._broker_failed("lease", exc)
                continue
            self._broker_ok("lease")
            if not leases:
                if burst and not self._running:
                    return
                with anyio.CancelScope() as scope:
                    # Drain cancels this scope: a worker idle-waiting stops at once.
                    self._lease_scope = scope
                    if self._draining:
                        scope.cancel()
                    if burst:
                        await self._wait_slot()
                    else:
                        await self.broker.wait_for_work(self.idle_poll_s)
                self._lease_scope = None
                continue
            for lease in leases:
                if self._draining:
                    # Leased in the instant drain began: hand it back untouched.
                    with anyio.CancelScope(shield=True):
                        released = await self._settle(
                            "release", lease, lambda lease=lease: self.broker.release(lease)
                        )
                    if released:
                        self.stats["released"] += 1
                    continue
                running = _Running(lease)
                self._running[lease.job.id] = running
                self._slots.enqueue(running)
                self._busy += 1
                self.stats["leased"] += 1
                self.observer.leased(lease.job, lease.attempt, self.clock())
                tg.start_soon(self._job_task, running, name=f"job {lease.job.id}")

    async def _wait_slot(self) -> None:
        # Two loops wait here at once (leasing and drain). Only the first to wake swaps
        # in a fresh event: a second swap would strand the first waiter on an event
        # nobody sets any more (a drain then hung for its whole grace).
        event = self._slot_freed
        await event.wait()
        if self._slot_freed is event:
            self._slot_freed = anyio.Event()

    async def _wait_for_store(self) -> None:
        """The lease loop's pause while the store fails (drain cuts it short)."""
        with anyio.CancelScope() as scope:
            self._lease_scope = scope
            if self._draining:
                scope.cancel()
            if self._unstored:
                await self._stored.wait()
            else:
                await anyio.sleep(self.store_backoff(max(1, self._store_failures)))
        self._lease_scope = None

    async def _cancel_poll_loop(self) -> None:
        while True:
            await anyio.sleep(self.cancel_poll_s)
            # A subreaper worker inherits the orphans of its jobs' trees (bubblewrap's
            # inits above all): reap those nobody else waits for (no-op otherwise).
            try:
                reap_orphans()
            except Exception as exc:  # /proc surprises must not stop the cancel polls
                _log.warning("worker.error", error=f"orphan sweep: {type(exc).__name__}: {exc}")
            ids = [
                job_id
                for job_id, running in self._running.items()
                if not running.settling and running.stop is None
            ]
            if not ids:
                continue
            try:
                wanted = await self.broker.cancel_requested(ids)
            except Exception as exc:
                # As for heartbeats: a failure only delays the cancel to the next poll.
                self._broker_failed("cancel_poll", exc)
                continue
            for job_id in wanted:
                running = self._running.get(job_id)
                if running is None or running.settling or running.stop is not None:
                    continue  # finished meanwhile; its ack decides
                running.stop = "cancel_requested"
                running.scope.cancel()

    async def _heartbeat_loop(self) -> None:
        while True:
            await anyio.sleep(self.heartbeat_s)
            for running in list(self._running.values()):
                if running.stop is not None or (
                    running.settling and not (running.storing or running.committing)
                ):
                    # Stopped, or finished and being stored. A result waiting for the
                    # store keeps its lease alive, so it is still ours when the store
                    # comes back; so does a commit, however long it takes, until its
                    # result is stored.
                    continue
                try:
                    reply = await self.broker.heartbeat(running.lease)
                except Exception as exc:
                    # The store failed (busy, full, restarting): keep running; the next
                    # beat may succeed, and the lease window has room for it. Logged from
                    # this task, not the job's: its context is spelled out.
                    self._broker_failed(
                        "heartbeat",
                        exc,
                        job_id=running.lease.job.id,
                        executor=running.lease.job.executor,
                        worker=self.worker_id,
                        device=self.device,
                        sandbox=running.sandbox,
                    )
                    continue
                self._broker_ok("heartbeat")
                if running.settling:
                    continue  # it finished while we waited; its settlement decides
                if not reply.ok:
                    running.stop = "lease_lost"
                    running.scope.cancel()
                elif reply.cancel_requested:
                    running.stop = "cancel_requested"
                    running.scope.cancel()

    async def _progress_loop(self) -> None:
        """Every ``progress_every_s``, store the progress of each running job that
        reported something new since (one write per job and period at most: a job that
        floods its channel costs the store no more than one that reports once a second)."""
        while True:
            await anyio.sleep(self.progress_every_s)
            for running in list(self._running.values()):
                report = running.progress
                if report is None or report is running.progress_stored:
                    continue
                if running.stop is not None or running.settling:
                    continue  # its result is what counts now
                running.progress_stored = report
                progress = Progress(
                    fraction=report.fraction,
                    message=report.message,
                    at=running.progress_at,
                    attempt=running.lease.attempt,
                    lines=report.lines,
                    dropped=report.dropped,
                    malformed=report.malformed,
                )
                try:
                    await self.broker.report_progress(running.lease, progress)
                except Exception as exc:
                    # Advice only: the next change is stored at the next period.
                    self._broker_failed("progress", exc, job_id=running.lease.job.id)
                    continue
                self._broker_ok("progress")
