"""The Prometheus metrics of a worker (and of a producer: `submitted`), in one registry.

Names follow prometheus.io: one prefix, base units, ``_total`` counters. Labels are few
and bounded: the executor (one of the worker's), the status, the exit kind, the arm,
the axis and its verdict, an error code, a reason *class* (never the free text of a
reason, which may name a host), never a job id.

| metric | type | labels |
|---|---|---|
| ``metnos_jobs_submitted_total`` | counter | executor (the producer's process) |
| ``metnos_jobs_leased_total`` | counter | executor |
| ``metnos_jobs_redelivered_total`` | counter | executor |
| ``metnos_jobs_finished_total`` | counter | executor, status, exit, arm |
| ``metnos_job_phase_seconds`` | histogram | phase, executor |
| ``metnos_jobs_running`` / ``metnos_slots_free`` | gauge | |
| ``metnos_queue_jobs`` | gauge | state (queued, delayed, leased, done, dead) |
| ``metnos_queue_oldest_age_seconds`` | gauge | (0: none due) |
| ``metnos_leases_lost_total`` | counter | |
| ``metnos_retries_total`` | counter | code |
| ``metnos_dead_letters_total`` | counter | code |
| ``metnos_broker_errors_total`` | counter | op, code |
| ``metnos_containment_total`` | counter | axis, verdict |
| ``metnos_degradations_total`` | counter | reason |
| ``metnos_egress_total`` | counter | verdict (allowed, refused), reason |
| ``metnos_commit_conflicts_total`` | counter | |
| ``metnos_undo_total`` | counter | outcome (the undo job's status) |
| ``metnos_warm_sandboxes`` | gauge | state (waiting, starting, served: issue 22) |

Phases: ``queue_wait`` (submit, or ``not_before``, to the first lease), ``plan``,
``sandbox_start`` (the arm's setup before its process ran), ``run`` (the process, from
its spawn), ``commit`` (a staged success: the commit, its undo record and the ack
inside it), ``ack`` (storing the result).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import time
import types
from collections.abc import Iterator
from typing import Any, Final

from ..errors import BadConfig, CommitConflict
from ..messages import UNDO_EXECUTOR, Job, Result
from ..sandbox._bwrap_warm import warm_pools
from ..sandbox._types import AXES

__all__ = ("QUEUE_CACHE_S", "Metrics", "egress_reason", "submitted")

#: How long a scrape reuses the broker's counts: a storm of scrapes (several Prometheus
#: servers, a dashboard refreshing) costs the store one count per this many seconds.
QUEUE_CACHE_S: Final = 2.0

if AXES != ("files", "network", "process_tree", "user", "resources"):  # `Metrics.finished`
    raise ImportError("observe.metrics spells out the containment axes: update it with AXES")

#: Histogram buckets in seconds: a no-op job's phases are sub-millisecond, a sandbox
#: start a few milliseconds, an executor's run anything up to its budget.
_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
)  # fmt: skip

#: Refusal reasons of the network wall, by a word each contains → the label (first match).
_EGRESS_REFUSALS: Final = (
    ("deny list", "deny_list"),
    ("does not resolve", "no_resolve"),
    ("not a host name", "bad_host"),
    ("out of range", "bad_port"),
    ("faster than its rate", "rate"),
    ("more connections", "over_budget"),
)


def egress_reason(allowed: bool, reason: str) -> str:
    """A bounded label for an egress record's reason (its text may name a host)."""
    if allowed:
        return "rule"
    for needle, label in _EGRESS_REFUSALS:
        if needle in reason:
            return label
    return "policy"


@functools.cache
def _client() -> types.ModuleType | None:
    """prometheus_client, imported at the first need (a worker without ``--metrics``, a
    producer without the extra, never import it)."""
    try:
        import prometheus_client
        import prometheus_client.core  # the metric families of `Metrics.collect`
    except ImportError:  # pragma: no cover - the extra is installed in CI
        return None
    return prometheus_client


def _require() -> types.ModuleType:
    prom = _client()
    if prom is None:
        raise BadConfig(
            "metrics need prometheus-client: pip install 'metnos-exec[metrics]' "
            "(or run the worker without --metrics)"
        )
    return prom


class _Family:
    """One metric's samples by label values, counted in plain Python.

    Every call comes from the worker's event loop (the supervisor's tasks, and the
    ``/metrics`` handler that reads them), so no lock is needed: prometheus_client's own
    children take one per increment, and a dozen increments a job cost the echo drain
    several per cent. Rendered at scrape time (`Metrics.collect`).
    """

    __slots__ = ("doc", "kind", "labels", "name", "values")

    def __init__(self, name: str, doc: str, labels: tuple[str, ...] = (), kind: str = "counter"):
        self.name, self.doc, self.labels, self.kind = name, doc, labels, kind
        self.values: dict[tuple[str, ...], Any] = {}

    def inc(self, *labels: str) -> None:
        values = self.values
        values[labels] = values.get(labels, 0) + 1

    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = value

    def observe(self, seconds: float, *labels: str) -> None:
        slot = self.values.get(labels)
        if slot is None:
            # Counts per bucket (not cumulative: one add per observation), then the sum.
            slot = self.values[labels] = [0] * (len(_BUCKETS) + 1) + [0.0]
        slot[bisect.bisect_left(_BUCKETS, seconds)] += 1
        slot[-1] += seconds


