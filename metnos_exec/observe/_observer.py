"""The `Observer` the supervisor calls, its no-op default, and `make_observer`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ..messages import Job, Result

if TYPE_CHECKING:
    from .metrics import Metrics
    from .tracing import Tracing

__all__ = ("NULL_OBSERVER", "ObservedWorker", "Observer", "make_observer")

#: One shared no-op context manager: `contextlib.nullcontext` is reentrant and reusable.
_NULL: AbstractContextManager[None] = contextlib.nullcontext()


class _Broker(Protocol):
    @property
    def queue_id(self) -> str: ...

    async def stats(self) -> Any: ...


class ObservedWorker(Protocol):
    """What the observer reads of the worker it observes (the `Supervisor`)."""

    @property
    def broker(self) -> _Broker: ...

    @property
    def running(self) -> int: ...

    @property
    def free_slots(self) -> int: ...


class Observer:
    """The points of a job's path the supervisor reports; every one a no-op here.

    `make_observer` returns a subclass that records metrics, traces, or both.
    """

    _listener: Any = None

    def job(self, job: Job, attempt: int) -> AbstractContextManager[None]:
        """Around the whole delivery, in the job's own task (the CONSUMER span)."""
        return _NULL

    def phase(self, name: str, job: Job) -> AbstractContextManager[None]:
        """Around one phase of the job (``plan``, ``commit``, ``ack``)."""
        return _NULL

    def leased(self, job: Job, attempt: int, now: float) -> None:
        """A delivery was leased (`now`: unix seconds)."""

    def ran(self, job: Job, elapsed_s: float, wall_s: float | None) -> None:
        """The arm returned after `elapsed_s`; the process itself ran `wall_s` of it."""

    def finished(self, job: Job, result: Result) -> None:
        """A result was stored."""

    def retried(self, job: Job, outcome: str, code: str) -> None:
        """A retry was stored: ``scheduled``, ``dead`` (dead-lettered) or ``lost``."""

    def lease_lost(self) -> None:
        """A lease was lost (the broker will deliver the job again)."""

    def broker_error(self, op: str, code: str) -> None:
        """A broker call failed."""

    def degraded(self, reason: str) -> None:
        """A job runs below its wall (the arm's degradation, or no staging)."""

    async def bind(self) -> None:
        """Take the address `serve` will serve on; here: none.

        Raises:
            BadConfig: the address cannot be bound (in use, not this host's).
        """

    @contextlib.asynccontextmanager
    async def bound(self) -> AsyncIterator[None]:
        """`bind` for the block; what `serve` did not take is closed at its end."""
        await self.bind()
        try:
            yield
        finally:
            listener, self._listener = self._listener, None
            if listener is not None:
                with anyio.CancelScope(shield=True):
                    await listener.aclose()

    async def serve(
        self,
        source: ObservedWorker,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve what is observed (``/metrics``) until cancelled; here: nothing."""
        task_status.started()


#: The observer of a worker that observes nothing.
NULL_OBSERVER = Observer()


class _Phase:
    """A phase timed (and spanned): a class rather than a generator, it is entered twice
    a job."""

    __slots__ = ("executor", "metrics", "name", "span", "start")

    def __init__(
        self, metrics: Metrics | None, name: str, executor: str, span: AbstractContextManager[Any]
    ) -> None:
        self.metrics, self.name, self.executor, self.span = metrics, name, executor, span

    def __enter__(self) -> None:
        self.span.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        if self.metrics is not None:
            self.metrics.phase(self.name, self.executor, time.perf_counter() - self.start)
        self.span.__exit__(*exc)


class _Timed:
    """A phase timed, with no span (`_Phase` without one: the usual case, an unsampled
    or untraced job)."""

    __slots__ = ("executor", "metrics", "name", "start")

    def __init__(self, metrics: Metrics, name: str, executor: str) -> None:
        self.metrics, self.name, self.executor = metrics, name, executor

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.metrics.phase(self.name, self.executor, time.perf_counter() - self.start)


class _Recording(Observer):
    """An observer with metrics, tracing, or both (`make_observer`)."""

    def __init__(self, metrics: Metrics | None, tracing: Tracing | None) -> None:
        self.metrics = metrics
        self.tracing = tracing
        self.queue = ""

    def job(self, job: Job, attempt: int) -> AbstractContextManager[None]:
        if self.tracing is None:
            return _NULL
        return self.tracing.consumer(job, attempt, self.queue)

    def phase(self, name: str, job: Job) -> AbstractContextManager[None]:
        tracing = self.tracing
        if tracing is not None and tracing.recording():
            return _Phase(self.metrics, name, job.executor, tracing.span(name))
        if self.metrics is None:
            return _NULL
        return _Timed(self.metrics, name, job.executor)

    def leased(self, job: Job, attempt: int, now: float) -> None:
        if self.metrics is not None:
            self.metrics.leased(job, attempt, now)

    def ran(self, job: Job, elapsed_s: float, wall_s: float | None) -> None:
        # The arm's own setup (argv, mounts, the spawn) is what it spent before the
        # process ran: the run's wall time is measured from the spawn.
        run_s = elapsed_s if wall_s is None else min(wall_s, elapsed_s)
        start_s = elapsed_s - run_s
        if self.metrics is not None:
            self.metrics.ran(job.executor, start_s, run_s)
        if self.tracing is not None:
            self.tracing.ran(start_s, run_s)

    def finished(self, job: Job, result: Result) -> None:
        if self.metrics is not None:
            self.metrics.finished(job, result)
        if self.tracing is not None:
            self.tracing.finished(result)

    def retried(self, job: Job, outcome: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.retried(job, outcome, code)

    def lease_lost(self) -> None:
        if self.metrics is not None:
            self.metrics.lease_lost()

    def broker_error(self, op: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.broker_error(op, code)

    def degraded(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.degraded(reason)

    async def bind(self) -> None:
        if self.metrics is not None and self.metrics.bind is not None and not self._listener:
            from .http import open_listener

            self._listener = await open_listener(self.metrics)

    async def serve(
        self,
        source: ObservedWorker,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        self.queue = source.broker.queue_id
        if self.metrics is None or self.metrics.bind is None:
            task_status.started()
            return
        from .http import serve_metrics

        listener, self._listener = self._listener, None
        await serve_metrics(self.metrics, source, listener=listener, task_status=task_status)


def make_observer(*, metrics: tuple[str, int] | None = None, trace: bool | None = None) -> Observer:
    """The observer a worker runs with.

    Args:
        metrics: serve ``/metrics`` on this (host, port), checked by `http.check_bind`
            before (``None``: no metrics).
        trace: trace jobs; ``None``: when the process has an OpenTelemetry tracer
            provider (`tracing_active`).

    Returns:
        `NULL_OBSERVER` when neither is asked for (nothing is imported).

    Raises:
        BadConfig: metrics asked for without ``prometheus-client`` installed.
    """
    from .tracing import Tracing, tracing_active

    tracing = Tracing() if (tracing_active() if trace is None else trace) else None
    recorder = None
    if metrics is not None:
        from .metrics import Metrics

        recorder = Metrics(bind=metrics)
    if recorder is None and tracing is None:
        return NULL_OBSERVER
    return _Recording(recorder, tracing)
