"""Seeing the fleet: Prometheus metrics and OpenTelemetry traces of the jobs a worker serves.

The contract: the supervisor holds one `Observer` and calls it at a few points of a job's
path (leased; around the job, the plan, the commit and the ack; after the arm ran; the
result stored; a retry, a lost lease, a broker error, a degradation). The default,
`NULL_OBSERVER`, does nothing at each of those points (a method call, no allocation), so a
worker without ``--metrics`` and without an OpenTelemetry tracer provider pays nothing,
and neither ``prometheus-client`` nor ``opentelemetry-api`` is imported.

- **Metrics** (`metrics`, the ``metnos-exec[metrics]`` extra): counters and histograms in
  a private registry, served as ``/metrics`` by `http.serve_metrics` on an anyio listener.
  One prefix (``metnos_``), base units (seconds), ``_total`` counters, and labels that
  stay few (executor, status, exit kind, arm, axis, verdict, reason class, error code):
  never a job id. Queue depth is read from the broker at scrape time (its ``stats``,
  cached `metrics.QUEUE_CACHE_S`).
- **Traces** (`tracing`, ``opentelemetry-api``): `Client.submit` opens a PRODUCER span and
  writes its W3C context into ``Job.trace``; the worker opens a CONSUMER span per delivery
  (a child of the producer's), with child spans ``plan``, ``sandbox start``, ``run``,
  ``commit`` and ``ack``, the messaging and GenAI attributes, and ``trace_id`` /
  ``span_id`` bound into the job's log context. Tracing is on when the process has a
  tracer provider (the SDK's, set by the application or ``opentelemetry-instrument``).
"""

from __future__ import annotations

from ._observer import NULL_OBSERVER, ObservedWorker, Observer, make_observer
from .tracing import submit_context, tracing_active

__all__ = (
    "NULL_OBSERVER",
    "ObservedWorker",
    "Observer",
    "make_observer",
    "submit_context",
    "tracing_active",
)
