"""The W3C Trace Context a job carries (`messages.Job.trace`): the producer's span, which
the worker's span of the job is a child of (`metnos_exec.observe.tracing`).

Its own module, beside `messages`, because it is one wire concept with one rule (the
``traceparent`` shape, checked when the job is decoded), and `messages` is full.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

__all__ = ("TraceContext",)

#: W3C ``traceparent``: version, trace id, parent span id, flags (lower-case hex).
_TRACEPARENT: Final = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"


class TraceContext(msgspec.Struct, frozen=True, kw_only=True):
    """The W3C Trace Context of the producer's span (www.w3.org/TR/trace-context).

    Attributes:
        traceparent: ``00-<trace id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>``.
        tracestate: vendor entries, as the header carries them (``""``: none).
    """

    traceparent: Annotated[str, msgspec.Meta(pattern=_TRACEPARENT)]
    tracestate: Annotated[str, msgspec.Meta(max_length=512)] = ""
