"""What every part of the supervisor shares: the settings it was given (its
`SupervisorConfig`), its collaborators, the jobs in flight (`_Running`) and the counters.

`SupervisorState` is the base of the `Supervisor` class, which is built in layers, one
module each, every layer using only those below it: `settle` (storing settlements with
backoff), `leasing` (the lease loop, heartbeats, cancel polls, run slots), `commits`
(the staging, commits, and the journals dead workers left), `undo_jobs`, `pipeline` (one
job), and the facade (`core`). Each layer sets up its own state in `_init_parts`; the two
calls that go up a layer (`drain`, `_job_task`) are declared here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
import anyio.abc

from ..backoff import retry_delay, store_backoff
from ..brokers.base import Broker, Lease
from ..devices.signing import TrustStore
from ..errors import MetnosError
from ..manifest import ExecutorRegistry
from ..messages import APPROVE_EXECUTOR, CHECKPOINT_EXECUTOR, REJECT_EXECUTOR, UNDO_EXECUTOR
from ..observe import NULL_OBSERVER, Observer
from ..sandbox._types import Sandbox, SandboxOutcome
from ..sandbox.progress import ProgressReport
from ..undo.staging import Staging
from .config import SupervisorConfig

__all__ = ("ArmChooser", "SupervisorState")


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
    #: The latest progress its executor reported (`metnos_exec.sandbox.progress`), with
    #: when it was read (unix s), and the last one given to the store.
    progress: ProgressReport | None = None
    progress_at: float = 0.0
    progress_stored: ProgressReport | None = None

    def note_progress(self, report: ProgressReport, at: float) -> None:
        """The arm's progress sink: kept in memory, stored by `Leasing._progress_loop`."""
        self.progress = report
        self.progress_at = at


class SupervisorState:
    """The state the supervisor's layers share, set up from `config` and the
    collaborators (see `Supervisor` for each argument)."""

    def __init__(
        self,
        broker: Broker,
        registry: ExecutorRegistry,
        config: SupervisorConfig,
        *,
        arm_chooser: ArmChooser | Callable[..., Any] | None = None,
        predict_arm: Callable[[str], str | None] | None = None,
        clock: Callable[[], float] = time.time,
        retry_delay: Callable[[int], float] = retry_delay,
        staging: Staging | None = None,
        trust: TrustStore | None = None,
        store_backoff: Callable[[int], float] = store_backoff,
        observer: Observer = NULL_OBSERVER,
    ) -> None:
        self.broker = broker
        self.registry = registry
        self.config = config
        self._take_settings(config)
        if arm_chooser is None:
            # Imported here so the supervisor module loads without the arms (tests inject
            # doubles; the arms pull in wasmtime lazily anyway).
            from ..sandbox.select import choose_arm

            arm_chooser = choose_arm
            if predict_arm is None:
                predict_arm = _predict_default_arm
        self.arm_chooser = arm_chooser
        self.predict_arm: Callable[[str], str | None] = predict_arm or (lambda runtime: None)
        self.clock = clock
        self.retry_delay = retry_delay
        self._staging = staging
        self._owns_staging = staging is None
        self.trust = trust
        self.store_backoff = store_backoff
        self.observer = observer
        self._tg: anyio.abc.TaskGroup | None = None
        self._started_at: float | None = None
        #: The executors this worker leases (executor routing, `brokers.base`): those it
        #: loaded, those whose manifest failed to load (a job for one is rejected with
        #: the load error, which its author needs to see), and undo jobs.
        self.served: tuple[str, ...] = tuple(
            sorted(
                {
                    *registry,
                    *registry.errors,
                    UNDO_EXECUTOR,
                    CHECKPOINT_EXECUTOR,
                    APPROVE_EXECUTOR,
                    REJECT_EXECUTOR,
                }
            )
        )
        self._running: dict[str, _Running] = {}
        self._draining = False
        self._stopped = anyio.Event()
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
        self._init_parts()

    def _take_settings(self, config: SupervisorConfig) -> None:
        """The settings as attributes (the defaults that depend on others resolved)."""
        self.worker_id = config.worker_id
        self.device = config.device
        self.concurrency = config.concurrency
        self.visibility_s = config.visibility_s
        self.heartbeat_s = (
            config.heartbeat_s if config.heartbeat_s is not None else config.visibility_s / 3
        )
        self.cancel_poll_s = config.cancel_poll_s
        self.prefetch = config.prefetch
        self.policy = config.policy
        # Resolved once, now: ``~`` is this real folder for the worker's whole life, so a
        # link planted in its place later is refused (`sandbox.mount_sources`), not followed.
        # The default too (the worker's own home): resolved per job by the planner, it
        # cost a third of the plan (an ``lstat`` per path component, every job).
        home = config.home
        self.home = os.path.realpath(
            os.fspath(home) if home is not None else os.path.expanduser("~")
        )
        skills_root = config.skills_root
        self.skills_root = os.fspath(skills_root) if skills_root is not None else None
        self.idle_poll_s = config.idle_poll_s
        self.backstop_margin_s = config.backstop_margin_s
        self.python = config.python
        self.retention_s = config.retention_s
        self.purge_every_s = config.purge_every_s
        self.catalog_every_s = config.catalog_every_s
        self.settle_grace_s = config.settle_grace_s
        self.progress_every_s = config.progress_every_s
        self.approval_ttl_s = config.approval_ttl_s
        self.approval_check_s = config.approval_check_s

    def _init_parts(self) -> None:
        """Each layer sets up its own state here (overriding, then calling ``super()``)."""

    def _count_lost(self) -> None:
        """A lease was lost: counted in `stats` and by the observer."""
        self.stats["lease_lost"] += 1
        self.observer.lease_lost()

    @property
    def running(self) -> int:
        """Jobs in flight right now."""
        return len(self._running)

    async def drain(self, grace_s: float) -> None:
        """Stop leasing and hand the running jobs back: the facade's (`Supervisor.drain`);
        a fatal store error starts it (`settle`)."""
        raise NotImplementedError

    async def _job_task(self, running: _Running) -> None:
        """Serve one leased job in its own task: the pipeline's; the lease loop starts it."""
        raise NotImplementedError
