"""The supervisor: lease jobs, vet them, run them in their sandbox, store one result.

One `Supervisor` per worker process. It owns a task group with a fixed number of slots
(``concurrency``); each leased job runs in its own task, inside that group, so nothing
outlives `run` and there is no fire-and-forget task anywhere.

Per job, in order:

1. bind ``job_id``, ``executor``, ``worker``, ``device`` and ``sandbox`` into the
   structlog contextvars, so every record of the job carries them (spec §9): look the
   executor up, and bind the arm its runtime will use here (`predict_arm`, no side
   effects) — ``sandbox=None`` while no executor is known; log ``job.received``;
2. an unknown executor or a bad manifest → ``rejected`` with the code; with a `TrustStore`
   (``trust``), its signature is checked (cached) and the job is planned and run from the
   verified private copy (``E_SIGNATURE`` → ``rejected``; see `signing`);
3. `plan_invocation` (argument vetting, autonomy policy: ``E_CAPABILITY_DENIED``,
   ``E_BAD_ARGS``, ``E_AUTONOMY`` → ``rejected``; nothing runs);
4. choose the arm (``E_SANDBOX_REQUIRED`` → ``rejected``); wait for a slot (a job leased
   ahead, see ``prefetch``, is fully prepared while the slots are busy); log
   ``job.started``;
5. run the arm while heart-beating every ``heartbeat_s`` (default ``visibility_s / 3``);
   a heartbeat that finds the lease gone → ``lease.lost``, the run is cancelled and
   nothing is acked (the broker redelivers it). Cancel requests are polled apart, every
   ``cancel_poll_s`` (one `Broker.cancel_requested` call for all running jobs), so a
   cancel lands within about a second rather than at the next heartbeat; a job found
   cancelled is stopped and a ``cancelled`` result is acked;
6. map the outcome to a result and ack it (``job.finished``), or schedule a retry. A
   staged success is committed first; its lease is heart-beaten through the commit until
   its result is stored, however long that takes (a lease lapsing mid-commit handed the
   job to another worker while its folders were half changed).

Store failures (spec §7: a worker survives its store failing). Every broker call that
fails is logged as ``broker.error`` (op, code, error). A settlement (ack, retry, release)
that fails is kept in memory and tried again with backoff (`store_backoff`) while its
job's lease is heart-beaten, until it is stored or the lease is found lost; meanwhile no
new job is leased (results that cannot be stored must not pile up), and the lease loop
probes the store with backoff when it was the lease that failed. ``broker.recovered``
says when the store works again. A fatal store error (`BrokerError.fatal`: the queue file
deleted or replaced, a corrupt file) stops the worker: `run` returns and
`fatal_error` holds it. On drain, results still waiting for the store get
``settle_grace_s`` more after the grace; what is still not stored then is given up
(``broker.error`` with ``gave_up``; its lease lapses and the job runs again) and counted
in ``worker.stopped`` as ``unsettled``.

Attempts. Jobs leased for free run slots start at once (`Broker.lease`'s ``started``):
they are launched in the same scheduling round. A job leased ahead (``prefetch``) is
recorded as started (`Broker.mark_started`, batched across jobs) just before its launch:
only from then on does it count against ``max_attempts``, so one that never launched
(drain, a lost worker) has used nothing. When the mark finds the lease lost, nothing is
launched; when the store fails, nothing is launched either and the lease is handed back
once the store works.

Retry rule. Retried (with `retry_delay(attempt)`, until ``max_attempts``, then dead-
lettered with the last error): a `HostFault` from the arm (the harness broke; no verdict
exists, another try may find it healthy), and an executor that exits with code 75
(``EX_TEMPFAIL`` from sysexits.h: "try again later", the executor's own way of saying its
failure is transient). A lost lease is redelivered by the broker itself (the delivery
counts as an attempt there). Every other failure is final: an executor that fails, times
out, traps or runs out of fuel has given a verdict about these arguments, and running it
again would only give the same verdict later.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Literal, Protocol, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import sniffio
import structlog
from anyio.abc import TaskStatus

from ..backoff import retry_delay, store_backoff
from ..brokers.base import DEFAULT_RETENTION_S, Broker, Lease, RetryOutcome
from ..devices.signing import TrustStore, default_verified_dir
from ..errors import (
    BadArguments,
    BadMessage,
    BrokerError,
    CommitConflict,
    HostFault,
    MetnosError,
    ServerPinned,
    SignatureError,
    UndoUnavailable,
)
from ..logs import finished_level
from ..manifest import ExecutorRegistry
from ..messages import SERVER_DEVICE, UNDO_EXECUTOR, ErrorInfo, Result, UndoEntry, cap_text
from ..plan import default_skills_root, plan_invocation
from ..process import reap_orphans
from ..sandbox._types import (
    ContainmentReport,
    Failure,
    FuelExhausted,
    Killed,
    MemoryExceeded,
    Sandbox,
    SandboxExit,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
    Trap,
    Usage,
    stopped_outcomes,
)
from ..sandbox._wasm_engine import default_cache_dir
from ..undo.apply import apply_undo, entries_to_undo
from ..undo.folder_lock import FolderLock
from ..undo.journal import Blocked
from ..undo.staging import Reversible, Staging, default_state_dir, disk_verdict

__all__ = (
    "EX_TEMPFAIL",
    "MAX_OUTPUT_DEPTH",
    "RAW_OUTPUT_CAP_BYTES",
    "ArmChooser",
    "ServerPinned",
    "Supervisor",
)

#: sysexits.h ``EX_TEMPFAIL``: an executor exiting with it asks to be retried later.
EX_TEMPFAIL: Final = 75

#: How much of a non-JSON stdout is kept (as text in ``Result.output``) for diagnosis.
RAW_OUTPUT_CAP_BYTES: Final = 4096

#: Deepest nesting of arrays and objects an executor's output may have (serde_json's
#: default). Deeper is ``E_BAD_OUTPUT``. Why a bound at all: the JSON decoder, the broker's
#: encoder and every reader of the result recurse once per level, so a job printing
#: 400,000 ``[`` exhausted the worker's stack (a ``RecursionError`` that came back as a
#: host fault); and a depth that decodes here could still fail when a reader with less
#: stack left encodes it again.
MAX_OUTPUT_DEPTH: Final = 128

#: Extra wall time the supervisor's own backstop gives an arm past the job's budget: the
#: arms enforce ``wall_time_s`` themselves (TERM, grace, KILL, reap); this scope only
#: catches an arm that failed to.
_BACKSTOP_MARGIN_S: Final = 10.0

#: How often running jobs are checked for a cancel request: a user pressing "cancel"
#: expects it to bite within a second; one cheap query per poll for all jobs.
_CANCEL_POLL_S: Final = 0.5

#: How long results still waiting for the store may keep a drained worker (after its
#: grace) before they are given up to the lease's expiry.
_SETTLE_GRACE_S: Final = 5.0

#: Broker calls on the path of new work: while one of them fails, the lease loop waits
#: (`Supervisor._wait_for_store`), and one that works again ends the wait.
_GATING: Final = frozenset({"lease", "mark_started", "ack", "record_undo", "retry", "release"})

#: How often a worker purges finished jobs past their retention (and once at start).
_PURGE_EVERY_S: Final = 3600.0
#: How often a server worker publishes its executors again (`Supervisor._catalog_loop`).
_CATALOG_EVERY_S: Final = 300.0
#: ``commit.filtered`` records logged per job at most (the rest are counted, not listed).
_FILTERED_LOGGED: Final = 100
#: Paths listed in an ``undo.recorded`` / ``undo.applied`` record at most.
_PATHS_LOGGED: Final = 50

_log = structlog.get_logger("metnos_exec")

_T = TypeVar("_T")
_I = TypeVar("_I")
_O = TypeVar("_O")


class _ArmChoice(Protocol):
    @property
    def sandbox(self) -> Sandbox: ...

    @property
    def degraded(self) -> object: ...


class ArmChooser(Protocol):
    """`sandbox.select.choose_arm`'s shape (injectable for tests)."""

    def __call__(self, runtime: str, *, require_sandbox: bool) -> _ArmChoice: ...


