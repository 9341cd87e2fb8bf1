"""Warm one-shot sandboxes for the bwrap arm (issue 22).

Inside `warm_sandboxes` (the worker enters it) the arm keeps, for each job *template*
it has run (the `SandboxJob` less its stdin: executor, effective capabilities, mounts,
limits, environment), up to ``N`` bubblewrap sandboxes started ahead: the namespaces and
mounts made, the limits gated in, the seccomp filter loaded, landlock applied and the
executor's script compiled by the in-guest step, which then blocks on its stdin
(``METNOS_WARM``, `metnos_exec.sandbox._landlock_guest`). A job whose template matches
takes one, writes one release byte and its arguments, and waits for it to end. **Each
sandbox serves exactly one job and is never reused**; the pool starts a new one in the
background.

What a warm job gets is a cold job's, started earlier:

* its own interpreter, started for it alone (never forked from a shared one): its hash
  seed (unless the template's environment pins ``PYTHONHASHSEED``), its ``random`` state
  and its temp names are its own;
* the same command line, mounts, walls and limits as the cold run of that job (the
  template *is* the job), hence the same containment report;
* its clock starts at the release (`ProcessSpec.release`): the wall-time budget and the
  usage's ``wall_s`` count from there. The CPU-time rlimit is the cold job's and counts
  the interpreter's start-up, as a cold job's does (it cannot be re-based below one
  second anyway): a warm job never gets more CPU than a cold one.
* its slot (a pids and memory cgroup, a root worker's slot uid) is the warm sandbox's
  own, taken when it started and drained before it is lent again.

What stays cold, and why (`WarmPools.status` says it per executor):

* a staged job (``fs:write``): its overlay is made by the staging layer for that job
  just before the run, and the commit's conflict baseline is taken then; a sandbox
  started ahead would need an overlay that belongs to no job yet. Making a fresh overlay
  per warm sandbox is possible, but its baseline would predate the job: not done.
* a network job: the network wall is attached per job and records that job's egress;
* a host without the in-guest landlock step (the hold lives in it);
* the first job of a template (the pool learns templates from the jobs it sees), and a
  job that finds its pool empty.

Budget: warm sandboxes hold slots, so the pools together keep at most ``budget`` (the
worker's concurrency by default) started; a pool whose sandboxes keep failing before
their job stops refilling (``sandbox.spare_failed``). A pool is drained (its waiting
sandboxes killed and reaped) when a job of the same executor folder comes with another
template (the manifest, the signature's verified copy or the arguments' mounts changed)
or its script changed on disk, and all are when the worker leaves `warm_sandboxes`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import anyio
import anyio.abc
import msgspec

from ..errors import BadConfig
from ..logs import get_logger
from ..process.teardown import after_result
from ._types import SandboxJob, SandboxOutcome, record_stopped, stopped_outcomes
from .progress import ProgressSink, progress_sink, reporting_progress

__all__ = (
    "WARM_DEFAULT_ENV",
    "WARM_ENV",
    "WarmPools",
    "warm_budget",
    "warm_default",
    "warm_pools",
    "warm_sandboxes",
    "worker_warm_sandboxes",
)

_log = get_logger()

#: Set in a warm sandbox's environment: the in-guest step holds before the job's code.
WARM_ENV: Final = "METNOS_WARM"
#: The worker-wide default of warm sandboxes per job template (``worker --warm N``).
WARM_DEFAULT_ENV: Final = "METNOS_WARM_SANDBOXES"
#: Every job that can run warm does (`WarmPools.eager`).
EAGER_ENV: Final = "METNOS_WARM_EAGER"
#: Consecutive warm sandboxes of one pool that may end before their job before it stops.
_MAX_FAILURES: Final = 3


class _Arm(Protocol):
    async def _run_job(
        self, job: SandboxJob, hold: Callable[[], Awaitable[bytes]] | None = None
    ) -> SandboxOutcome: ...


@dataclass(eq=False)
class _Warm:
    """One warm sandbox: started, held before the job's code, for exactly one job."""

    pool: _Pool
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    go: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    stdin: bytes = b""
    sink: ProgressSink | None = None
    outcome: SandboxOutcome | None = None
    stopped: SandboxOutcome | None = None
    error: BaseException | None = None
    taken: bool = False

    async def release(self) -> bytes:
        """`ProcessSpec.release`: wait for the job; the release byte and its stdin."""
        await self.go.wait()
        return b"g" + self.stdin

    def forward(self, report: Any) -> None:
        if self.sink is not None:
            self.sink(report)


@dataclass(eq=False)
class _Pool:
    """The warm sandboxes of one template."""

    key: bytes
    template: SandboxJob
    stamp: tuple[int, ...] | None
    want: int
    ready: list[_Warm] = field(default_factory=list)
    starting: int = 0
    served: int = 0
    failures: int = 0
    broken: str | None = None


