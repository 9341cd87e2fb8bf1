"""The `Supervisor` facade: what a worker starts (`run`), stops (`drain`) and waits for.

`run` recovers dead workers' commits, publishes a server worker's executors, then runs
the lease loop with the heartbeat, cancel-poll, retention and catalog tasks beside it in
one task group, until a drain (or, in burst mode, an empty queue). Everything else is in
the layers below (see `state`).
"""

from __future__ import annotations

import logging
import os
import socket
from importlib import metadata

import anyio
import sniffio
import structlog
from anyio.abc import TaskStatus

from ..brokers.presence import MAX_RUNNING_LISTED, WORKER_BEAT_S, WorkerInfo
from ..logs import get_logger
from ..messages import SERVER_DEVICE
from .pipeline import Pipeline

__all__ = ("Supervisor",)

_log = get_logger()

try:
    _VERSION = metadata.version("metnos-exec")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    _VERSION = ""


class Supervisor(Pipeline):
    """Serve jobs from `broker` with executors from `registry`, as `config` says.

    ``Supervisor(broker, registry, config, *, arm_chooser=None, ...)``.

    Args:
        broker: where jobs come from and results go.
        registry: the executors this worker can run.
        config: the settings (`SupervisorConfig`: the worker's id and device, timings,
            limits, retention, concurrency, home, policy, ...).
        arm_chooser: picks the sandbox arm for a runtime (default `choose_arm`).
        predict_arm: runtime → the name of the arm `arm_chooser` will pick, without
            choosing (so records logged before and during the choice, e.g.
            ``job.received``, ``job.rejected``, ``sandbox.degraded``, carry ``sandbox``).
            Default: `decide_arm` with the default chooser, else ``None`` until chosen.
        clock: unix-seconds clock for ``started_at`` / ``finished_at``.
        retry_delay: attempt → seconds before redelivery (default `backoff.retry_delay`).
        staging: the blob store, commit journal and staging namespace that make the
            jobs' file changes reversible (default: a `Staging` in `default_state_dir`,
            made at first use).
        trust: when set, every executor's signature is checked before its job is planned
            (`signing.TrustStore`: ``E_SIGNATURE`` rejects the job) and the job runs from
            the verified private copy. Required on a device worker (`run_worker`).
        store_backoff: failures in a row → seconds before trying the store again.
        observer: told of each job's phases and results (`metnos_exec.observe`: metrics,
            traces); default `NULL_OBSERVER`, which does nothing.

    Attributes:
        config: the settings it was given; each is also an attribute of its own name
            (``heartbeat_s`` and ``home`` resolved).
        fatal_error: the fatal store error that stopped `run`, if one did.
    """

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
        # Outside the task group: a port in use is the operator's error (E_CONFIG), said
        # as it is, not one of a group of errors.
        await self.observer.bind()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                # One heartbeat task for all running jobs, not one per job: a task per job
                # would cost more than the echo arm's whole run.
                tg.start_soon(self._heartbeat_loop, name="heartbeats")
                self._start_upkeep(tg)
                if publishes:
                    tg.start_soon(self._catalog_loop, published, name="catalog")
                tg.start_soon(self._presence_loop, name="presence")
                # /metrics, when the observer serves it (on the listener bound above).
                await tg.start(self.observer.serve, self)
                task_status.started()
                async with anyio.create_task_group() as jobs:
                    await self._lease_loop(jobs, burst=burst)
                tg.cancel_scope.cancel()
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await self._say_presence(stopped=True)
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

    async def _say_presence(self, *, stopped: bool = False) -> None:
        """Store this worker's presence record (`brokers.presence`): who it is, what it
        serves and runs. Advice for ``status``: a failure is only logged at debug level,
        never a reason to stop leasing (the queue's own calls say the store failed)."""
        now = self.clock()
        if self._started_at is None:
            self._started_at = now
        info = WorkerInfo(
            id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            device=self.device,
            executors=self.served,
            slots=self.concurrency,
            running=tuple(list(self._running)[:MAX_RUNNING_LISTED]),
            version=_VERSION,
            started_at=self._started_at,
            seen_at=now,
            stopped_at=now if stopped else None,
        )
        try:
            await self.broker.register_worker(info)
        except Exception as exc:
            _log.debug("broker.error", op="register_worker", error=f"{type(exc).__name__}: {exc}")

    def _start_upkeep(self, tg: anyio.abc.TaskGroup) -> None:
        """The loops beside the jobs: cancel polls, progress, retention, gate expiry."""
        tg.start_soon(self._cancel_poll_loop, name="cancel polls")
        tg.start_soon(self._progress_loop, name="progress")
        if self.retention_s is not None:
            tg.start_soon(self._retention_loop, self.retention_s, name="retention")
        if self._staging is not None or self._needs_staging():
            tg.start_soon(self._gate_loop, name="approval gates")

    async def _presence_loop(self) -> None:
        while True:
            await self._say_presence()
            await anyio.sleep(WORKER_BEAT_S)

    async def wait_stopped(self) -> None:
        """Return once `run` has returned."""
        await self._stopped.wait()

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