def _predict_default_arm(runtime: str) -> str | None:
    """The arm `choose_arm` will pick for `runtime`, for the log context (no logging).

    ``None`` when it cannot tell (a bad ``METNOS_BWRAP``, an unknown runtime): the
    choice itself raises the error, which rejects the job.
    """
    from ..sandbox.select import decide_arm

    try:
        return decide_arm(runtime).arm
    except (MetnosError, ValueError):
        return None


_StopReason = Literal["lease_lost", "cancel_requested", "drain", "not_started"]


@dataclass(eq=False)
class _Running:
    """A job in flight: its lease and the scope that cancels its run."""

    lease: Lease
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    stop: _StopReason | None = None
    #: The run is over; the result is being settled (heartbeats no longer matter).
    settling: bool = False
    holds_slot: bool = True
    #: The arm's name once known, for records logged outside the job's own task.
    sandbox: str | None = None
    #: It holds a run slot and its arm was (or is being) launched.
    launched: bool = False
    #: In the line for a run slot (see `_Slots`).
    in_line: bool = False
    #: Its settlement is waiting for the store: keep its lease alive meanwhile.
    storing: bool = False
    #: Its changes are being committed (and settled): keep its lease alive meanwhile, or
    #: another worker is handed the job while its folders are half changed.
    committing: bool = False
    #: What the arm measured of its run when that was stopped from outside after launch
    #: (a cancel, a drain, a lost lease, the backstop): usage and the containment that held.
    measured: SandboxOutcome | None = None


def _exit_fields(exit_: SandboxExit | None) -> dict[str, Any]:
    if exit_ is None:
        return {"exit": None}
    return {"exit": msgspec.to_builtins(exit_)}


