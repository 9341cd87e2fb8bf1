"""Storing what a job ends with: the ack of its result, a retry, a release; with backoff
while the store fails (`store_backoff`), and batched across jobs (`_Batcher`).

A settlement that fails is kept in memory and tried again while its job's lease is
heart-beaten, until it is stored or given up (a drain past its grace, a fatal store
error); meanwhile the lease loop leases nothing new (see `_GATING`). Every failed broker
call is logged here as ``broker.error``; ``broker.recovered`` says when the store works
again. A fatal store error stops the worker (`Supervisor.drain`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import anyio

from ..brokers.base import Lease, RetryOutcome
from ..errors import BadMessage, BrokerError, HostFault, MetnosError
from ..logs import finished_level, get_logger
from ..messages import ErrorInfo, Result
from .outage import OutageLog
from .outcome import _containment_summary, _exit_fields
from .state import SupervisorState

__all__ = ("Settling",)

#: Broker calls on the path of new work: while one of them fails, the lease loop waits
#: (`Supervisor._wait_for_store`), and one that works again ends the wait.
_GATING: Final = frozenset({"lease", "mark_started", "ack", "record_undo", "retry", "release"})

_log = get_logger()

_T = TypeVar("_T")
_I = TypeVar("_I")
_O = TypeVar("_O")


@dataclass(eq=False)
class _BatchSlot(Generic[_I, _O]):
    item: _I
    done: anyio.Event = field(default_factory=anyio.Event)
    out: _O | None = None
    error: BaseException | None = None


class _Batcher(Generic[_I, _O]):
    """Group calls that arrive while one is being written into one batch call (acks,
    start marks).

    Leader/follower, no extra task: the first caller while none is in flight writes every
    pending item (its own and those queued meanwhile) until none is left; the others wait
    for their slot. Under load a batch grows to what arrived during one transaction,
    which is what lets one SQLite worker keep up with the echo arm; when idle every item
    is written at once, alone. A failure of a batch call fails every item of the batch
    (the store wrote none of them: one transaction); each caller decides what to do.
    """

    def __init__(
        self,
        one: Callable[[_I], Awaitable[_O]],
        many: Callable[[Sequence[_I]], Awaitable[list[_O]]],
    ) -> None:
        self._one = one
        self._many = many
        self._pending: list[_BatchSlot[_I, _O]] = []
        self._flushing = False

    async def __call__(self, item: _I) -> _O:
        slot: _BatchSlot[_I, _O] = _BatchSlot(item)
        self._pending.append(slot)
        if not self._flushing:
            self._flushing = True
            try:
                while self._pending:
                    batch, self._pending = self._pending, []
                    try:
                        if len(batch) == 1:
                            outs = [await self._one(batch[0].item)]
                        else:
                            outs = await self._many([b.item for b in batch])
                    except Exception as exc:
                        for b in batch:
                            b.error = exc
                    else:
                        for b, out in zip(batch, outs, strict=True):
                            b.out = out
                    for b in batch:
                        b.done.set()
            finally:
                self._flushing = False
        if not slot.done.is_set():
            # A follower. (The leader does not wait on its own, already set, event: on
            # trio that would be one more trip through the scheduler per call.)
            await slot.done.wait()
        if slot.error is not None:
            raise slot.error
        return slot.out  # type: ignore[return-value]


class Settling(SupervisorState):
    """The supervisor's layer that stores settlements (see the module docstring)."""

    def _init_parts(self) -> None:
        super()._init_parts()
        self.fatal_error: BrokerError | None = None
        #: Set when the store is back after failing: the catalog is published at once.
        self._republish = anyio.Event()
        #: Consecutive failed broker calls, and since when (monotonic) the store failed.
        self._store_failures = 0
        self._store_down_since: float | None = None
        #: Which failures become records (one per outage, reminders, one recovery).
        self._outage = OutageLog()
        #: Settlements waiting for the store; leasing waits while there are any.
        self._unstored = 0
        self._stored = anyio.Event()
        #: Set when results waiting for the store are to be given up (drain, fatal).
        self._give_up = anyio.Event()
        broker = self.broker
        self._acks: _Batcher[tuple[Lease, Result], bool] = _Batcher(
            lambda item: broker.ack(*item), broker.ack_many
        )
        self._starts: _Batcher[Lease, bool] = _Batcher(
            broker.mark_started, broker.mark_started_many
        )

    def _broker_failed(self, op: str, exc: Exception, **fields: Any) -> None:
        """Log a failed broker call (`OutageLog`: the first of an outage, then a reminder
        at most every 30 s with the count); a fatal store error stops the worker.

        Only the calls on the path of new work (`_GATING`) hold the lease loop back; a
        failed heartbeat, purge or catalog update is said and left to its own next try.
        """
        self.stats["broker_errors"] += 1
        self.observer.broker_error(op, exc.code if isinstance(exc, MetnosError) else HostFault.code)
        if op in _GATING:
            self._store_failures += 1
            if self._store_down_since is None:
                self._store_down_since = time.monotonic()
        if isinstance(exc, MetnosError):
            code, error = exc.code, exc.message
        else:  # a client library's own exception, or a bug: said as it is
            code, error = HostFault.code, f"{type(exc).__name__}: {exc}"
        fatal = isinstance(exc, BrokerError) and exc.fatal
        self._outage.failed(
            always=fatal,
            op=op,
            code=code,
            error=error,
            failures=self._store_failures,
            fatal=fatal,
            **fields,
        )
        if fatal and self.fatal_error is None:
            assert isinstance(exc, BrokerError)
            self.fatal_error = exc
            # Nothing can be stored any more: stop at once, give up what waits.
            self._give_up.set()
            if self._tg is not None:
                self._tg.start_soon(self.drain, 0.0, name="fatal stop")

    def _broker_ok(self, op: str, *, own: int = 0) -> None:
        """A gating call worked: the store is back, unless results still wait for it
        (`own`: the caller's own settlement, still counted as waiting)."""
        if self._store_failures and op in _GATING and self._unstored - own <= 0:
            self._outage.recovered(op=op)
            self._store_failures = 0
            self._store_down_since = None
            self._republish.set()

    async def _settle(self, op: str, lease: Lease, call: Callable[[], Awaitable[_T]]) -> _T | None:
        """Store a settlement (`call`: ack, retry, release) until the store takes it.

        A failure keeps it here, in memory, and tries again with backoff; the job's lease
        is heart-beaten meanwhile (`_Running.storing`). ``None`` when it was given up
        (drain past its grace, or a fatal store error): the lease then lapses and the
        broker redelivers the job. Callers shield it: a stored result is never thrown
        away by a cancel.
        """
        failures = 0
        running = self._running.get(lease.job.id)
        try:
            while True:
                try:
                    out = await call()
                except BadMessage:
                    raise  # the settlement itself is unstorable; the caller decides
                except Exception as exc:
                    failures += 1
                    if failures == 1:
                        self._unstored += 1
                        if running is not None:
                            running.storing = True
                    delay = self.store_backoff(failures)
                    self._broker_failed(
                        op,
                        exc,
                        job_id=lease.job.id,
                        attempt=lease.attempt,
                        retry_in_s=None if self._give_up.is_set() else round(delay, 3),
                    )
                    if self._give_up.is_set():
                        self.stats["unsettled"] += 1
                        _log.error(
                            "broker.error",
                            op=op,
                            job_id=lease.job.id,
                            gave_up=True,
                            error="not stored: the worker is stopping; the job's lease "
                            "will lapse and another delivery will run it",
                        )
                        return None
                    with anyio.move_on_after(delay):
                        await self._give_up.wait()
                    continue
                self._broker_ok(op, own=1 if failures else 0)
                return out
        finally:
            if failures:
                if running is not None:
                    running.storing = False
                self._unstored -= 1
                if not self._unstored:
                    self._stored.set()
                    self._stored = anyio.Event()

    def _result(self, lease: Lease, status: Any, **fields: Any) -> Result:
        return Result(
            job_id=lease.job.id,
            status=status,
            worker=self.worker_id,
            device=self.device,
            attempt=lease.attempt,
            finished_at=self.clock(),
            **fields,
        )

    async def _reject(self, lease: Lease, exc: MetnosError) -> None:
        _log.warning("job.rejected", code=exc.code, message=exc.message)
        result = self._result(
            lease, "rejected", error=ErrorInfo(code=exc.code, message=exc.message)
        )
        self.stats["rejected"] += 1
        await self._ack(lease, result)

    async def _ack(self, lease: Lease, result: Result) -> bool:
        """Store `result`; ``False``: the lease was lost and nothing was stored."""
        with anyio.CancelScope(shield=True), self.observer.phase("ack", lease.job):
            try:
                stored = await self._settle("ack", lease, lambda: self._acks((lease, result)))
            except BadMessage as exc:
                # The result itself cannot be stored (its output cannot be encoded): store
                # a failed result that says so, rather than no result at all.
                result = self._result(
                    lease,
                    "failed",
                    error=ErrorInfo(code="E_BAD_OUTPUT", message=exc.message),
                    exit=result.exit,
                    containment=result.containment,
                    usage=result.usage,
                    started_at=result.started_at,
                )
                stored = await self._settle("ack", lease, lambda: self._acks((lease, result)))
        if stored is None:
            return False  # given up (see `_settle`; logged there): nothing was stored
        _log.log(
            finished_level(result.status, stored=stored),
            "job.finished",
            status=result.status,
            stored=stored,
            code=result.error.code if result.error else None,
            usage=result.usage,
            containment=_containment_summary(result.containment),
            **_exit_fields(result.exit),
        )
        self.stats["finished"] += 1
        if stored:
            self.observer.finished(lease.job, result)
        return stored

    async def _release(self, lease: Lease, reason: str) -> None:
        with anyio.CancelScope(shield=True):
            released = await self._settle("release", lease, lambda: self.broker.release(lease))
        if released:
            self.stats["released"] += 1
            _log.info("job.released", reason=reason)

    async def _retry(self, lease: Lease, error: ErrorInfo) -> None:
        delay = self.retry_delay(lease.attempt)
        with anyio.CancelScope(shield=True):
            # The broker dead-letters instead when this was the last allowed delivery.
            outcome: RetryOutcome | None = await self._settle(
                "retry", lease, lambda: self.broker.retry(lease, error=error, delay_s=delay)
            )
        if outcome is None:
            return  # given up (see `_settle`)
        self.observer.retried(lease.job, outcome, error.code)
        if outcome == "dead":
            self.stats["dead"] += 1
            _log.error(
                "job.dead_lettered",
                code=error.code,
                message=error.message,
                attempts=lease.attempt,
            )
        elif outcome == "scheduled":
            self.stats["retried"] += 1
            _log.warning(
                "job.retry_scheduled",
                code=error.code,
                message=error.message,
                delay_s=round(delay, 3),
                next_attempt=lease.attempt + 1,
                max_attempts=lease.job.max_attempts,
            )
        else:
            self._count_lost()
            _log.warning("lease.lost", visibility_s=self.visibility_s, during="retry")
