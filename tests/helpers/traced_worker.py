"""A `metnos-exec worker` process with an OpenTelemetry SDK tracer provider, for tests.

Usage::

    traced_worker.py SPANS_FILE WORKER_ARGS...

Sets the global tracer provider (the SDK's, with an in-memory exporter) before the CLI
starts, as an application or ``opentelemetry-instrument`` would, then runs ``metnos-exec
worker WORKER_ARGS`` (``--burst``: it exits once the queue is empty). At exit, every span
the exporter holds is written to SPANS_FILE, one JSON object a line (name, kind, ids in
hex, parent, attributes), for the test process to read.
"""

from __future__ import annotations

import json
import sys

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from metnos_exec.cli import main as cli_main


def main(args: list[str]) -> int:
    spans_file, worker_args = args[0], args[1:]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    try:
        return cli_main(["worker", *worker_args])
    finally:
        provider.force_flush()
        with open(spans_file, "w", encoding="utf-8") as out:
            for span in exporter.get_finished_spans():
                ctx = span.get_span_context()
                assert ctx is not None
                out.write(
                    json.dumps(
                        {
                            "name": span.name,
                            "kind": span.kind.name,
                            "trace_id": f"{ctx.trace_id:032x}",
                            "span_id": f"{ctx.span_id:016x}",
                            "parent": f"{span.parent.span_id:016x}" if span.parent else None,
                            "attributes": dict(span.attributes or {}),
                            "start": span.start_time,
                            "end": span.end_time,
                        }
                    )
                    + "\n"
                )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
