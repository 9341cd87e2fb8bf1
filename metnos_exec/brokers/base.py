"""The broker seam: what every queue backend (memory, SQLite, Redis) promises.

Delivery is at-least-once. A worker *leases* a job for a visibility window and heart-beats
while it runs; `ack` stores the result. A lease that is not renewed expires and the job is
delivered again.

Attempts. ``Job.max_attempts`` bounds the deliveries that *started*, i.e. that the
worker committed to launch. A lease taken for a free run slot starts at once (the worker
launches it in the same scheduling round; `lease`'s ``started``); a job *leased ahead*
(``Lease.started`` false: it will wait for a slot) starts only when the worker calls
`mark_started`, just before it launches the executor. A lease that lapses unstarted (a
job leased ahead and its worker killed while it waited) gives its attempt back and is
redelivered with the same ``attempt`` number; a `release` on drain does the same. A lease
that lapses after it started, a `retry` and a `dead_letter` use the attempt up. So a
worker killed twice never dead-letters a job that was waiting for its turn. As a safety
net against a job that somehow kills its worker before launch, a job whose lease lapses
unstarted `MAX_UNSTARTED_LAPSES` times is dead-lettered with ``E_LEASE_EXPIRED`` too.

(Why not mark every launch: one more write transaction per job cost a quarter of the
echo queue's throughput, measured; a lease for a free slot is followed by its launch
without any wait in between, so it counts from the lease.)

Every lease carries a random *token*. Only the current token may ack, retry, dead-letter,
release, heartbeat or mark started; once the job was re-leased (or finished) the old token
is rejected. That fencing is what makes "the result is stored once" hold when a slow
worker wakes up after its lease was taken over. A job the store says is running but that
has no lease (no expiry time) is treated as a lapsed lease, never left running forever.

Time. Every deadline a broker writes (``lease_until``, a heartbeat's extension, a retry's
due time) is computed from the clock read *inside* the store's transaction, after any
wait for a lock: a lease granted after a 5 s wait for the write lock is valid for its
full window from the grant, not from the call. Waiting for a lock never costs a job an
attempt.

Device routing: a worker has a device id (`SERVER_DEVICE` unless told otherwise). A job
with ``device=None`` or ``device="server"`` goes to server workers only; a job targeting
device ``D`` goes only to workers whose device id is ``D``. Server workers publish their
executors' manifests (`publish_executors`) so that a submit can refuse a device job whose
executor must stay on the server (`metnos_exec.devices.catalog`).

Executor routing: workers on one queue may serve different executors (a worker with a
GPU, one with a provider's credentials). `lease` takes the names a worker serves and
hands it only jobs for those; a job for an executor no live worker serves waits for one
(``status`` names such executors) rather than being rejected by a worker that lacks it.
Order holds across them: highest priority first, then oldest first, among the executors
one worker serves. Jobs stored by a build before routing name no route and go to any
worker (one that lacks the executor rejects them with ``E_UNKNOWN_EXECUTOR``, as before).

Messages. A job is at most ``MAX_JOB_BYTES`` encoded with ``args`` at most
``MAX_ARGS_DEPTH`` deep (`metnos_exec.messages`): `submit` and `submit_raw` refuse a
larger one at once with `BadMessage` naming the limit, and store nothing. A message that
cannot be decoded never reaches a worker, whatever is wrong with it (not JSON, wrong field
types, unsupported ``v``, too large or too deep, bytes that are not UTF-8, anything that
makes a decoder raise): `lease` dead-letters it with ``E_BAD_MESSAGE`` (stores a ``dead``
result and a `DeadLetter` with the raw bytes) *once*, logs ``job.bad_message`` once, after
its transaction committed, and hands out the valid jobs of the same batch as usual. A job
whose lease lapses on its last allowed delivery is dead-lettered with
``E_LEASE_EXPIRED`` (logged as ``job.dead_lettered``). Brokers log nothing else: the
supervisor owns the job's story in the logs.

Store failures. A broker raises only `BrokerError` subclasses (`metnos_exec.errors`) when
its store fails, never its client library's exceptions, and every method leaves the store
as it was when it raises (one transaction, or one atomic script). The class says what
happened and what to do:

============================  ========================  ===================================
class                          code                       meaning / what a worker does
============================  ========================  ===================================
`BrokerUnavailable`            ``E_BROKER_UNAVAILABLE``   cannot reach or open the store, an
                                                          I/O error: retry with backoff
`BrokerBusy`                   ``E_BROKER_BUSY``          a lock held elsewhere past the
                                                          broker's wait: retry
`BrokerFull`                   ``E_BROKER_FULL``          no space (disk, quota, file size
                                                          limit, maxmemory): retry
`BrokerReadOnly`               ``E_BROKER_READONLY``      the store refuses writes: retry
                                                          (a broker opened to write refuses
                                                          to open on a read-only store)
`BrokerGone`                   ``E_BROKER_GONE``          the store was deleted or replaced
                                                          under the broker: fatal, stop
`BrokerCorrupt`                ``E_BROKER_CORRUPT``       data that cannot be read: fatal
============================  ========================  ===================================

``BrokerError.retry`` and ``.fatal`` carry that last column, so a worker needs no table of
its own: it keeps settled results in memory and retries them with backoff, stops leasing
until the store works, and stops on a fatal error.

Retention. Finished jobs (with their results, dead letters and idempotency keys) are kept
until `purge` forgets those finished more than ``older_than_s`` ago (workers do it every
so often, keeping `DEFAULT_RETENTION_S` unless told otherwise); queued and running jobs
are never purged. Purging gives the space back to the system (SQLite: an incremental
vacuum). Data stored beside results and keyed by job (undo entries, their blobs) takes
part through `PurgeHook` (`add_purge_hook`): each batch of forgotten job ids is handed to
every hook inside the same transaction, then each hook may collect what nothing refers
to any more (a blob no unexpired undo entry needs) — a hook never loses what is still
referenced.

Undo entries (`UndoEntry`, see `metnos_exec.messages`) are stored next to the results:

- `record_undo` stores a job's entries *fenced by its lease* (nothing is stored once the
  lease was lost), before the job's result is acked. An entry counts only once the job's
  stored result lists its id in ``Result.undo_ids``: entries of a job that never got its
  result (the worker died between the two calls; its commit journal rolls the changes back)
  are ignored by readers and forgotten by `purge`.
- ``undoes``: an undo job records its own entry (the redo) and names the entries it undid;
  the broker sets their ``undone_by`` to the undo job's id. Whether they *are* undone is
  decided by that job's result (`metnos_exec.undo.apply` reads it): until it succeeded, the mark
  means nothing, so an undo job that died half-way and is redelivered is not refused.
- `get_undo` returns entries by id, with their ``undone_by``; unknown ids are left out.
- `undo_blobs` is every blob digest a stored entry needs (`UndoEntry.blobs`): the blob
  store may delete only what is not in it (retention follows the results').
- `purge` forgets a job's entries with its result, and entries no result lists that are
  older than the cut.

Approval gates (`metnos_exec.undo.gates`). A gated job's worker acks an
``awaiting_approval`` result: the job is finished for the queue (its lease, slot and
attempts are done; retention counts from then), and that result is the one result that
may be written again, exactly once: `settle_gate` replaces it with the job's final one
(``succeeded`` with its undo ids after an approval; ``rejected`` after a rejection or the
gate's expiry) in one transaction, only while the stored result is still the
``awaiting_approval`` one. The first answer wins: a second `settle_gate`, an approval
racing a rejection, gets ``False`` and changes nothing. No lease fences it (the approve
job's own lease fences its undo entry, recorded with `record_undo` before); readers and
`wait_result` see the final result from then on.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from types import TracebackType
from typing import Any, Final, Literal, Protocol

import msgspec

from ..devices.catalog import ExecutorInfo
from ..messages import SERVER_DEVICE, DeadLetter, ErrorInfo, Job, Result, UndoEntry, encode_job
from ._reuse import check_idempotent_reuse, queued_cancel_message
from .presence import FleetRecords
from .progress import ProgressRecords

__all__ = (
    "DEFAULT_RETENTION_S",
    "MAX_UNSTARTED_LAPSES",
    "Broker",
    "BrokerStats",
    "CancelOutcome",
    "HeartbeatReply",
    "JobState",
    "Lease",
    "PurgeHook",
    "PurgeReport",
    "RetryOutcome",
    "SubmitReceipt",
    "UndoRecord",
    "check_idempotent_reuse",
    "queued_cancel_message",
)

#: How long finished jobs are kept unless an operator says otherwise (7 days): finite, so
#: a queue that runs for months does not grow without bound.
DEFAULT_RETENTION_S: Final = 7 * 24 * 3600.0

#: Lapsed leases that never started after which a job is dead-lettered anyway
#: (``E_LEASE_EXPIRED``): the net under "unstarted deliveries do not count".
MAX_UNSTARTED_LAPSES: Final = 20

CancelOutcome = Literal["cancelled", "cancelling", "finished", "unknown"]
#: What `Broker.retry` did: redelivery scheduled, dead (attempts exhausted), or nothing
#: because the lease was lost.
RetryOutcome = Literal["scheduled", "dead", "lost"]


class SubmitReceipt(msgspec.Struct, frozen=True):
    """The id the job is known by; ``duplicate`` when an idempotency key (or the same id)
    matched an earlier submission, whose id is returned."""

    job_id: str
    duplicate: bool = False


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
        started: this delivery counts as an attempt already; ``False`` for a job leased
            ahead, until `Broker.mark_started`.
    """

    job: Job
    attempt: int
    token: str
    lease_until: float
    worker: str
    device: str = SERVER_DEVICE
    visibility_s: float = 30.0
    started: bool = True


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


