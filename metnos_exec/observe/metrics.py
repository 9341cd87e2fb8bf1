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
| ``metnos_queue_oldest_age_seconds`` | gauge | (0: none due, or Redis: it cannot tell) |
| ``metnos_leases_lost_total`` | counter | |
| ``metnos_retries_total`` | counter | code |
| ``metnos_dead_letters_total`` | counter | code |
| ``metnos_broker_errors_total`` | counter | op, code |
| ``metnos_containment_total`` | counter | axis, verdict |
| ``metnos_degradations_total`` | counter | reason |
| ``metnos_egress_total`` | counter | verdict (allowed, refused), reason |
| ``metnos_commit_conflicts_total`` | counter | |
| ``metnos_undo_total`` | counter | outcome (the undo job's status) |

Phases: ``queue_wait`` (submit, or ``not_before``, to the first lease), ``plan``,
``sandbox_start`` (the arm's setup before its process ran), ``run`` (the process, from
its spawn), ``commit``, ``ack``.
"""

from __future__ import annotations

import functools
import time
import types
from typing import Final

from ..errors import BadConfig, CommitConflict
from ..messages import UNDO_EXECUTOR, Job, Result

__all__ = ("QUEUE_CACHE_S", "Metrics", "egress_reason", "submitted")

#: How long a scrape reuses the broker's counts: a storm of scrapes (several Prometheus
#: servers, a dashboard refreshing) costs the store one count per this many seconds.
QUEUE_CACHE_S: Final = 2.0

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


class Metrics:
    """A worker's metrics in a registry of their own (`registry`), not the global one:
    two workers in one process (tests), or an application with metrics of its own, do
    not collide.

    Args:
        bind: where `http.serve_metrics` serves them (``None``: nowhere).

    Raises:
        BadConfig: ``prometheus-client`` is not installed.
    """

    def __init__(self, *, bind: tuple[str, int] | None = None) -> None:
        prom = self._prom = _require()
        self.bind = bind
        reg = self.registry = prom.CollectorRegistry(auto_describe=True)
        c, g = prom.Counter, prom.Gauge
        self.leased_total = c("metnos_jobs_leased", "deliveries leased", ["executor"], registry=reg)
        self.redelivered = c(
            "metnos_jobs_redelivered", "deliveries after the first", ["executor"], registry=reg
        )
        self.finished_total = c(
            "metnos_jobs_finished",
            "results stored",
            ["executor", "status", "exit", "arm"],
            registry=reg,
        )
        self.phases = prom.Histogram(
            "metnos_job_phase_seconds",
            "time in each phase of a job",
            ["phase", "executor"],
            buckets=_BUCKETS,
            registry=reg,
        )
        self.running = g("metnos_jobs_running", "jobs in flight on this worker", registry=reg)
        self.slots_free = g("metnos_slots_free", "run slots free on this worker", registry=reg)
        self.queue_jobs = g(
            "metnos_queue_jobs", "jobs in the queue by state", ["state"], registry=reg
        )
        self.oldest = g(
            "metnos_queue_oldest_age_seconds", "age of the oldest due queued job", registry=reg
        )
        self.leases_lost = c("metnos_leases_lost", "leases lost", registry=reg)
        self.retries = c("metnos_retries", "retries scheduled", ["code"], registry=reg)
        self.dead = c("metnos_dead_letters", "jobs dead-lettered", ["code"], registry=reg)
        self.broker_errors = c(
            "metnos_broker_errors", "failed broker calls", ["op", "code"], registry=reg
        )
        self.containment = c(
            "metnos_containment", "walls per result", ["axis", "verdict"], registry=reg
        )
        self.degradations = c(
            "metnos_degradations", "jobs run below their wall", ["reason"], registry=reg
        )
        self.egress = c(
            "metnos_egress", "connections through the wall", ["verdict", "reason"], registry=reg
        )
        self.conflicts = c("metnos_commit_conflicts", "commits refused", registry=reg)
        self.undo = c("metnos_undo", "undo jobs by outcome", ["outcome"], registry=reg)
        self._queue_read_at = -QUEUE_CACHE_S

    def leased(self, job: Job, attempt: int, now: float) -> None:
        self.leased_total.labels(job.executor).inc()
        if attempt > 1:
            self.redelivered.labels(job.executor).inc()
        else:
            due = max(job.submitted_at, job.not_before or 0.0)
            self.phases.labels("queue_wait", job.executor).observe(max(0.0, now - due))

    def phase(self, name: str, executor: str, seconds: float) -> None:
        self.phases.labels(name, executor).observe(seconds)

    def finished(self, job: Job, result: Result) -> None:
        report = result.containment
        # The direct arm's own name is "none": a result with no report ran nothing.
        arm = report.sandbox if report is not None else "not_run"
        exit_kind = type(result.exit).__name__.lower() if result.exit is not None else "none"
        self.finished_total.labels(job.executor, result.status, exit_kind, arm).inc()
        if report is not None:
            for axis, verdict in report.axes().items():
                self.containment.labels(axis, verdict.state).inc()
        for record in result.egress:
            said = "allowed" if record.allowed else "refused"
            self.egress.labels(said, egress_reason(record.allowed, record.reason)).inc()
        if result.error is not None and result.error.code == CommitConflict.code:
            self.conflicts.inc()
        if job.executor == UNDO_EXECUTOR:
            self.undo.labels(result.status).inc()

    def retried(self, job: Job, outcome: str, code: str) -> None:
        if outcome == "scheduled":
            self.retries.labels(code).inc()
        elif outcome == "dead":
            self.dead.labels(code).inc()
            # The broker stores a dead job's result itself (no exit, no report): it is
            # finished all the same.
            self.finished_total.labels(job.executor, "dead", "none", "not_run").inc()
        # "lost": counted by `lease_lost`, which the supervisor calls for every lost lease.

    def lease_lost(self) -> None:
        self.leases_lost.inc()

    def broker_error(self, op: str, code: str) -> None:
        self.broker_errors.labels(op, code).inc()

    def degraded(self, reason: str) -> None:
        self.degradations.labels(reason).inc()

    def queue_due(self) -> bool:
        """Whether the queue counts are older than `QUEUE_CACHE_S` (read them again)."""
        return time.monotonic() - self._queue_read_at >= QUEUE_CACHE_S

    def set_queue(
        self, counts: dict[str, int], oldest_at: float | None, *, now: float | None = None
    ) -> None:
        """Store the broker's counts (and the oldest due queued job's submit time)."""
        self._queue_read_at = time.monotonic()
        for state, n in counts.items():
            self.queue_jobs.labels(state).set(n)
        if oldest_at is None:
            self.oldest.set(0.0)
        else:
            self.oldest.set(max(0.0, (time.time() if now is None else now) - oldest_at))

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