class Supervisor:
    """Serve jobs from `broker` with executors from `registry`.

    Args:
        broker: where jobs come from and results go.
        registry: the executors this worker can run.
        worker_id: this worker's id (leases, results, logs).
        device: the device this worker runs on (``"server"`` or a device id).
        concurrency: jobs run at once.
        visibility_s: lease window; a worker silent this long loses the job.
        heartbeat_s: heartbeat period while a job runs (default ``visibility_s / 3``).
        cancel_poll_s: how often running jobs are checked for a cancel request.
        prefetch: jobs leased ahead of a free slot while every slot is busy; each is
            planned and its arm chosen at once, then launched the moment a slot frees,
            so leasing and planning leave the path between one job and the next. The
            cost: with other workers idle, such a job waits for this worker's next free
            slot (at most one job's run). ``0`` leases only for free slots.
        arm_chooser: picks the sandbox arm for a runtime (default `choose_arm`).
        predict_arm: runtime → the name of the arm `arm_chooser` will pick, without
            choosing (so records logged before and during the choice, e.g.
            ``job.received``, ``job.rejected``, ``sandbox.degraded``, carry ``sandbox``).
            Default: `decide_arm` with the default chooser, else ``None`` until chosen.
        policy: passed to `plan_invocation` (``None``: its default policy).
        home: the user's home for ``~`` in hints and arguments (default ``$HOME``).
        skills_root: where provider skills keep their homes.
        clock: unix-seconds clock for ``started_at`` / ``finished_at``.
        retry_delay: attempt → seconds before redelivery (default `backoff.retry_delay`).
        idle_poll_s: longest wait for new work before polling the broker again.
        backstop_margin_s: how long past its wall-time budget an arm may run before the
            supervisor cancels it itself (the arms enforce the budget; this is a net).
        staging: the blob store, commit journal and staging namespace that make the
            jobs' file changes reversible (default: a `Staging` in `default_state_dir`,
            made at first use).
        trust: when set, every executor's signature is checked before its job is planned
            (`signing.TrustStore`: ``E_SIGNATURE`` rejects the job) and the job runs from
            the verified private copy. Required on a device worker (`run_worker`).
        python: the interpreter of native executors (default: the worker's own; see
            `runtimes.obtain_device_python`).
        retention_s: finished jobs older than this are purged (at start, then every
            ``purge_every_s``); ``None`` never purges.
        purge_every_s: how often to purge.
        catalog_every_s: how often a server worker publishes its executors again (see
            `_catalog_loop`).
        store_backoff: failures in a row → seconds before trying the store again.
        settle_grace_s: after a drain's grace, how long results still waiting for the
            store may keep the worker before they are given up.

    Attributes:
        fatal_error: the fatal store error that stopped `run`, if one did.
    """

    def __init__(
        self,
        broker: Broker,
        registry: ExecutorRegistry,
        *,
        worker_id: str,
        device: str = "server",
        concurrency: int = 4,
        visibility_s: float = 30.0,
        heartbeat_s: float | None = None,
        cancel_poll_s: float = _CANCEL_POLL_S,
        prefetch: int = 1,
        arm_chooser: ArmChooser | Callable[..., Any] | None = None,
        predict_arm: Callable[[str], str | None] | None = None,
        policy: Any = None,
        home: str | os.PathLike[str] | None = None,
        skills_root: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.time,
        retry_delay: Callable[[int], float] = retry_delay,
        idle_poll_s: float = 1.0,
        backstop_margin_s: float = _BACKSTOP_MARGIN_S,
        staging: Staging | None = None,
        trust: TrustStore | None = None,
        python: str | None = None,
        retention_s: float | None = DEFAULT_RETENTION_S,
        purge_every_s: float = _PURGE_EVERY_S,
        catalog_every_s: float = _CATALOG_EVERY_S,
        store_backoff: Callable[[int], float] = store_backoff,
        settle_grace_s: float = _SETTLE_GRACE_S,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if visibility_s <= 0:
            raise ValueError("visibility_s must be positive")
        self.broker = broker
        self.registry = registry
        self.worker_id = worker_id
        self.device = device
        self.concurrency = concurrency
        self.visibility_s = visibility_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else visibility_s / 3
        if cancel_poll_s <= 0:
            raise ValueError("cancel_poll_s must be positive")
        self.cancel_poll_s = cancel_poll_s
        if prefetch < 0:
            raise ValueError("prefetch must be zero or more")
        self.prefetch = prefetch
        if arm_chooser is None:
            # Imported here so the supervisor module loads without the arms (tests inject
            # doubles; the arms pull in wasmtime lazily anyway).
            from ..sandbox.select import choose_arm

            arm_chooser = choose_arm
            if predict_arm is None:
                predict_arm = _predict_default_arm
        self.arm_chooser = arm_chooser
        self.predict_arm: Callable[[str], str | None] = predict_arm or (lambda runtime: None)
        self.policy = policy
        # Resolved once, now: ``~`` is this real folder for the worker's whole life, so a
        # link planted in its place later is refused (`sandbox.mount_sources`), not followed.
        # The default too (the worker's own home): resolved per job by the planner, it
        # cost a third of the plan (an ``lstat`` per path component, every job).
        self.home = os.path.realpath(
            os.fspath(home) if home is not None else os.path.expanduser("~")
        )
        self.skills_root = os.fspath(skills_root) if skills_root is not None else None
        self.clock = clock
        self.retry_delay = retry_delay
        self.idle_poll_s = idle_poll_s
        self.backstop_margin_s = backstop_margin_s
        self._staging = staging
        self._owns_staging = staging is None
        self._protected: tuple[int, tuple[str, ...]] | None = None
        self.trust = trust
        self.python = python
        if retention_s is not None and not retention_s > 0:
            raise ValueError("retention_s must be positive (or None: keep forever)")
        self.retention_s = retention_s
        self.purge_every_s = purge_every_s
        self.catalog_every_s = catalog_every_s
        #: A journal recovery failed on the store and is owed (`_owes_recovery`).
        self._unrecovered = False
        #: Set when the store is back after failing: the catalog is published at once.
        self._republish = anyio.Event()
        self.store_backoff = store_backoff
        self.settle_grace_s = settle_grace_s
        self.fatal_error: BrokerError | None = None
        #: Consecutive failed broker calls, and since when (monotonic) the store failed.
        self._store_failures = 0
        self._store_down_since: float | None = None
        #: Settlements waiting for the store; leasing waits while there are any.
        self._unstored = 0
        self._stored = anyio.Event()
        #: Set when results waiting for the store are to be given up (drain, fatal).
        self._give_up = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._running: dict[str, _Running] = {}
        #: Jobs leased and not yet done running (launched or waiting for a slot, up to
        #: ``concurrency + prefetch``); see `_vacate`.
        self._busy = 0
        #: Run slots: held from launch to the end of the run.
        self._slots = _Slots(concurrency)
        self._draining = False
        self._lease_scope: anyio.CancelScope | None = None
        self._slot_freed = anyio.Event()
        self._stopped = anyio.Event()
        self._acks: _Batcher[tuple[Lease, Result], bool] = _Batcher(
            lambda item: broker.ack(*item), broker.ack_many
        )
        self._starts: _Batcher[Lease, bool] = _Batcher(
            broker.mark_started, broker.mark_started_many
        )
        # With many slots, leasing one job each time one finishes turns every lease into
        # a transaction of one; waiting for a quarter of the slots keeps batches large.
        # With few slots (native jobs) every free slot is filled at once.
        self._lease_min = max(1, concurrency // 4) if concurrency >= 16 else 1
        #: Counters for status and tests: leased, acked, retried, rejected, released.
        self.stats: dict[str, int] = {
            "leased": 0,
            "finished": 0,
            "rejected": 0,
            "retried": 0,
            "dead": 0,
            "released": 0,
            "lease_lost": 0,
            "broker_errors": 0,
            "unsettled": 0,
        }

    # --- the loop ---------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Jobs in flight right now."""
        return len(self._running)

    def protected_paths(self) -> tuple[str, ...]:
        """The worker's own paths no ``fs:*`` hint may reach (`plan_invocation`'s
        ``protected``): the executors root and every executor folder, the queue database
        and its ``-wal``/``-shm``, the state folder, blob store and journals, the verified
        and wasm caches, the provider skills root. Real paths; computed once per staging."""
        key = id(self._staging)
        if self._protected is not None and self._protected[0] == key:
            return self._protected[1]
        paths: list[str] = []
        root = self.registry.root
        if root is not None:
            paths.append(os.fspath(root))
        paths += [self.registry[name].path for name in self.registry]
        paths += list(self.registry.error_folders.values())
        db = getattr(self.broker, "path", None)  # a file-backed broker (SQLite)
        if isinstance(db, (str, os.PathLike)):
            paths += [os.fspath(db) + suffix for suffix in ("", "-wal", "-shm", "-journal")]
        if self._staging is not None:
            staging = self._staging
            paths += [os.fspath(p) for p in (staging.state_dir, staging.store.root)]
            paths.append(os.fspath(staging.journal.folder))
        else:
            paths.append(os.fspath(default_state_dir()))
        paths += [os.fspath(default_verified_dir()), os.fspath(default_cache_dir())]
        if self.trust is not None:
            paths.append(os.fspath(self.trust.verified_dir))
        home = self.home if self.home is not None else os.path.expanduser("~")
        paths.append(self.skills_root or default_skills_root(home))
        real = tuple(dict.fromkeys(os.path.realpath(p) for p in paths))
        self._protected = (key, real)
        return real

    @property
    def staging(self) -> Staging:
        """The worker's `Staging` (made at first use when none was given)."""
        if self._staging is None:
            self._staging = Staging(default_state_dir(queue=self.broker.queue_id))
        journal = self._staging.journal
        if not journal.queue:
            # Its journals name this queue: no other queue's worker settles them; and
            # its blobs are noted as this queue's (no other queue's worker collects them).
            journal.queue = self.broker.queue_id
            self._staging.serves(journal.queue)
        return self._staging

    async def recover(self) -> None:
        """Settle the commit journals of workers that died mid-commit (see
        `Staging.recover`); a broker that fails now is tried again at the next call."""
        try:
            await self.staging.recover(self.broker, device=self.device)
        except Exception as exc:
            # Owed: until it is done, every job that writes waits for it (`_recover_for`).
            self._unrecovered = isinstance(exc, BrokerError)
            _log.error(
                "worker.error", error=f"journal recovery failed: {type(exc).__name__}: {exc}"
            )
        else:
            self._unrecovered = False

    def _owes_recovery(self, lease: Lease) -> bool:
        """Whether `lease`'s job must wait for the journal recovery before it touches its
        folders: a redelivery (its last worker may have died mid-commit), or any job while
        a recovery the store cut short is owed (a job run on a half-committed tree has its
        changes committed under the dead job's, which then cannot be rolled back)."""
        return lease.attempt > 1 or self._unrecovered

    async def _recover_for(self, lease: Lease) -> bool:
        """Settle the journals of dead workers before a redelivered job touches its
        folders: its last worker may have died mid-commit, and a run on a half-committed
        tree would commit its changes a second time. A store that fails is asked again
        with backoff (the lease is heart-beaten meanwhile). ``False``: the worker gave up
        (it stops); the job must not run."""
        failures = 0
        while True:
            try:
                await self.staging.recover(self.broker, device=self.device)
                self._unrecovered = False
                return True
            except BrokerError as exc:
                failures += 1
                self._broker_failed("recover", exc, job_id=lease.job.id)
                if self._give_up.is_set() or self._draining:
                    return False
                with anyio.move_on_after(self.store_backoff(failures)):
                    await self._give_up.wait()
            except Exception as exc:  # not the store: as at start, said and left
                _log.error(
                    "worker.error", error=f"journal recovery failed: {type(exc).__name__}: {exc}"
                )
                return True

    async def run(
        self,
        *,
        burst: bool = False,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until `drain` is called (or, with ``burst=True``, until the queue is empty).

        Args:
            burst: return once no job is ready and none is running (deterministic tests,
                one-shot batch runs). Jobs delayed for a retry are not waited for.
            task_status: signalled once the worker is ready to lease (use ``tg.start``).
        """
        _log.info(
            "worker.started",
            worker=self.worker_id,
            device=self.device,
            backend=sniffio.current_async_library(),
            concurrency=self.concurrency,
            visibility_s=self.visibility_s,
            executors=sorted(self.registry),
            burst=burst,
        )
        for name, exc in sorted(self.registry.errors.items()):
            _log.warning("executor.load_failed", executor=name, error=exc.message)
        try:
            weak = await self.broker.durability()
        except Exception:
            weak = None  # the store's own failures are said by the calls that need it
        if weak is not None:
            _log.warning("broker.not_durable", detail=weak)
        if self._staging is not None or self._needs_staging():
            # Before the first lease: a commit a dead worker left half-done is completed or
            # rolled back before any job can see it; then the blobs nobody needs go.
            with structlog.contextvars.bound_contextvars(worker=self.worker_id, device=self.device):
                await self.recover()
                try:
                    await self.staging.collect(self.broker)
                except Exception as exc:  # e.g. a broker without undo storage
                    _log.warning(
                        "worker.error", error=f"blob collection: {type(exc).__name__}: {exc}"
                    )
        publishes = self.device == SERVER_DEVICE and bool(self.registry)
        published = await self._publish_executors() if publishes else False
        if self._stopped.is_set():
            # A second run (burst mode, tests): a drain waiting now waits for this one.
            self._stopped = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                # One heartbeat task for all running jobs, not one per job: a task per job
                # would cost more than the echo arm's whole run.
                tg.start_soon(self._heartbeat_loop, name="heartbeats")
                tg.start_soon(self._cancel_poll_loop, name="cancel polls")
                if self.retention_s is not None:
                    tg.start_soon(self._retention_loop, self.retention_s, name="retention")
                if publishes:
                    tg.start_soon(self._catalog_loop, published, name="catalog")
                task_status.started()
                async with anyio.create_task_group() as jobs:
                    await self._lease_loop(jobs, burst=burst)
                tg.cancel_scope.cancel()
        finally:
            self._tg = None
            if self._owns_staging and self._staging is not None:
                with anyio.CancelScope(shield=True):
                    await self._staging.aclose()  # the staging helper process
            self._stopped.set()
            # Whatever happened above: an operator must see that the worker stopped, and
            # why (the logger itself never raises, see `logs`).
            _log.log(
                logging.ERROR if self.fatal_error is not None else logging.INFO,
                "worker.stopped",
                worker=self.worker_id,
                device=self.device,
                error=self.fatal_error.code if self.fatal_error is not None else None,
                **self.stats,
            )

    async def _publish_executors(self) -> bool:
        """Tell the broker what this server worker runs (`catalog`): a submit can then
        refuse a device job whose executor must stay on the server. A failure only delays
        that refusal to the device's lease; it never stops the worker (`_catalog_loop`
        tries again). Returns whether it worked."""
        from ..devices.catalog import ExecutorInfo

        infos = [
            ExecutorInfo(name=name, manifest=self.registry[name].manifest, worker=self.worker_id)
            for name in sorted(self.registry)
        ]
        try:
            await self.broker.publish_executors(infos)
        except Exception as exc:
            self._broker_failed("publish_executors", exc)
            return False
        return True

    async def _catalog_loop(self, published: bool) -> None:
        """Publish the executors again: after a failed publication (with the store's
        backoff), as soon as the store is back after failing, and every
        ``catalog_every_s`` in any case, so a broker that lost the catalog while the
        worker ran (Redis restarted without persistence, a queue file replaced) has it
        back without a restart. Until then a device job for a server-only executor is
        queued and refused by the device at lease time (`catalog`), never run there."""
        failures = 0 if published else 1
        while True:
            delay = self.store_backoff(failures) if failures else self.catalog_every_s
            with anyio.move_on_after(delay):
                await self._republish.wait()
            if self._republish.is_set():
                self._republish = anyio.Event()
            failures = 0 if await self._publish_executors() else failures + 1

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
                tg.start_soon(self._job_task, running, name=f"job {lease.job.id}")

    async def _wait_slot(self) -> None:
        # Two loops wait here at once (leasing and drain). Only the first to wake swaps
        # in a fresh event: a second swap would strand the first waiter on an event
        # nobody sets any more (a drain then hung for its whole grace).
        event = self._slot_freed
        await event.wait()
        if self._slot_freed is event:
            self._slot_freed = anyio.Event()

    async def wait_stopped(self) -> None:
        """Return once `run` has returned."""
        await self._stopped.wait()

    # --- the store --------------------------------------------------------------------

    def _broker_failed(self, op: str, exc: Exception, **fields: Any) -> None:
        """Log a failed broker call; a fatal store error stops the worker.

        Only the calls on the path of new work (`_GATING`) hold the lease loop back; a
        failed heartbeat, purge or catalog update is said and left to its own next try.
        """
        self.stats["broker_errors"] += 1
        if op in _GATING:
            self._store_failures += 1
            if self._store_down_since is None:
                self._store_down_since = time.monotonic()
        if isinstance(exc, MetnosError):
            code, error = exc.code, exc.message
        else:  # a client library's own exception, or a bug: said as it is
            code, error = HostFault.code, f"{type(exc).__name__}: {exc}"
        fatal = isinstance(exc, BrokerError) and exc.fatal
        _log.error(
            "broker.error",
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
            down = time.monotonic() - (self._store_down_since or time.monotonic())
            _log.info(
                "broker.recovered", op=op, failures=self._store_failures, down_s=round(down, 3)
            )
            self._store_failures = 0
            self._store_down_since = None
            self._republish.set()

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

    async def _retention_loop(self, retention_s: float) -> None:
        while True:
            try:
                report = await self.broker.purge(older_than_s=retention_s)
            except Exception as exc:
                self._broker_failed("purge", exc)
            else:
                if report.jobs or report.collected:
                    _log.info(
                        "queue.purged",
                        jobs=report.jobs,
                        collected=report.collected,
                        reclaimed_bytes=report.reclaimed_bytes,
                        older_than_s=retention_s,
                    )
                if (report.jobs or report.collected) and self._staging is not None:
                    # The undo entries went with their results: the blobs only they
                    # needed go now (never one a stored entry still lists).
                    try:
                        await self._staging.collect(self.broker)
                    except Exception as exc:
                        self._broker_failed("collect_blobs", exc)
            await anyio.sleep(self.purge_every_s)

    async def drain(self, grace_s: float) -> None:
        """Stop leasing; let running jobs finish for `grace_s`, then cancel and release them.

        Released jobs go back to the queue without using an attempt (the broker's
        `release`). Results still waiting for a failing store get ``settle_grace_s``
        more (none when `grace_s` is 0: a forced stop), then are given up. Returns once
        `run` has returned.
        """
        if not self._draining:
            self._draining = True
            _log.info(
                "worker.draining",
                worker=self.worker_id,
                device=self.device,
                running=len(self._running),
                grace_s=grace_s,
            )
        if self._lease_scope is not None:
            self._lease_scope.cancel()
        for running in list(self._running.values()):
            if not running.launched:
                # Leased ahead, never started: hand it back now, not after the grace.
                running.stop = "drain"
                running.scope.cancel()
        self._slot_freed.set()
        with anyio.move_on_after(grace_s):
            while self._running:
                await self._wait_slot()
        for running in list(self._running.values()):
            if running.settling:
                continue  # finished; its result is being stored
            running.stop = "drain"
            running.scope.cancel()
        with anyio.move_on_after(min(grace_s, self.settle_grace_s)):
            await self._stopped.wait()
        self._give_up.set()
        await self._stopped.wait()

    # --- one job ----------------------------------------------------------------------

    async def _job_task(self, running: _Running) -> None:
        lease = running.lease
        job = lease.job
        try:
            # Bound for the rest of this task, which is the job's own: each task runs in
            # its own copy of the context (asyncio and trio alike), so nothing bound here
            # reaches another job or the lease loop, and there is nothing to restore
            # (structlog's `bound_contextvars` scans and restores the whole context: a
            # twentieth of an echo job's CPU).
            structlog.contextvars.bind_contextvars(
                job_id=job.id,
                executor=job.executor,
                worker=self.worker_id,
                device=self.device,
                # Rebound as soon as the executor (hence the arm) is known; present from
                # the first record so every record of the job has the key (spec §9).
                sandbox=None,
                attempt=lease.attempt,
                # Unbound (no key) unless the job has one.
                **({} if job.correlation_id is None else {"correlation_id": job.correlation_id}),
            )
            try:
                await self._serve(running)
            except Exception as exc:
                # A bug in our own pipeline must not stop the worker serving others;
                # the job is retried like a host fault (the harness broke, not the job).
                _log.exception("worker.error", error=f"{type(exc).__name__}: {exc}")
                with anyio.CancelScope(shield=True):
                    await self._retry(
                        lease,
                        ErrorInfo(code=HostFault.code, message=f"internal error: {exc}"),
                    )
        finally:
            self._running.pop(job.id, None)
            self._slots.drop(running)  # rejected, or stopped while waiting for a slot
            self._vacate(running)
            self._slot_freed.set()

    def _vacate(self, running: _Running) -> None:
        """Give the job's slot back once nothing of it runs any more.

        Called as soon as the sandbox is done (before the result is stored), so the next
        job's lease and launch overlap with this one's ack: ``concurrency`` bounds
        executors running at once, not results in flight.
        """
        if running.holds_slot:
            running.holds_slot = False
            self._busy -= 1
            self._slot_freed.set()

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
        with anyio.CancelScope(shield=True):
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
            self.stats["lease_lost"] += 1
            _log.warning("lease.lost", visibility_s=self.visibility_s, during="retry")

    def _needs_staging(self) -> bool:
        return any(
            cap.name == "fs:write"
            for name in self.registry
            for cap in self.registry[name].manifest.capabilities
        )

    async def _serve(self, running: _Running) -> None:
        lease = running.lease
        job = lease.job
        if job.executor == UNDO_EXECUTOR:
            await self._serve_undo(running)
            return
        try:
            executor = self.registry.get_executor(job.executor)
        except MetnosError as load_error:
            _log.info("job.received", max_attempts=job.max_attempts, timeout_s=job.timeout_s)
            refusal: MetnosError = load_error
            folder = self.registry.error_folders.get(job.executor)
            if self.trust is not None and folder is not None:
                # Tampering is the finding, not the load error it caused.
                try:
                    await anyio.to_thread.run_sync(self.trust.verify_folder, folder, job.executor)
                except SignatureError as sig:
                    refusal = sig
                except MetnosError:
                    pass  # signed as it is: the load error stands
            await self._reject(lease, refusal)
            return
        # Before the choice, which may log (``sandbox.degraded``) or refuse the job.
        running.sandbox = self.predict_arm(executor.manifest.runtime)
        structlog.contextvars.bind_contextvars(sandbox=running.sandbox)
        _log.info("job.received", max_attempts=job.max_attempts, timeout_s=job.timeout_s)
        try:
            if self.trust is not None:
                # Before planning: the plan (and the run) use the verified private copy,
                # its manifest parsed from the signed bytes. Cached: a stat per file.
                checked = self.trust.cached(executor)
                if checked is None:
                    checked = await anyio.to_thread.run_sync(self.trust.verify, executor)
                executor = checked
            invocation = plan_invocation(
                executor,
                job.args,
                autonomy=job.autonomy,
                home=self.home,
                skills_root=self.skills_root,
                policy=self.policy,
                timeout_s=job.timeout_s,
                python=self.python,
                text_args=job.text_args,
                protected=self.protected_paths(),
            )
            if invocation.server_pinned and self.device != SERVER_DEVICE:
                # Provider authority (or a non-packable executor) never leaves the server,
                # even if a producer targeted a device by mistake.
                raise ServerPinned(
                    f"{job.executor} is pinned to the server (provider authority or not "
                    f"packable); device {self.device!r} may not run it"
                )
            choice = self.arm_chooser(
                invocation.runtime, require_sandbox=invocation.require_sandbox
            )
        except MetnosError as exc:
            await self._reject(lease, exc)
            return
        arm: Sandbox = choice.sandbox
        if arm.name != running.sandbox:
            running.sandbox = arm.name
            structlog.contextvars.bind_contextvars(sandbox=arm.name)
        # The job's timeout_s is applied by the planner (it may only shorten the manifest's).
        sjob = invocation.job
        for item in invocation.inactive:
            _log.info("capability.inactive", detail=item)
        reversible: Reversible | None = None
        if invocation.write_roots:
            # A redelivery: its last worker may have died mid-commit; settle that first,
            # so this run starts from a tree that is whole.
            if self._owes_recovery(lease) and not await self._recover_for(lease):
                await self._release(lease, "the store failed while a commit was recovered")
                return
            try:
                reversible = await self.staging.prepare(
                    job_id=job.id,
                    executor=job.executor,
                    device=self.device,
                    job=sjob,
                    write_roots=invocation.write_roots,
                    write_targets=invocation.write_targets,
                    arm_stages=getattr(arm, "stages_writes", False),
                )
            except MetnosError as exc:
                # A write root that is no longer the folder the plan checked (a symlink
                # swapped in on the way: E_SYMLINKED_FOLDER): the job's own refusal.
                await self._reject(lease, exc)
                return
            except (HostFault, OSError) as exc:
                error = exc if isinstance(exc, HostFault) else HostFault(f"staging failed: {exc}")
                await self._retry(lease, ErrorInfo(code=error.code, message=error.message))
                return
        try:
            if reversible is not None:
                sjob = reversible.job
                if reversible.no_staging is not None:
                    lost = getattr(reversible, "lost", "")
                    _log.warning(
                        "sandbox.degraded",
                        requested="staging",
                        used="backup",
                        reason="no_staging",
                        axes_lost=["resources"],
                        detail=f"{lost}",
                    )
            outcome, fault, started_at = await self._run_arm(
                running,
                arm,
                sjob,
                degraded=bool(choice.degraded) or bool(reversible and reversible.no_staging),
            )
            await self._settle_run(running, arm, sjob, reversible, outcome, fault, started_at)
        finally:
            if reversible is not None:
                # Whatever happened, nothing staged outlives the job (normally discarded or
                # settled already; then this is a no-op).
                with anyio.CancelScope(shield=True):
                    await reversible.discard(restore=running.stop != "lease_lost")

    async def _settle_run(
        self,
        running: _Running,
        arm: Sandbox,
        sjob: SandboxJob,
        reversible: Reversible | None,
        outcome: SandboxOutcome | None,
        fault: HostFault | MetnosError | None,
        started_at: float | None,
    ) -> None:
        """Turn how the run ended into a result (and a commit, for a staged success)."""
        lease = running.lease
        method = None if reversible is None else reversible.method

        def contained(report: ContainmentReport) -> ContainmentReport:
            return disk_verdict(report, method=method, disk_bytes=sjob.limits.disk_bytes)

        if reversible is not None and (
            running.stop is not None
            or fault is not None
            or outcome is None
            or (isinstance(outcome.exit, Failure) and outcome.exit.code == EX_TEMPFAIL)
        ):
            # Nothing of this run is kept: drop it *before* the job goes back to the queue
            # or gets its result (a backup run puts its targets back now, while no other
            # delivery can be writing them; not after a lost lease, when one may be).
            with anyio.CancelScope(shield=True):
                await reversible.discard(restore=running.stop != "lease_lost")

        measured = running.measured
        if measured is not None and (running.stop not in (None, "cancel_requested") or fault):
            # A run stopped once launched that gets no result here (released, lost to
            # another worker, retried): its record says what it used and what held. A
            # cancelled or backstopped run's result says it.
            _log.info(
                "job.stopped",
                reason=running.stop or "host_fault",
                usage=measured.usage,
                containment=_containment_summary(measured.containment),
            )

        def stopped_report() -> ContainmentReport:
            # A launched run's containment is the one measured, never the plan.
            return contained(arm.containment(sjob) if measured is None else measured.containment)

        if running.stop == "lease_lost":
            _log.warning("lease.lost", visibility_s=self.visibility_s)
            # The broker may already have handed the job to another worker: acking or
            # retrying now would race it. Redelivery is the broker's job.
            self.stats["lease_lost"] += 1
            return
        if running.stop == "drain":
            await self._release(lease, "drain")
            return
        if running.stop == "not_started":
            # The store failed as the job was about to start: nothing was launched, and
            # the lease goes back (un-attempted) once the store takes it.
            await self._release(lease, "store_error")
            return
        if running.stop == "cancel_requested":
            _log.info("job.cancelled")
            await self._ack(
                lease,
                self._result(
                    lease,
                    "cancelled",
                    error=ErrorInfo(code="E_CANCELLED", message="the job was cancelled"),
                    containment=stopped_report(),
                    # What the arm measured of the run it was made to stop; else (an arm
                    # that cannot tell) its wall time; none if it never launched.
                    usage=_stopped_usage(measured, started_at, self.clock),
                    started_at=started_at,
                ),
            )
            return
        if fault is not None:
            if isinstance(fault, MetnosError):
                await self._reject(lease, fault)
            else:
                await self._retry(lease, ErrorInfo(code=fault.code, message=fault.message))
            return
        if outcome is None:
            # Our backstop fired: the arm overran its own wall-time budget.
            assert started_at is not None  # no stop: the slot was taken, the arm ran
            await self._ack(
                lease,
                self._result(
                    lease,
                    "timed_out",
                    exit=Timeout(),
                    error=ErrorInfo(
                        code="E_TIMEOUT",
                        message=f"the job exceeded {sjob.limits.wall_time_s:g} s",
                    ),
                    containment=stopped_report(),
                    usage=_stopped_usage(measured, started_at, self.clock),
                    started_at=started_at,
                ),
            )
            return
        if isinstance(outcome.exit, Failure) and outcome.exit.code == EX_TEMPFAIL:
            stderr, _ = cap_text(outcome.stderr, 512)
            await self._retry(
                lease,
                ErrorInfo(
                    code="E_TEMPFAIL",
                    message=f"the executor asked to be retried (exit 75): {stderr.strip()}",
                ),
            )
            return
        assert started_at is not None  # an outcome: the arm ran
        result = _outcome_result(self, lease, outcome, started_at)
        if reversible is None:
            await self._ack(lease, result)
            return
        if outcome.containment is not None:
            result = msgspec.structs.replace(result, containment=contained(outcome.containment))
        if result.status != "succeeded":
            exceeded = reversible.disk_exceeded()
            with anyio.CancelScope(shield=True):
                await reversible.discard()
            if exceeded:
                budget = (sjob.limits.disk_bytes or 0) / (1024 * 1024)
                result = msgspec.structs.replace(
                    result,
                    error=ErrorInfo(
                        code="E_DISK",
                        message=f"the job filled its {budget:g} MiB disk budget "
                        "(limits.disk_mb); nothing was committed",
                    ),
                )
            await self._ack(lease, result)
            return
        running.committing = True
        try:
            await self._commit(lease, result, reversible)
        finally:
            running.committing = False

    async def _commit(self, lease: Lease, result: Result, reversible: Reversible) -> None:
        """Commit a succeeded job's changes, record their undo entry, ack the result."""
        with anyio.CancelScope(shield=True):
            try:
                # Still ours? A commit for a job the broker gave to another worker would
                # apply the same changes twice.
                reply = await self.broker.heartbeat(lease)
            except Exception:
                reply = None  # the broker will tell at record_undo
            if reply is not None and not reply.ok:
                self.stats["lease_lost"] += 1
                _log.warning("lease.lost", visibility_s=self.visibility_s, during="commit")
                return
            try:
                committed = await reversible.commit()
            except CommitConflict as exc:
                await self._ack(
                    lease,
                    msgspec.structs.replace(
                        result,
                        status="failed",
                        error=ErrorInfo(code=exc.code, message=exc.message),
                    ),
                )
                return
            except (HostFault, OSError, Blocked) as exc:
                # Rolled back already (see journal.apply_ops): nothing of it is applied.
                text = exc.message if isinstance(exc, HostFault) else str(exc)
                await self._retry(
                    lease, ErrorInfo(code=HostFault.code, message=f"commit failed: {text}")
                )
                return
            for path, what in committed.filtered[:_FILTERED_LOGGED]:
                _log.warning("commit.filtered", path=path, what=what)
            entry = committed.entry
            if entry is None:
                await self._ack(lease, result)
                return
            # A store that fails is tried again with backoff, the lease kept alive, as
            # for an ack: throwing a good commit away would cost the job an attempt.
            recorded = await self._settle(
                "record_undo", lease, lambda: self.broker.record_undo(lease, [entry])
            )
            if not recorded:
                # Not ours any more (or given up: the worker stops): the changes go, the
                # job is delivered again.
                await reversible.settle(stored=False)
                if recorded is False:
                    self.stats["lease_lost"] += 1
                    _log.warning("lease.lost", visibility_s=self.visibility_s, during="commit")
                return
            try:
                stored = await self._ack(
                    lease, msgspec.structs.replace(result, undo_ids=(entry.id,))
                )
            except BaseException:
                # Whether the result was stored is unknown: the journal stays, and
                # `recover` decides once the broker answers (see Staging.recover).
                await reversible.abandon()
                raise
            await reversible.settle(stored=stored)
            if stored:
                _log_recorded(entry)

    async def _serve_undo(self, running: _Running) -> None:
        """Run an undo job (see `metnos_exec.undo.apply`): no sandbox, no executor."""
        lease = running.lease
        job = lease.job
        _log.info("job.received", max_attempts=job.max_attempts, timeout_s=job.timeout_s)
        target = job.args.get("job_id")
        if not isinstance(target, str) or not target or set(job.args) != {"job_id"}:
            await self._reject(
                lease, BadArguments(f"{UNDO_EXECUTOR} takes one argument, job_id (a job id)")
            )
            return
        staging = self.staging
        # Its last worker may have died mid-undo.
        if self._owes_recovery(lease) and not await self._recover_for(lease):
            await self._release(lease, "the store failed while a commit was recovered")
            return
        try:
            entries = await entries_to_undo(self.broker, target, device=self.device)
        except UndoUnavailable as exc:
            await self._reject(lease, exc)
            return
        _log.info("job.started", undo_of=target, entries=[e.id for e in entries])
        started_at = self.clock()
        # An undo is a committer of its folders like a commit: from its first check to its
        # settlement no other commit, undo or roll-back of them runs (`folder_lock`).
        held: FolderLock | None = None
        try:
            async with staging.commit_lock:
                roots = tuple(dict.fromkeys(root for e in entries for root in e.roots))
                held = await anyio.to_thread.run_sync(FolderLock, roots)
                applied = await anyio.to_thread.run_sync(
                    functools.partial(
                        apply_undo,
                        entries,
                        job_id=target,
                        undo_job_id=job.id,
                        device=self.device,
                        store=staging.store,
                        journal=staging.journal,
                        fsync=staging.fsync,
                    )
                )
        except MetnosError as exc:  # UndoConflict: nothing changed
            if held is not None:
                held.release()
            await self._reject(lease, exc)
            return
        except (HostFault, OSError, Blocked) as exc:
            if held is not None:
                held.release()
            await self._retry(lease, ErrorInfo(code=HostFault.code, message=f"undo failed: {exc}"))
            return
        except BaseException:
            if held is not None:
                held.release()
            raise
        assert held is not None
        with held, anyio.CancelScope(shield=True):
            recorded = await self._settle(
                "record_undo",
                lease,
                lambda: self.broker.record_undo(
                    lease, [applied.redo], undoes=[e.id for e in entries]
                ),
            )
            if not recorded:
                await anyio.to_thread.run_sync(functools.partial(applied.settle, stored=False))
                if recorded is False:
                    self.stats["lease_lost"] += 1
                    _log.warning("lease.lost", visibility_s=self.visibility_s, during="undo")
                return
            paths = applied.redo.paths()
            result = self._result(
                lease,
                "succeeded",
                output={
                    "undone": target,
                    "entries": [e.id for e in entries],
                    "paths": len(paths),
                },
                undo_ids=(applied.redo.id,),
                started_at=started_at,
            )
            try:
                stored = await self._ack(lease, result)
            except BaseException:
                applied.handle.close(remove=False)  # recover() decides, see _commit
                applied.tree.close()
                raise
            left = await anyio.to_thread.run_sync(functools.partial(applied.settle, stored=stored))
            if stored:
                _log.info(
                    "undo.applied",
                    undone=target,
                    entries=[e.id for e in entries],
                    paths=paths[:_PATHS_LOGGED],
                    path_count=len(paths),
                )
                _log_recorded(applied.redo)
            elif left:
                _log.warning(
                    "undo.conflict",
                    reason="roll-back left paths",
                    paths=[str(c) for c in left[:20]],
                )

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

    async def _mark_started(self, running: _Running) -> None:
        """Record the delivery as started, or set why it must not start."""
        # Shielded: once asked, the answer must be read (a mark made but not seen would
        # leave an attempt counted for a job this worker then hands back).
        with anyio.CancelScope(shield=True):
            try:
                ok = await self._starts(running.lease)
            except Exception as exc:
                self._broker_failed("mark_started", exc)
                running.stop = running.stop or "not_started"
                return
        self._broker_ok("mark_started")
        if not ok:
            running.stop = running.stop or "lease_lost"

    async def _run_arm(
        self, running: _Running, arm: Sandbox, sjob: SandboxJob, *, degraded: bool
    ) -> tuple[SandboxOutcome | None, HostFault | MetnosError | None, float | None]:
        """Wait for a slot, launch, run; ``started_at`` is ``None`` if it never launched."""
        outcome: SandboxOutcome | None = None
        fault: HostFault | MetnosError | None = None
        started_at: float | None = None
        with running.scope:
            # Inside the job's scope: a cancel, a lost lease or a drain reaches a job
            # still waiting for its slot too.
            await self._slots.acquire(running)
            try:
                if running.stop is None and not self._draining and not running.lease.started:
                    await self._mark_started(running)
                if running.stop is not None or self._draining:
                    # Stopped (drain, cancel, lost lease, a store failure) before its
                    # launch, e.g. while it was being prepared: it never starts, and no
                    # job.started is logged.
                    running.stop = running.stop or "drain"
                else:
                    running.launched = True
                    _log.info("job.started", timeout_s=sjob.limits.wall_time_s, degraded=degraded)
                    started_at = self.clock()
                    # The backstop is this scope's deadline rather than a scope of its
                    # own (one scope less per job): a run it cuts short ends with no
                    # outcome and no stop reason, which is how it is told apart.
                    running.scope.deadline = (
                        anyio.current_time() + sjob.limits.wall_time_s + self.backstop_margin_s
                    )
                    with stopped_outcomes() as stopped:
                        try:
                            outcome = await arm.run(sjob)
                        except (HostFault, MetnosError) as exc:
                            fault = exc
                        finally:
                            running.measured = stopped[-1] if stopped else None
                # Before the slot is given back: a heartbeat must not act on a run that
                # is over.
                running.settling = True
            finally:
                # The run slot first: the job waiting for it is woken before the lease
                # loop (woken by `_vacate`), so the next executor starts before any
                # bookkeeping of this one.
                self._slots.release()
        running.settling = True  # also when stopped while waiting: nothing of it runs
        # The next job may be leased while this result is stored.
        self._vacate(running)
        if started_at is not None:
            # Let the next job launch (it was woken above) before this one's result is
            # stored and logged: a bookkeeping gap between two runs is idle slot time.
            # Twice: trio may run a batch of ready tasks in reverse order, so after one
            # yield this task could still go first; after two, the woken job has run (up
            # to its spawn) either way. Three times when that job was leased ahead: it
            # yields once itself, in the store call that marks it started. Shielded (one
            # scope for all of them: a scope each cost more than the yields): the run is
            # over, and its result must not be lost to a cancel.
            with anyio.CancelScope(shield=True):
                for _ in range(3 if self._slots.head_waits_for_mark() else 2):
                    await anyio.lowlevel.checkpoint()
        return outcome, fault, started_at


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


def _log_recorded(entry: UndoEntry) -> None:
    paths = entry.paths()
    _log.info(
        "undo.recorded",
        entry_id=entry.id,
        method=entry.method,
        ops=len(entry.ops),
        paths=paths[:_PATHS_LOGGED],
        path_count=len(paths),
        blobs=sorted(entry.blobs())[:_PATHS_LOGGED],
        reverses=entry.reverses,
    )


def _stopped_usage(
    measured: SandboxOutcome | None, started_at: float | None, clock: Callable[[], float]
) -> Usage | None:
    """The usage of a run stopped from outside: measured by its arm, else its wall time
    (``None``: it never launched)."""
    if measured is not None:
        return measured.usage
    return None if started_at is None else Usage(wall_s=clock() - started_at)


def _containment_summary(report: ContainmentReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {"sandbox": report.sandbox, **{k: v.state for k, v in report.axes().items()}}


def _outcome_result(
    sup: Supervisor, lease: Lease, outcome: SandboxOutcome, started_at: float
) -> Result:
    exit_ = outcome.exit
    stderr, stderr_cut = cap_text(outcome.stderr)
    common: dict[str, Any] = {
        "exit": exit_,
        "stderr": stderr,
        "stderr_truncated": outcome.stderr_truncated or stderr_cut,
        "stdout_truncated": outcome.stdout_truncated,
        "containment": outcome.containment,
        "usage": outcome.usage,
        "started_at": started_at,
        "egress": outcome.egress,
    }
    output, bad = _parse_output(outcome.stdout)
    if isinstance(exit_, Success):
        if bad is not None:
            return sup._result(lease, "failed", output=output, error=bad, **common)
        return sup._result(lease, "succeeded", output=output, **common)
    if isinstance(exit_, Timeout):
        budget = lease.job.timeout_s
        limit = f"{budget:g} s" if budget is not None else "manifest"
        err = ErrorInfo(code="E_TIMEOUT", message=f"the job exceeded its {limit} wall-time budget")
        return sup._result(lease, "timed_out", output=output, error=err, **common)
    return sup._result(lease, "failed", output=output, error=_exit_error(exit_), **common)


def _exit_error(exit_: SandboxExit) -> ErrorInfo:
    if isinstance(exit_, Failure):
        return ErrorInfo(code="E_EXIT", message=f"the executor exited with code {exit_.code}")
    if isinstance(exit_, Killed):
        why = f" ({exit_.limit} limit)" if exit_.limit else ""
        return ErrorInfo(
            code="E_KILLED", message=f"the executor was killed by signal {exit_.signal}{why}"
        )
    if isinstance(exit_, MemoryExceeded):
        return ErrorInfo(code="E_MEMORY", message="the executor exceeded its memory budget")
    if isinstance(exit_, FuelExhausted):
        return ErrorInfo(code="E_FUEL", message="the executor ran out of fuel")
    if isinstance(exit_, Trap):
        return ErrorInfo(code="E_TRAP", message=f"the guest trapped: {exit_.message}")
    return ErrorInfo(code="E_FAILED", message=f"the executor ended with {exit_!r}")


_ANY_JSON = msgspec.json.Decoder()


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests arrays/objects more than `limit` levels (iterative: a
    recursive walk would fail exactly where this check is needed)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _parse_output(stdout: bytes) -> tuple[Any, ErrorInfo | None]:
    """One JSON document, or the raw text (capped) and an ``E_BAD_OUTPUT`` error.

    Whatever the bytes are, the answer is one of those two: no input from a job may
    surface as an internal error or a host fault.
    """
    if not stdout.strip():
        return None, ErrorInfo(
            code="E_BAD_OUTPUT", message="the executor wrote nothing to stdout (expected JSON)"
        )
    try:
        value = _ANY_JSON.decode(stdout)
    except msgspec.DecodeError as exc:
        why = f"stdout is not one JSON document ({exc})"
    except RecursionError:
        why = f"stdout nests arrays or objects deeper than {MAX_OUTPUT_DEPTH} levels"
    else:
        # Only a document with more brackets than the limit can be deeper than it: the
        # common case costs two counts in C, not a walk.
        brackets = stdout.count(b"[") + stdout.count(b"{")
        if brackets <= MAX_OUTPUT_DEPTH or not _deeper_than(value, MAX_OUTPUT_DEPTH):
            return value, None
        why = f"stdout nests arrays or objects deeper than {MAX_OUTPUT_DEPTH} levels"
    raw, _ = cap_text(stdout, RAW_OUTPUT_CAP_BYTES)
    return raw, ErrorInfo(code="E_BAD_OUTPUT", message=f"{why}; the raw text is in output")
