"""OpenTelemetry traces through the queue (``opentelemetry-api``; a no-op without it).

The producer (`submit_context`, used by `Client.submit`) opens a PRODUCER span ``send
{executor}`` and carries its W3C context in ``Job.trace`` (``traceparent``,
``tracestate``). The worker (`Tracing.consumer`) opens a CONSUMER span ``process
{executor}`` per delivery, a child of the producer's (one trace from the submit to the
result), with the messaging attributes (``messaging.system = "metnos"``,
``messaging.destination.name``: the queue, ``messaging.message.id``: the job id,
``messaging.operation.type = "process"``) and the GenAI ones (``gen_ai.operation.name =
"execute_tool"``, ``gen_ai.tool.name``: the executor); once the result is stored,
``metnos.job.status`` and ``metnos.containment.<axis>``. Child spans: ``plan``,
``sandbox start``, ``run``, ``commit``, ``ack`` (only under a recorded, i.e. sampled,
job span: the usual parent-based sampler would drop them anyway; and no span at all under
an unsampled producer with the SDK's parent-based sampler, `_drops_unsampled`). The trace
and span ids are bound into the job's log context (``trace_id``, ``span_id``: hex, as in
``traceparent``), sampled or not.

Tracing is active when the process has a tracer provider other than the API's default
proxy: an application sets one (the SDK's ``TracerProvider``), or the worker is started
under ``opentelemetry-instrument`` with the standard ``OTEL_*`` variables.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Final

import structlog

from ..messages import Job, Result, TraceContext

__all__ = ("Tracing", "submit_context", "tracing_active")

_SCOPE: Final = "metnos_exec"
#: The current job's span, if it is recorded (`Tracing.recording`, `Tracing.finished`):
#: set in the job's own task, so no other job sees it.
_JOB_SPAN: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "metnos_exec_job_span", default=None
)
_NULL: AbstractContextManager[None] = contextlib.nullcontext()


def tracing_active() -> bool:
    """Whether this process traces: a tracer provider other than the API's default proxy
    (which records nothing) was set.

    Read without importing OpenTelemetry: a process that set a provider has imported
    ``opentelemetry.trace``; one that has not imported it cannot be tracing, and pays
    nothing here (one dictionary lookup per call).
    """
    api = sys.modules.get("opentelemetry.trace")
    if api is None:
        return False
    return not isinstance(api.get_tracer_provider(), api.ProxyTracerProvider)


@contextlib.contextmanager
def _producer(executor: str, job_id: str) -> Iterator[TraceContext | None]:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind

    tracer = trace.get_tracer(_SCOPE)
    attributes = {
        "messaging.system": "metnos",
        "messaging.operation.type": "send",
        "messaging.message.id": job_id,
        "gen_ai.tool.name": executor,
    }
    with tracer.start_as_current_span(
        f"send {executor}", kind=SpanKind.PRODUCER, attributes=attributes
    ):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        parent = carrier.get("traceparent")
        yield (
            None
            if parent is None
            else TraceContext(traceparent=parent, tracestate=carrier.get("tracestate", ""))
        )


def submit_context(executor: str, job_id: str) -> AbstractContextManager[TraceContext | None]:
    """Around a submit: the PRODUCER span, yielding the context to put in ``Job.trace``
    (``None``, and no span, when this process does not trace)."""
    if not tracing_active():
        return contextlib.nullcontext(None)
    return _producer(executor, job_id)


def _drops_unsampled(provider: Any) -> bool:
    """Whether `provider` drops every span under an unsampled remote parent: the SDK's
    ``ParentBased`` sampler (its default) with its default for that case."""
    try:
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
    except ImportError:  # another SDK: ask it for every job
        return False
    sampler = getattr(provider, "sampler", None)
    return (
        isinstance(sampler, ParentBased)
        and getattr(sampler, "_remote_parent_not_sampled", None) is ALWAYS_OFF
    )


class Tracing:
    """A worker's tracer (`Observer` calls it; see the module docstring)."""

    def __init__(self) -> None:
        from opentelemetry import context, trace

        self.tracer = trace.get_tracer(_SCOPE)
        self._api = trace
        self._attach, self._detach = context.attach, context.detach
        self._drops_unsampled = _drops_unsampled(trace.get_tracer_provider())

    def consumer(self, job: Job, attempt: int, queue: str) -> AbstractContextManager[None]:
        carried = job.trace
        if (
            carried is not None
            and self._drops_unsampled
            and not int(carried.traceparent[-2:], 16) & 1
        ):
            # The producer did not sample this trace and the sampler follows the parent:
            # the job's spans would all be dropped. Making them anyway cost a tenth of an
            # echo job; its log lines still carry the trace (and the producer's span).
            # Bound in the job's own task, with nothing to undo (each job task has its
            # own copy of the context), so no context manager of ours either: a
            # generator's entry and exit were a third of what an unsampled job cost.
            structlog.contextvars.bind_contextvars(
                trace_id=carried.traceparent[3:35], span_id=carried.traceparent[36:52]
            )
            return _NULL
        return self._consumer(job, attempt, queue)

    @contextlib.contextmanager
    def _consumer(self, job: Job, attempt: int, queue: str) -> Iterator[None]:
        carried = job.trace
        parent = None if carried is None else self._parent(carried)
        attributes: dict[str, Any] = {
            "messaging.system": "metnos",
            "messaging.operation.type": "process",
            "messaging.destination.name": queue,
            "messaging.message.id": job.id,
            "messaging.message.delivery_count": attempt,
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": job.executor,
        }
        if job.correlation_id is not None:
            attributes["messaging.message.conversation_id"] = job.correlation_id
        api = self._api
        span = self.tracer.start_span(
            f"process {job.executor}",
            context=parent,
            kind=api.SpanKind.CONSUMER,
            attributes=attributes,
        )
        ids = span.get_span_context()
        # Unbound with the job's task's context: each job task has its own copy.
        structlog.contextvars.bind_contextvars(
            trace_id=f"{ids.trace_id:032x}", span_id=f"{ids.span_id:016x}"
        )
        # Attached by hand rather than with `start_as_current_span`: two generator layers
        # fewer, a tenth of an untraced echo job's tracing.
        token = self._attach(api.set_span_in_context(span))
        _JOB_SPAN.set(span if span.is_recording() else None)
        try:
            yield
        except BaseException as exc:
            if span.is_recording():
                span.set_status(api.Status(api.StatusCode.ERROR, f"{type(exc).__name__}"))
            raise
        finally:
            self._detach(token)
            span.end()

    def _parent(self, carried: TraceContext) -> Any:
        """The producer's context. Read here rather than by the propagator: the decoder
        checked ``traceparent``'s shape already (`messages.TraceContext`), and the
        propagator's regular expressions cost a fifth of an untraced echo job."""
        api, header = self._api, carried.traceparent
        state = api.TraceState.from_header([carried.tracestate]) if carried.tracestate else None
        trace_id, span_id = int(header[3:35], 16), int(header[36:52], 16)
        if header[:2] == "ff" or not trace_id or not span_id:
            return None  # an invalid context (W3C): the job's span starts a new trace
        context = api.SpanContext(
            trace_id=trace_id,
            span_id=span_id,
            is_remote=True,
            trace_flags=api.TraceFlags(int(header[53:55], 16)),
            trace_state=state,
        )
        return api.set_span_in_context(api.NonRecordingSpan(context))

    def recording(self) -> bool:
        """Whether the current job's span is recorded (its phases get spans)."""
        # A job whose span is not sampled gets no phase spans: under the default
        # (parent-based) sampler they would not be recorded either, and making them cost
        # more than the rest of an echo job's bookkeeping. Read from our own variable
        # (set with the job's span, in the job's task): the API's current span is three
        # lookups deep.
        return _JOB_SPAN.get() is not None

    def span(self, name: str) -> AbstractContextManager[Any]:
        """A child span of the current one (a phase); none when that one is not
        recorded."""
        if not self.recording():
            return _NULL
        return self.tracer.start_as_current_span(name)

    def ran(self, start_s: float, run_s: float) -> None:
        """The ``sandbox start`` and ``run`` spans, made after the arm returned (the arm
        does both in one call; the run's wall time says where one ends)."""
        if not self.recording():
            return
        end = time.time_ns()
        begin = end - int((start_s + run_s) * 1e9)
        split = end - int(run_s * 1e9)
        self.tracer.start_span("sandbox start", start_time=begin).end(end_time=split)
        self.tracer.start_span("run", start_time=split).end(end_time=end)

    def finished(self, result: Result) -> None:
        # The job's span, not the current one: a staged job's result is stored inside
        # its commit span.
        span = _JOB_SPAN.get()
        if span is None:
            return
        span.set_attribute("metnos.job.status", result.status)
        if result.error is not None:
            span.set_attribute("error.type", result.error.code)
        if result.containment is not None:
            span.set_attribute("metnos.sandbox", result.containment.sandbox)
            for axis, verdict in result.containment.axes().items():
                span.set_attribute(f"metnos.containment.{axis}", verdict.state)
