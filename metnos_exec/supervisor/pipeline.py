"""One job, from its lease to its result: vet it, plan it, stage its folders, run its arm,
settle what the run ended with (and commit a staged success).

`_job_task` is the job's own task: it binds the job's log context and serves it
(`_serve`): the executor is looked up (and its signature checked, with a trust store),
the invocation planned (`plan_invocation`), the arm chosen; the writable folders are
staged (`Staging.prepare`); the arm runs in a run slot under the job's cancel scope
(`_run_arm`); `_settle_run` turns how it ended into a result (`outcome`), a retry or a
release, and `_commit` (`commits`) commits a succeeded staged job's changes before its result is
acked.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import structlog

from ..brokers.base import Lease
from ..devices.signing import default_verified_dir
from ..errors import HostFault, MetnosError, ServerPinned, SignatureError
from ..logs import get_logger
from ..manifest import Executor
from ..messages import (
    APPROVE_EXECUTOR,
    CHECKPOINT_EXECUTOR,
    REJECT_EXECUTOR,
    SERVER_DEVICE,
    UNDO_EXECUTOR,
    ErrorInfo,
    Result,
    cap_text,
)
from ..plan import Invocation, default_skills_root, plan_invocation
from ..process.teardown import after_result
from ..sandbox._types import (
    ContainmentReport,
    Failure,
    Sandbox,
    SandboxJob,
    SandboxOutcome,
    Timeout,
    stopped_outcomes,
)
from ..sandbox._wasm_engine import default_cache_dir
from ..sandbox.progress import reporting_progress
from ..undo.staging import Reversible, default_state_dir, disk_verdict
from .checkpoint_jobs import CheckpointJobs
from .gate_jobs import GateJobs
from .outcome import EX_TEMPFAIL, _containment_summary, _outcome_result, _stopped_usage
from .state import _ArmChoice, _Running

__all__ = ("Pipeline",)


_log = get_logger()


class Pipeline(CheckpointJobs, GateJobs):
    """The supervisor's layer that serves one job (see the module docstring)."""

    def _init_parts(self) -> None:
        super()._init_parts()
        self._protected: tuple[int, tuple[str, ...]] | None = None

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
                with self.observer.job(job, lease.attempt):
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

    async def _serve(self, running: _Running) -> None:
        lease = running.lease
        job = lease.job
        if job.executor == UNDO_EXECUTOR:
            await self._serve_undo(running)
            return
        if job.executor == CHECKPOINT_EXECUTOR:
            await self._serve_checkpoint(running)
            return
        if job.executor in (APPROVE_EXECUTOR, REJECT_EXECUTOR):
            await self._serve_answer(running)
            return
        executor = await self._executor_for(lease)
        if executor is None:
            return
        # Before the choice, which may log (``sandbox.degraded``) or refuse the job.
        running.sandbox = self.predict_arm(executor.manifest.runtime)
        structlog.contextvars.bind_contextvars(sandbox=running.sandbox)
        _log.info("job.received", max_attempts=job.max_attempts, timeout_s=job.timeout_s)
        with self.observer.phase("plan", job):
            planned = await self._plan(lease, executor)
        if planned is None:
            return
        invocation, choice = planned
        if choice.degraded:
            self.observer.degraded(getattr(choice.degraded, "reason", "degraded"))
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
            reversible = await self._stage(lease, invocation, arm)
            if reversible is None:
                return
        try:
            if reversible is not None:
                sjob = reversible.job
                if reversible.no_staging is not None:
                    self.observer.degraded("no_staging")
                    lost = getattr(reversible, "lost", "")
                    _log.warning(
                        "sandbox.degraded",
                        requested="staging",
                        used="backup",
                        reason="no_staging",
                        axes_lost=["resources"],
                        detail=f"{lost}",
                    )
            # What the arm leaves to tear down once the result is known (the bwrap arm:
            # the slot's drain and release, the mount sources) runs after it is stored.
            async with after_result() as later:
                outcome, fault, started_at = await self._run_arm(
                    running,
                    arm,
                    sjob,
                    degraded=bool(choice.degraded) or bool(reversible and reversible.no_staging),
                )
                await self._settle_run(running, arm, sjob, reversible, outcome, fault, started_at)
            for error in later.errors:
                _log.warning("sandbox.teardown_failed", error=f"{type(error).__name__}: {error}")
        finally:
            if reversible is not None:
                # Whatever happened, nothing staged outlives the job (normally discarded or
                # settled already; then this is a no-op).
                with anyio.CancelScope(shield=True):
                    await reversible.discard(restore=running.stop != "lease_lost")

    async def _executor_for(self, lease: Lease) -> Executor | None:
        """The job's executor; ``None``: it was rejected (unknown, a bad manifest, or, with a
        trust store, a signature that fails)."""
        job = lease.job
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
            return None
        return executor

    async def _plan(self, lease: Lease, executor: Executor) -> tuple[Invocation, _ArmChoice] | None:
        """Verify (with a trust store), plan, choose the arm; ``None``: the job was rejected."""
        job = lease.job
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
            return None
        return invocation, choice

    async def _stage(self, lease: Lease, invocation: Invocation, arm: Sandbox) -> Reversible | None:
        """Stage the job's writable folders; ``None``: it was released, rejected or retried."""
        job = lease.job
        sjob = invocation.job
        # A redelivery: its last worker may have died mid-commit; settle that first,
        # so this run starts from a tree that is whole.
        if self._owes_recovery(lease) and not await self._recover_for(lease):
            await self._release(lease, "the store failed while a commit was recovered")
            return None
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
            return None
        except (HostFault, OSError) as exc:
            error = exc if isinstance(exc, HostFault) else HostFault(f"staging failed: {exc}")
            await self._retry(lease, ErrorInfo(code=error.code, message=error.message))
            return None
        if reversible is not None and await self._refuse_ungated(lease, reversible):
            return None
        return reversible

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

        await self._drop_unkept(running, reversible, outcome, fault)
        measured = running.measured

        def stopped_report() -> ContainmentReport:
            # A launched run's containment is the one measured, never the plan.
            return contained(arm.containment(sjob) if measured is None else measured.containment)

        if running.stop is not None:
            await self._settle_stopped(running, started_at, stopped_report)
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
        result = _outcome_result(self._result, lease, outcome, started_at)
        if reversible is None:
            await self._ack(lease, result)
            return
        await self._settle_staged(running, sjob, reversible, outcome, result, contained)

    async def _drop_unkept(
        self,
        running: _Running,
        reversible: Reversible | None,
        outcome: SandboxOutcome | None,
        fault: HostFault | MetnosError | None,
    ) -> None:
        """Discard the staged changes of a run whose result keeps nothing, and log
        ``job.stopped`` for a launched run stopped without a result of its own."""
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

    async def _settle_stopped(
        self,
        running: _Running,
        started_at: float | None,
        stopped_report: Callable[[], ContainmentReport],
    ) -> None:
        """Settle a run stopped from outside (`_Running.stop`): a lost lease is left to the
        broker, a drain or a store failure before the start releases the job, a cancel
        acks a ``cancelled`` result."""
        lease = running.lease
        measured = running.measured
        if running.stop == "lease_lost":
            _log.warning("lease.lost", visibility_s=self.visibility_s)
            # The broker may already have handed the job to another worker: acking or
            # retrying now would race it. Redelivery is the broker's job.
            self._count_lost()
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

    async def _settle_staged(
        self,
        running: _Running,
        sjob: SandboxJob,
        reversible: Reversible,
        outcome: SandboxOutcome,
        result: Result,
        contained: Callable[[ContainmentReport], ContainmentReport],
    ) -> None:
        """Settle a staged run's result: a success is committed (`_commit`), anything else
        has its changes discarded (``E_DISK`` when it filled its disk budget)."""
        lease = running.lease
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
        if self._gated(lease.job):
            await self._keep_for_approval(lease, result, reversible)
            return
        running.committing = True
        try:
            await self._commit(lease, result, reversible)
        finally:
            running.committing = False

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
                    clock = self.clock
                    with (
                        stopped_outcomes() as stopped,
                        reporting_progress(lambda r: running.note_progress(r, clock())),
                    ):
                        try:
                            launched_at = time.perf_counter()
                            outcome = await arm.run(sjob)
                            self.observer.ran(
                                running.lease.job,
                                time.perf_counter() - launched_at,
                                outcome.usage.wall_s,
                            )
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