def _stamp(job: SandboxJob) -> tuple[int, ...] | None:
    """The executor script's identity: a changed file drains the pool."""
    script = job.argv[-1] if job.argv else None
    if not script:
        return None
    try:
        st = os.stat(script)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class WarmPools:
    """The worker's warm sandboxes, by template (see the module docstring)."""

    def __init__(self, tg: anyio.abc.TaskGroup, default: int, budget: int) -> None:
        self._tg = tg
        self.default = default
        self.budget = budget
        self._pools: dict[bytes, _Pool] = {}
        #: Why an executor folder's jobs start cold (for `status`).
        self.cold: dict[str, str] = {}
        self.closed = False
        #: Jobs served warm by pools since drained.
        self.served = 0
        #: A job that finds no warm sandbox of its template waiting gets one started for
        #: it instead of a cold start (``METNOS_WARM_EAGER=1``): every job that can run
        #: warm does, the first of a template too. For the adversarial suite's warm pass
        #: (``METNOS_TEST_WARM=1``); no faster than cold for those jobs.
        self.eager = os.environ.get(EAGER_ENV) == "1"

    # --- the job's side ---------------------------------------------------------------

    def wanted(self, job: SandboxJob) -> int:
        return self.default if job.warm is None else job.warm

    async def run(self, arm: _Arm, job: SandboxJob, why_cold: str | None) -> SandboxOutcome:
        """Run `job` in a warm sandbox of its template, else cold (and learn it)."""
        n = self.wanted(job)
        where = job.cwd or (job.argv[-1] if job.argv else "")
        if n <= 0 or why_cold is not None:
            if n > 0 and why_cold is not None:
                self.cold[where] = why_cold
            return await arm._run_job(job)
        key = msgspec.json.encode(msgspec.structs.replace(job, stdin=b""))
        pool = self._pool_for(key, job, where, n)
        warm = self._take(pool)
        self._fill(arm, pool)
        if warm is None and self.eager:
            warm = _Warm(pool, taken=True)
            pool.served += 1
            self._tg.start_soon(self._serve, arm, pool, warm)
        if warm is None:
            return await arm._run_job(job)
        try:
            return await _hand(warm, job)
        finally:
            self._fill(arm, pool)

    def _pool_for(self, key: bytes, job: SandboxJob, where: str, n: int) -> _Pool:
        stamp = _stamp(job)
        pool = self._pools.get(key)
        if pool is not None and pool.stamp != stamp:
            self._drain(pool)
            pool = None
        if pool is None:
            # One template per executor folder: another one (a changed manifest, other
            # mounts) drains the old.
            for other in [p for p in self._pools.values() if (p.template.cwd or "") == where]:
                self._drain(other)
            pool = self._pools[key] = _Pool(key, msgspec.structs.replace(job, stdin=b""), stamp, n)
            self.cold.pop(where, None)
        pool.want = n
        return pool

    def _take(self, pool: _Pool) -> _Warm | None:
        while pool.ready:
            warm = pool.ready.pop(0)
            if not warm.done.is_set():
                warm.taken = True
                pool.served += 1
                return warm
        return None

    # --- the pool's side --------------------------------------------------------------

    def _held(self) -> int:
        return sum(len(p.ready) + p.starting for p in self._pools.values())

    def _fill(self, arm: _Arm, pool: _Pool) -> None:
        while (
            not self.closed
            and not self.eager  # eager: one started per job, none ahead
            and pool.broken is None
            and self._pools.get(pool.key) is pool
            and len(pool.ready) + pool.starting < pool.want
            and self._held() < self.budget
        ):
            pool.starting += 1
            self._tg.start_soon(self._serve, arm, pool)

    async def _serve(self, arm: _Arm, pool: _Pool, warm: _Warm | None = None) -> None:
        """One warm sandbox, from its start to its teardown (in the pools' task group);
        `warm`: one started for a job that took it already (`eager`)."""
        if warm is None:
            warm = _Warm(pool)
            pool.starting -= 1
            pool.ready.append(warm)
        template = msgspec.structs.replace(pool.template, env={**pool.template.env, WARM_ENV: "1"})
        try:
            with warm.scope, stopped_outcomes() as stopped, reporting_progress(warm.forward):
                # The outcome is handed to the job before the teardown (issue 22).
                async with after_result():
                    try:
                        warm.outcome = await arm._run_job(template, hold=warm.release)
                    except Exception as exc:
                        warm.error = exc
                    finally:
                        warm.stopped = stopped[-1] if stopped else None
                        warm.done.set()
        finally:
            warm.done.set()
            if warm in pool.ready:
                pool.ready.remove(warm)
            if not warm.taken and not self.closed and self._pools.get(pool.key) is pool:
                pool.failures += 1
                _log.warning(
                    "sandbox.spare_failed",
                    arm="bwrap",
                    error=f"a warm sandbox ended before its job: {warm.error or warm.outcome}",
                )
                if pool.failures >= _MAX_FAILURES:
                    pool.broken = "warm sandboxes keep ending before their job"
            elif warm.taken:
                pool.failures = 0

    def _drain(self, pool: _Pool) -> None:
        """Kill the waiting sandboxes of `pool` (reaped by their own tasks)."""
        if self._pools.pop(pool.key, None) is pool:
            self.served += pool.served
        for warm in pool.ready:
            warm.scope.cancel()
        pool.ready.clear()

    def drain_all(self) -> None:
        self.closed = True
        for pool in list(self._pools.values()):
            self._drain(pool)

    def waiting(self) -> int:
        """Warm sandboxes started and not yet given a job."""
        return sum(len(p.ready) for p in self._pools.values())

    def totals(self) -> dict[str, int]:
        """Warm sandboxes waiting, starting, and jobs served warm (the metrics)."""
        pools = list(self._pools.values())
        return {
            "waiting": sum(len(p.ready) for p in pools),
            "starting": sum(p.starting for p in pools),
            "served": self.served + sum(p.served for p in pools),
        }

    def status(self) -> dict[str, Any]:
        """The pools, for ``status``, ``doctor`` and the metrics."""
        return {
            "default": self.default,
            "budget": self.budget,
            "pools": [
                {
                    "executor": p.template.cwd,
                    "want": p.want,
                    "ready": len(p.ready),
                    "starting": p.starting,
                    "served": p.served,
                    "broken": p.broken,
                }
                for p in self._pools.values()
            ],
            "cold": dict(self.cold),
        }