class PurgeReport(msgspec.Struct, frozen=True, kw_only=True):
    """What `Broker.purge` did.

    Attributes:
        jobs: finished jobs forgotten (with their results, dead letters, keys).
        collected: items the purge hooks collected after (e.g. blobs no longer needed).
        reclaimed_bytes: store space given back to the system; ``None`` when the store
            cannot tell.
    """

    jobs: int
    collected: int = 0
    reclaimed_bytes: int | None = None


class PurgeHook(Protocol):
    """Data a component keeps beside the results, keyed by job, that a purge must respect.

    ``store`` is the broker's own handle inside its purge transaction (SQLite: the
    `sqlite3.Connection` with the transaction open; other brokers say what they pass).
    """

    def forget_jobs(self, store: Any, job_ids: Sequence[str]) -> None:
        """Forget what belongs to `job_ids` (being purged), in the same transaction."""

    def collect(self, store: Any, *, before: float) -> int:
        """After the batches, in a transaction of its own: remove what nothing refers to
        any more (and, for data with its own time, what is older than `before`, the
        purge's cut-off in unix seconds); return how many.

        Must keep everything still referenced (a blob an unexpired undo entry needs).
        """


class BrokerStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counts by state. ``delayed`` is the part of ``queued`` not yet due.
    ``oldest_queued_at``: the ``submitted_at`` of the first due queued job in submission
    order (its age is ``/metrics``' oldest age; Redis: the earliest among each route's
    next job, which is the same unless a job was queued again); ``None``: none due."""

    queued: int
    delayed: int
    running: int
    done: int
    dead: int
    oldest_queued_at: float | None = None


class DataLoss(msgspec.Struct, frozen=True, kw_only=True):
    """A store found to have lost its data (`Broker.data_lost`): when (unix s), why
    (``restart``: no persistence; ``flush``: keys deleted, server up; ``unknown``), what
    the finder saw last (those jobs and results are gone), the run ids, one sentence."""

    at: float
    broker: str
    cause: Literal["restart", "flush", "unknown"]
    detail: str
    last_seen: BrokerStats | None = None
    last_seen_at: float | None = None
    run_id_before: str | None = None
    run_id_now: str | None = None


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


class Broker(FleetRecords, ProgressRecords, abc.ABC):
    """A job queue backend. Every method is safe to call from asyncio and trio (anyio).

    Every method may raise a `BrokerError` subclass when the store fails (see the module
    docstring); the ``Raises`` sections below list only the other errors.
    """

    #: URL scheme this broker is opened by (``memory``, ``sqlite``, ``redis``).
    scheme: str = ""

    @property
    def queue_id(self) -> str:
        """Which queue this is, the same for every broker object open on it (the store's
        location; the key prefix too on Redis): commit journals record it, so a worker
        never settles another queue's (`metnos_exec.undo.staging.Staging.recover`), and a
        worker's default state folder is its queue's."""
        return f"{self.scheme}:{id(self):x}"  # a store no other process can open

    def add_purge_hook(self, hook: PurgeHook) -> None:
        """Make `purge` hand every batch of forgotten job ids to `hook` (see `PurgeHook`)."""
        # In the instance dict rather than set by an __init__: a subclass need not
        # remember to call one.
        self.__dict__.setdefault("_purge_hooks", []).append(hook)

    @property
    def purge_hooks(self) -> tuple[PurgeHook, ...]:
        """The hooks `purge` calls, in the order they were added."""
        return tuple(self.__dict__.get("_purge_hooks", ()))

    # --- producing --------------------------------------------------------------------

    @abc.abstractmethod
    async def submit(self, job: Job) -> SubmitReceipt:
        """Queue `job`. With an ``idempotency_key`` already known (or an id already
        known) nothing is queued and the original job's id is returned with
        ``duplicate=True``.

        Raises:
            BadMessage: the job is larger than ``MAX_JOB_BYTES`` encoded, or its args
                nest deeper than ``MAX_ARGS_DEPTH`` (`messages.encode_job`); nothing is
                queued.
            IdempotencyConflict: the key is known but names a job with another executor
                or other arguments (see `check_idempotent_reuse`); nothing is queued.
        """

    async def submit_many(self, jobs: Sequence[Job]) -> list[SubmitReceipt]:
        """Queue several jobs, all or none: one refused by `submit`'s checks (size,
        depth) means none is queued. Backends override this to use one transaction."""
        for job in jobs:
            encode_job(job)  # refuses before anything is queued
        return [await self.submit(job) for job in jobs]

    @abc.abstractmethod
    async def submit_raw(self, data: bytes) -> str:
        """Queue an encoded JSON job as another-language producer would.

        A message that does not decode is still stored (under a fresh id, which is
        returned) and is dead-lettered with ``E_BAD_MESSAGE`` when a server worker leases
        it. A valid one behaves like `submit` (a duplicate returns the original id).

        Raises:
            BadMessage: `data` is larger than ``MAX_JOB_BYTES``; nothing is stored.
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
        started: int | None = None,
        executors: Collection[str] | None = None,
    ) -> list[Lease]:
        """Take up to `limit` due jobs for `device` (``None`` = `SERVER_DEVICE`),
        highest priority first, then oldest first. Never blocks waiting for work.

        `executors`: the executor names the worker serves; only their jobs are leased
        (``None``: every job). A job for an executor no worker serves stays queued (see
        "Executor routing" in the module docstring).

        The first `started` of the returned leases start at once (they count as an
        attempt: the caller launches them now); the others are leased ahead and start
        with `mark_started`. ``None``: all start at once.

        Jobs whose lease expired are redelivered here: with ``attempt + 1`` when that
        delivery had started (`mark_started`), with the same ``attempt`` when it had
        not. An expired job with no attempts left (or `MAX_UNSTARTED_LAPSES` unstarted
        lapses) becomes dead with ``E_LEASE_EXPIRED``; an expired job with a pending
        cancel becomes ``cancelled``. Undecodable messages met on the way are
        dead-lettered (see the module docstring) and never returned.
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
    async def mark_started(self, lease: Lease) -> bool:
        """Record that this delivery (leased ahead) is starting: from now on it counts as
        an attempt. Harmless on a lease that started already.

        Called just before the executor is launched. ``False`` (nothing written) when
        the lease was lost: do not launch, another worker may hold the job.
        """

    async def mark_started_many(self, leases: Sequence[Lease]) -> list[bool]:
        """`mark_started` for several leases; backends override this to use one
        transaction."""
        return [await self.mark_started(lease) for lease in leases]

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

    async def settle_gate(self, job_id: str, result: Result) -> bool:
        """Replace `job_id`'s stored ``awaiting_approval`` result with `result`, its final
        one (see the module docstring); ``False``: no such result (unknown, already final).

        Raises:
            ValueError: `result` is another job's, or awaiting approval itself.
        """
        raise NotImplementedError(f"{type(self).__name__} does not keep approval gates")

    async def get_undo(self, entry_ids: Sequence[str]) -> list[UndoRecord]:
        """The stored entries among `entry_ids`, in the order asked; unknown ids are
        left out."""
        raise NotImplementedError(f"{type(self).__name__} does not store undo entries")

    async def undo_blobs(self) -> set[str]:
        """Every blob digest some stored entry needs (`UndoEntry.blobs`)."""
        raise NotImplementedError(f"{type(self).__name__} does not store undo entries")

    async def durability(self) -> str | None:
        """Why a restart of the store would lose what it acknowledged (queued jobs,
        results), or ``None``: it keeps them, or it cannot be told. Said by the worker at
        start and by ``doctor``; the default knows nothing."""
        return None

    async def data_lost(self) -> list[DataLoss]:
        """The times the store was found to have lost its data (a Redis restarted without
        persistence), newest first, as kept in the store for ``status`` and ``doctor``;
        the default knows of none."""
        return []

    async def open_access(self) -> str | None:
        """What a client giving no credentials may do with the queue, or ``None`` (nothing,
        or it cannot be told): ``doctor`` warns of it. The default knows nothing."""
        return None

    # --- the executor catalog (see `metnos_exec.devices.catalog`) -------------------------------

    async def publish_executors(self, infos: Sequence[ExecutorInfo]) -> None:
        """Record the executors a server worker runs (an entry replaces the same name's).

        The default keeps nothing: a broker without a catalog cannot refuse a device job
        at submit, and device workers still refuse it when they lease it.
        """
        return None

    async def executor_info(self, name: str) -> ExecutorInfo | None:
        """The latest published entry for `name`, or ``None`` (unknown, or no catalog)."""
        return None

    @abc.abstractmethod
    async def purge(self, *, older_than_s: float) -> PurgeReport:
        """Forget finished jobs (results, dead letters, undo entries, and their idempotency
        keys) whose result is older than `older_than_s` seconds, and undo entries no result
        lists that are that old; queued and running jobs are kept.

        Works in bounded batches (one short transaction each), hands every batch to the
        purge hooks, runs their `PurgeHook.collect`, then gives the freed space back.
        """

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
