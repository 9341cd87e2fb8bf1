"""The broker seam: what every queue backend (memory, SQLite, Redis) promises.

Delivery is at-least-once. A worker *leases* a job for a visibility window and heart-beats
while it runs; `ack` stores the result. A lease that is not renewed expires and the job is
delivered again with ``attempt + 1``. Every delivery counts against ``Job.max_attempts``
(retries and lost leases alike), except a `release` on drain, which gives the delivery back.

Every lease carries a random *token*. Only the current token may ack, retry, dead-letter,
release or heartbeat; once the job was re-leased (or finished) the old token is rejected.
That fencing is what makes "the result is stored once" hold when a slow worker wakes up
after its lease was taken over.

Device routing: a worker has a device id (`SERVER_DEVICE` unless told otherwise). A job
with ``device=None`` or ``device="server"`` goes to server workers only; a job targeting
device ``D`` goes only to workers whose device id is ``D``. Server workers publish their
executors' manifests (`publish_executors`) so that a submit can refuse a device job whose
executor must stay on the server (`metnos_exec.catalog`).

A malformed message (not JSON, wrong field types, unsupported ``v``) never reaches a
worker: `lease` dead-letters it with ``E_BAD_MESSAGE`` (stores a ``dead`` result and a
`DeadLetter` with the raw bytes), logs ``job.bad_message`` and carries on with the next
job. A job whose lease lapses on its last allowed delivery is dead-lettered the same way
with ``E_LEASE_EXPIRED`` (logged as ``job.dead_lettered``). Brokers log nothing else: the
supervisor owns the job's story in the logs.

Undo entries (`UndoEntry`, see `metnos_exec.messages`) are stored next to the results:

- `record_undo` stores a job's entries *fenced by its lease* (nothing is stored once the
  lease was lost), before the job's result is acked. An entry counts only once the job's
  stored result lists its id in ``Result.undo_ids``: entries of a job that never got its
  result (the worker died between the two calls; its commit journal rolls the changes back)
  are ignored by readers and forgotten by `purge`.
- ``undoes``: an undo job records its own entry (the redo) and names the entries it undid;
  the broker sets their ``undone_by`` to the undo job's id. Whether they *are* undone is
  decided by that job's result (`metnos_exec.undo` reads it): until it succeeded, the mark
  means nothing, so an undo job that died half-way and is redelivered is not refused.
- `get_undo` returns entries by id, with their ``undone_by``; unknown ids are left out.
- `undo_blobs` is every blob digest a stored entry needs (`UndoEntry.blobs`): the blob
  store may delete only what is not in it (retention follows the results').
- `purge` forgets a job's entries with its result, and entries no result lists that are
  older than the cut.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from types import TracebackType
from typing import Literal

import msgspec

from ..catalog import ExecutorInfo
from ..errors import IdempotencyConflict
from ..messages import SERVER_DEVICE, DeadLetter, ErrorInfo, Job, Result, UndoEntry

__all__ = (
    "Broker",
    "BrokerStats",
    "CancelOutcome",
    "HeartbeatReply",
    "JobState",
    "Lease",
    "RetryOutcome",
    "SubmitReceipt",
    "UndoRecord",
    "check_idempotent_reuse",
)

CancelOutcome = Literal["cancelled", "cancelling", "finished", "unknown"]
#: What `Broker.retry` did: redelivery scheduled, dead (attempts exhausted), or nothing
#: because the lease was lost.
RetryOutcome = Literal["scheduled", "dead", "lost"]


class SubmitReceipt(msgspec.Struct, frozen=True):
    """The id the job is known by; ``duplicate`` when an idempotency key (or the same id)
    matched an earlier submission, whose id is returned."""

    job_id: str
    duplicate: bool = False


def _canonical_args(args: dict[str, object]) -> object:
    # Through JSON, as the wire sees them: a tuple and a list are the same argument, and a
    # job read back from a store compares equal to the one submitted.
    return msgspec.json.decode(msgspec.json.encode(args))


def check_idempotent_reuse(original: Job, new: Job) -> None:
    """Accept `new` as a duplicate of `original` (same idempotency key) only when it asks
    for the same thing: same executor, same arguments. Other fields (timeout, priority,
    correlation id, ...) may differ: they say how, not what.

    Raises:
        IdempotencyConflict: the key already names a job with another executor or other
            arguments; returning its id would silently drop what the caller asked for.
    """
    if original.executor == new.executor and _canonical_args(original.args) == _canonical_args(
        new.args
    ):
        return
    what = "executor" if original.executor != new.executor else "arguments"
    raise IdempotencyConflict(
        f"idempotency key {new.idempotency_key!r} already names job {original.id} "
        f"({original.executor}) with different {what}; use a new key for a different job",
        original_job_id=original.id,
    )


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """One delivery of a job to one worker.

    Attributes:
        job: the decoded job.
        attempt: 1-based delivery count, this delivery included.
        token: fencing token; only the holder of the current token may settle the job.
        lease_until: unix seconds (broker clock) when the lease lapses unless renewed.
        worker: the worker id that took the lease.
        device: the device id the lease was taken for.
        visibility_s: the window `heartbeat` renews by default.
    """

    job: Job
    attempt: int
    token: str
    lease_until: float
    worker: str
    device: str = SERVER_DEVICE
    visibility_s: float = 30.0


class HeartbeatReply(msgspec.Struct, frozen=True, kw_only=True):
    """``ok=False``: the lease is gone (re-leased elsewhere, or already settled); stop
    work and do not ack. ``cancel_requested``: someone asked to cancel the running job."""

    ok: bool
    cancel_requested: bool = False
    lease_until: float | None = None


class JobState(msgspec.Struct, frozen=True, kw_only=True):
    """Where a job is. ``done`` covers every stored result except ``dead``."""

    job_id: str
    state: Literal["queued", "running", "done", "dead"]
    attempt: int
    worker: str | None = None
    lease_until: float | None = None
    cancel_requested: bool = False


class BrokerStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counts by state. ``delayed`` is the part of ``queued`` not yet due."""

    queued: int
    delayed: int
    running: int
    done: int
    dead: int


class UndoRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A stored undo entry.

    Attributes:
        entry: the entry.
        undone_by: the undo job that applied it, if one did (see the module docstring: it
            stands only if that job's result is ``succeeded``).
        recorded_at: unix seconds (broker clock) it was stored.
    """

    entry: UndoEntry
    undone_by: str | None = None
    recorded_at: float = 0.0


class Broker(abc.ABC):
    """A job queue backend. Every method is safe to call from asyncio and trio (anyio)."""

    #: URL scheme this broker is opened by (``memory``, ``sqlite``, ``redis``).
    scheme: str = ""

    # --- producing --------------------------------------------------------------------

    @abc.abstractmethod
    async def submit(self, job: Job) -> SubmitReceipt:
        """Queue `job`. With an ``idempotency_key`` already known (or an id already
        known) nothing is queued and the original job's id is returned with
        ``duplicate=True``.

        Raises:
            IdempotencyConflict: the key is known but names a job with another executor
                or other arguments (see `check_idempotent_reuse`); nothing is queued.
        """

    async def submit_many(self, jobs: Sequence[Job]) -> list[SubmitReceipt]:
        """Queue several jobs; backends override this to use one transaction."""
        return [await self.submit(job) for job in jobs]

    @abc.abstractmethod
    async def submit_raw(self, data: bytes) -> str:
        """Queue an encoded JSON job as another-language producer would.

        A message that does not decode is still stored (under a fresh id, which is
        returned) and is dead-lettered with ``E_BAD_MESSAGE`` when a server worker leases
        it. A valid one behaves like `submit` (a duplicate returns the original id).
        """

    # --- consuming --------------------------------------------------------------------

    @abc.abstractmethod
    async def lease(
        self,
        worker_id: str,
        *,
        visibility_s: float,
        device: str | None = None,
        limit: int = 1,
    ) -> list[Lease]:
        """Take up to `limit` due jobs for `device` (``None`` = `SERVER_DEVICE`),
        highest priority first, then oldest first. Never blocks waiting for work.

        Jobs whose lease expired are redelivered here (``attempt + 1``); an expired job
        with no attempts left becomes dead with ``E_LEASE_EXPIRED``; an expired job with
        a pending cancel becomes ``cancelled``.
        """

    @abc.abstractmethod
    # A timeout parameter (ASYNC109) on purpose: timing out is a normal answer here
    # ("no work yet", "no result yet"), not an error a cancel scope should raise.
    async def wait_for_work(self, timeout: float) -> None:  # noqa: ASYNC109
        """Return when work may be available, or after `timeout` seconds at most.

        May return early without work (callers loop on `lease`). A submit through this
        same broker object wakes it at once.
        """

    @abc.abstractmethod
    async def heartbeat(self, lease: Lease, *, visibility_s: float | None = None) -> HeartbeatReply:
        """Extend `lease` by `visibility_s` (default: the lease's own window) from now."""

    @abc.abstractmethod
    async def ack(self, lease: Lease, result: Result) -> bool:
        """Store `result` and finish the job. ``False`` (nothing written) when the lease
        was lost: the job was re-leased or already settled."""

    async def ack_many(self, items: Sequence[tuple[Lease, Result]]) -> list[bool]:
        """Ack several leases; backends override this to use one transaction."""
        return [await self.ack(lease, result) for lease, result in items]

    @abc.abstractmethod
    async def retry(self, lease: Lease, *, error: ErrorInfo, delay_s: float) -> RetryOutcome:
        """Give the job back for redelivery after `delay_s` (see `metnos_exec.backoff`).

        When this delivery was the last allowed (``attempt >= max_attempts``) the job is
        dead-lettered instead with `error`, and a ``dead`` result is stored.
        """

    @abc.abstractmethod
    async def dead_letter(self, lease: Lease, *, error: ErrorInfo) -> bool:
        """Dead-letter the job now with `error` and store a ``dead`` result.
        ``False`` when the lease was lost."""

    @abc.abstractmethod
    async def release(self, lease: Lease) -> bool:
        """Put the job back at once without counting this delivery (used on drain).
        ``False`` when the lease was lost."""

    # --- control and inspection -------------------------------------------------------

    @abc.abstractmethod
    async def cancel(self, job_id: str) -> CancelOutcome:
        """Cancel a job.

        Returns:
            ``"cancelled"``: it was queued; it is removed and a ``cancelled`` result is
            stored. ``"cancelling"``: it is running; the flag reaches the worker through
            `cancel_requested` (or `heartbeat`), which kills it and acks a
            ``cancelled`` result. ``"finished"``: it already has a result.
            ``"unknown"``: no such job.
        """

    async def cancel_requested(self, job_ids: Sequence[str]) -> set[str]:
        """Which of `job_ids` are running with a cancel request pending.

        One call for every job a worker runs: the supervisor polls it often (every
        ``cancel_poll_s``) so a cancel lands within a second, far sooner than the next
        heartbeat. Backends override this default with one query.
        """
        wanted: set[str] = set()
        for job_id in job_ids:
            state = await self.get_job_state(job_id)
            if state is not None and state.state == "running" and state.cancel_requested:
                wanted.add(job_id)
        return wanted

    @abc.abstractmethod
    async def get_result(self, job_id: str) -> Result | None:
        """The stored result, or ``None`` while there is none."""

    @abc.abstractmethod
    async def wait_result(
        self,
        job_id: str,
        *,
        timeout: float | None,  # noqa: ASYNC109
    ) -> Result | None:
        """Wait for the result; ``None`` on timeout (``timeout=None`` waits forever)."""

    @abc.abstractmethod
    async def get_job_state(self, job_id: str) -> JobState | None:
        """Where the job is, or ``None`` for an unknown id."""

    @abc.abstractmethod
    async def dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        """The most recent dead letters, newest first."""

    @abc.abstractmethod
    async def stats(self) -> BrokerStats:
        """Counts of jobs by state."""

    # --- undo entries -----------------------------------------------------------------

    async def record_undo(
        self, lease: Lease, entries: Sequence[UndoEntry], *, undoes: Sequence[str] = ()
    ) -> bool:
        """Store `entries` for the leased job and mark `undoes` as undone by it, in one
        transaction, only while `lease` is current (see the module docstring).

        Returns:
            ``False`` (nothing written) when the lease was lost.
        """
        raise NotImplementedError(f"{type(self).__name__} does not store undo entries")

    async def get_undo(self, entry_ids: Sequence[str]) -> list[UndoRecord]:
        """The stored entries among `entry_ids`, in the order asked; unknown ids are
        left out."""
        raise NotImplementedError(f"{type(self).__name__} does not store undo entries")

    async def undo_blobs(self) -> set[str]:
        """Every blob digest some stored entry needs (`UndoEntry.blobs`)."""
        raise NotImplementedError(f"{type(self).__name__} does not store undo entries")

    # --- the executor catalog (see `metnos_exec.catalog`) -------------------------------

    async def publish_executors(self, infos: Sequence[ExecutorInfo]) -> None:
        """Record the executors a server worker runs (an entry replaces the same name's).

        The default keeps nothing: a broker without a catalog cannot refuse a device job
        at submit, and device workers still refuse it when they lease it.
        """
        return None

    async def executor_info(self, name: str) -> ExecutorInfo | None:
        """The latest published entry for `name`, or ``None`` (unknown, or no catalog)."""
        return None

    async def purge(self, *, older_than_s: float) -> int:
        """Forget finished jobs (results, dead letters, undo entries, and their idempotency
        keys) whose result is older than `older_than_s` seconds, and undo entries no result
        lists that are that old; queued and running jobs are kept.

        Returns:
            How many jobs were forgotten.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support purge")

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Idempotent."""

    async def __aenter__(self) -> Broker:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