async def _hand(warm: _Warm, job: SandboxJob) -> SandboxOutcome:
    """Release `warm` with `job`'s stdin and wait for its outcome (its teardown goes on
    in the pool's task). Cancelled: the sandbox is killed, measured and reaped first."""
    warm.stdin = job.stdin
    warm.sink = progress_sink()
    warm.go.set()
    try:
        await warm.done.wait()
    except BaseException:
        with anyio.CancelScope(shield=True):
            warm.scope.cancel()
            await warm.done.wait()
        if warm.stopped is not None:
            record_stopped(warm.stopped)
        raise
    if warm.error is not None:
        raise warm.error
    if warm.outcome is None:
        raise RuntimeError("a warm sandbox ended without an outcome")  # pragma: no cover
    return warm.outcome


def warm_budget(concurrency: int) -> int:
    """How many warm sandboxes a worker keeps at most, all templates together: twice its
    concurrency, at least 8. Each holds a slot (its cgroups, a root worker's slot uid,
    out of 65,536) and an idle interpreter (~10 MiB), never a run slot: a job never
    waits for one."""
    return max(8, 2 * concurrency)


def warm_default(given: int | None) -> int:
    """The worker's default: `given`, else ``METNOS_WARM_SANDBOXES``, else 0.

    Raises:
        BadConfig: the variable is not a number.
    """
    if given is not None:
        return max(given, 0)
    raw = os.environ.get(WARM_DEFAULT_ENV, "0")
    if not raw.isdigit():
        raise BadConfig(
            f"{WARM_DEFAULT_ENV} must be a number of warm sandboxes (0: none), got {raw!r}"
        )
    return int(raw)


def worker_warm_sandboxes(
    registry: Any, concurrency: int
) -> contextlib.AbstractAsyncContextManager[WarmPools | None]:
    """The worker's `warm_sandboxes` (`metnos_exec.worker.serve`): its default is
    ``METNOS_WARM_SANDBOXES`` (``worker --warm N``), else 0; its budget `warm_budget`;
    none at all (a null context) when neither the default nor any manifest of
    `registry` (an `ExecutorRegistry`) says ``warm = N``.

    Raises:
        BadConfig: a bad ``METNOS_WARM_SANDBOXES``.
    """
    default = warm_default(None)
    if not default and not any(registry[n].manifest.warm for n in registry):
        return contextlib.nullcontext()
    return warm_sandboxes(default, budget=warm_budget(concurrency))


_POOLS: list[WarmPools] = []


def warm_pools() -> WarmPools | None:
    """The pools of the `warm_sandboxes` open in this process (the event loop's), if any."""
    return _POOLS[-1] if _POOLS else None


@contextlib.asynccontextmanager
async def warm_sandboxes(default: int = 0, budget: int = 4) -> AsyncIterator[WarmPools]:
    """Keep warm sandboxes for the bwrap arm's jobs while this is open: `default` per
    template unless its manifest says ``warm = N``, at most `budget` at once. On exit
    every waiting one is killed and reaped, and every running one has ended."""
    async with anyio.create_task_group() as tg:
        pools = WarmPools(tg, default, budget)
        _POOLS.append(pools)
        try:
            yield pools
        finally:
            _POOLS.remove(pools)
            pools.drain_all()