def _observe(slots: dict[tuple[str, ...], Any], labels: tuple[str, ...], seconds: float) -> None:
    """`_Family.observe` on a histogram's `values`, without the packed labels."""
    slot = slots.get(labels)
    if slot is None:
        slot = slots[labels] = [0] * (len(_BUCKETS) + 1) + [0.0]
    slot[bisect.bisect_left(_BUCKETS, seconds)] += 1
    slot[-1] += seconds


class Metrics:
    """A worker's metrics (see the module docstring), exposed through a registry of
    their own (`registry`), not the global one: two workers in one process (tests), or
    an application with metrics of its own, do not collide.

    Args:
        bind: where `http.serve_metrics` serves them (``None``: nowhere).

    Raises:
        BadConfig: ``prometheus-client`` is not installed.
    """

    def __init__(self, *, bind: tuple[str, int] | None = None) -> None:
        prom = self._prom = _require()
        self.bind = bind
        #: The port ``/metrics`` listens on, once it does (``bind``'s, or the kernel's
        #: pick for port 0).
        self.port: int | None = None
        f = _Family
        self.leased_total = f("metnos_jobs_leased", "deliveries leased", ("executor",))
        self.redelivered = f("metnos_jobs_redelivered", "deliveries after the first", ("executor",))
        self.finished_total = f(
            "metnos_jobs_finished", "results stored", ("executor", "status", "exit", "arm")
        )
        self.phases = f(
            "metnos_job_phase_seconds", "time in each phase of a job", ("phase", "executor"),
            kind="histogram",
        )  # fmt: skip
        self.running = f("metnos_jobs_running", "jobs in flight on this worker", kind="gauge")
        self.slots_free = f("metnos_slots_free", "run slots free on this worker", kind="gauge")
        self.queue_jobs = f(
            "metnos_queue_jobs", "jobs in the queue by state", ("state",), kind="gauge"
        )
        self.oldest = f(
            "metnos_queue_oldest_age_seconds", "age of the oldest due queued job", kind="gauge"
        )
        self.leases_lost = f("metnos_leases_lost", "leases lost")
        self.retries = f("metnos_retries", "retries scheduled", ("code",))
        self.dead = f("metnos_dead_letters", "jobs dead-lettered", ("code",))
        self.broker_errors = f("metnos_broker_errors", "failed broker calls", ("op", "code"))
        self.containment = f("metnos_containment", "walls per result", ("axis", "verdict"))
        self.degradations = f("metnos_degradations", "jobs run below their wall", ("reason",))
        self.egress = f("metnos_egress", "connections through the wall", ("verdict", "reason"))
        self.conflicts = f("metnos_commit_conflicts", "commits refused")
        self.undo = f("metnos_undo", "undo jobs by outcome", ("outcome",))
        self.warm = f(
            "metnos_warm_sandboxes", "warm bwrap sandboxes (waiting, starting, served)",
            ("state",), kind="gauge",
        )  # fmt: skip
        self.families = tuple(v for v in vars(self).values() if isinstance(v, _Family))
        self._queue_read_at = -QUEUE_CACHE_S
        self._walls: dict[tuple[str, ...], int] = {}
        self.registry = prom.CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # The per-job calls below count in place (a dict get and set each) rather than
    # through `_Family.inc`/`observe`: a call with packed labels per count was most of
    # what metrics cost an echo job (measured: 27 us a job, against a drain's ~600).

    def leased(self, job: Job, attempt: int, now: float) -> None:
        executor = job.executor
        key = (executor,)
        counts = self.leased_total.values
        counts[key] = counts.get(key, 0) + 1
        if attempt > 1:
            counts = self.redelivered.values
            counts[key] = counts.get(key, 0) + 1
            return
        due = job.submitted_at
        not_before = job.not_before
        if not_before is not None and not_before > due:
            due = not_before
        wait = now - due
        _observe(self.phases.values, ("queue_wait", executor), wait if wait > 0.0 else 0.0)

    def phase(self, name: str, executor: str, seconds: float) -> None:
        _observe(self.phases.values, (name, executor), seconds)

    def ran(self, executor: str, start_s: float, run_s: float) -> None:
        """The arm's setup and its process's run (`Observer.ran`)."""
        slots = self.phases.values
        _observe(slots, ("sandbox_start", executor), start_s)
        _observe(slots, ("run", executor), run_s)

    def finished(self, job: Job, result: Result) -> None:
        report = result.containment
        # The direct arm's own name is "none": a result with no report ran nothing.
        arm = report.sandbox if report is not None else "not_run"
        exit_kind = type(result.exit).__name__.lower() if result.exit is not None else "none"
        key = (job.executor, result.status, exit_kind, arm)
        counts = self.finished_total.values
        counts[key] = counts.get(key, 0) + 1
        if report is not None:
            # One count per combination of verdicts, spread over the axes at scrape time
            # (`collect`): one increment a job rather than five.
            walls = self._walls
            # The axes in `AXES`' order, spelled out: a generator over them was a fifth
            # of what metrics cost an echo job.
            verdicts = (
                report.files.state,
                report.network.state,
                report.process_tree.state,
                report.user.state,
                report.resources.state,
            )
            walls[verdicts] = walls.get(verdicts, 0) + 1
        for record in result.egress:
            said = "allowed" if record.allowed else "refused"
            self.egress.inc(said, egress_reason(record.allowed, record.reason))
        if result.error is not None and result.error.code == CommitConflict.code:
            self.conflicts.inc()
        if job.executor == UNDO_EXECUTOR:
            self.undo.inc(result.status)

    def retried(self, job: Job, outcome: str, code: str) -> None:
        if outcome == "scheduled":
            self.retries.inc(code)
        elif outcome == "dead":
            self.dead.inc(code)
            # The broker stores a dead job's result itself (no exit, no report): it is
            # finished all the same.
            self.finished_total.inc(job.executor, "dead", "none", "not_run")
        # "lost": counted by `lease_lost`, which the supervisor calls for every lost lease.

    def lease_lost(self) -> None:
        self.leases_lost.inc()

    def broker_error(self, op: str, code: str) -> None:
        self.broker_errors.inc(op, code)

    def degraded(self, reason: str) -> None:
        self.degradations.inc(reason)

    def queue_due(self) -> bool:
        """Whether the queue counts are older than `QUEUE_CACHE_S` (read them again)."""
        return time.monotonic() - self._queue_read_at >= QUEUE_CACHE_S

    def set_queue(
        self, counts: dict[str, int], oldest_at: float | None, *, now: float | None = None
    ) -> None:
        """Store the broker's counts (and the oldest due queued job's submit time)."""
        self._queue_read_at = time.monotonic()
        for state, n in counts.items():
            self.queue_jobs.set(n, state)
        age = 0.0 if oldest_at is None else (time.time() if now is None else now) - oldest_at
        self.oldest.set(max(0.0, age))

    def collect(self) -> Iterator[Any]:
        """The families, for prometheus_client's registry (a custom collector)."""
        core = self._prom.core
        per_axis: dict[tuple[str, ...], Any] = {}
        for states, n in self._walls.items():
            for axis, state in zip(AXES, states, strict=True):
                per_axis[(axis, state)] = per_axis.get((axis, state), 0) + n
        self.containment.values = per_axis
        pools = warm_pools()
        if pools is not None:
            for state, n in pools.totals().items():
                self.warm.set(n, state)
        for fam in self.families:
            if fam.kind == "counter":
                out = core.CounterMetricFamily(fam.name, fam.doc, labels=fam.labels)
                for labels, n in fam.values.items():
                    out.add_metric(labels, n)
            elif fam.kind == "gauge":
                out = core.GaugeMetricFamily(fam.name, fam.doc, labels=fam.labels)
                for labels, n in fam.values.items():
                    out.add_metric(labels, n)
            else:
                out = core.HistogramMetricFamily(fam.name, fam.doc, labels=fam.labels)
                bounds = [*(repr(float(b)) for b in _BUCKETS), "+Inf"]
                for labels, slot in fam.values.items():
                    cumulative = list(itertools.accumulate(slot[:-1]))
                    out.add_metric(labels, list(zip(bounds, cumulative, strict=True)), slot[-1])
            yield out

    def render(self) -> bytes:
        """The exposition text of the registry."""
        body: bytes = self._prom.generate_latest(self.registry)
        return body


#: The producer's counter (`submitted`), in the global registry where an application's
#: own metrics are: made at the first submit with prometheus-client installed.
_SUBMITTED: list[object] = []


def submitted(executor: str) -> None:
    """Count one submit in the producer's process (a no-op without prometheus-client)."""
    prom = _client()
    if prom is None:
        return
    if not _SUBMITTED:
        _SUBMITTED.append(prom.Counter("metnos_jobs_submitted", "jobs submitted", ["executor"]))
    counter = _SUBMITTED[0]
    assert isinstance(counter, prom.Counter)
    counter.labels(executor).inc()
