"""Acceptance 2 of issue 20: one trace from `Client.submit` in this process to the result
in a worker process, with the phase spans, read from the SDK's in-memory exporters (this
process's, and the worker's: `tests.helpers.traced_worker` writes its spans to a file at
exit); the job's log lines carry its trace id."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.client import Client
from metnos_exec.logs import iter_records
from tests.conftest import need

pytest.importorskip("opentelemetry.sdk")
import itertools

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

pytestmark = pytest.mark.slow

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "traced_worker.py"
MANIFEST = """\
name = "sleepy"
version = "1"
runtime = "python"
entry = "main.py"
[args.s]
type = "number"
default = 0
"""
MAIN = "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n"
WRITER_MANIFEST = """\
name = "writer"
version = "1"
runtime = "python"
entry = "main.py"
[args.path]
type = "string"
required = true
format = "path"
[[capabilities]]
name = "fs:write"
hints = ["~/notes/**"]
"""
WRITER_MAIN = (
    "import json, sys\na = json.load(sys.stdin)\nopen(a['path'], 'w').write('hello')\nprint('{}')\n"
)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """This process's tracer provider, unset again afterwards.

    The API lets a process set its provider once; OpenTelemetry's own test helpers
    (``opentelemetry.test.globals_test.reset_trace_globals``) reset these two private
    globals between tests, which is what this does, so no other test runs traced.
    """
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    try:
        yield memory
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER_SET_ONCE._done = False
        trace._TRACER_PROVIDER = None


def _hex(span: ReadableSpan) -> tuple[str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_one_trace_from_submit_to_the_result_across_two_processes(
    tmp_path: Path, exporter: InMemorySpanExporter, backend: str
) -> None:
    need(shutil.which("bwrap") is not None, "bubblewrap is not installed")
    executors = tmp_path / "executors"
    (executors / "sleepy").mkdir(parents=True)
    (executors / "sleepy" / "manifest.toml").write_text(MANIFEST)
    (executors / "sleepy" / "main.py").write_text(MAIN)
    (executors / "writer").mkdir()
    (executors / "writer" / "manifest.toml").write_text(WRITER_MANIFEST)
    (executors / "writer" / "main.py").write_text(WRITER_MAIN)
    (tmp_path / "notes").mkdir()
    url = f"sqlite:///{tmp_path / 'q.db'}"
    tracer = trace.get_tracer("test")

    async def submit() -> tuple[str, str]:
        async with Client(url) as client:
            with tracer.start_as_current_span("agent step"):
                job_id = await client.submit("sleepy", {"s": 0}, correlation_id="step-1")
            with tracer.start_as_current_span("another step"):
                path = str(tmp_path / "notes" / "n.txt")
                return job_id, await client.submit("writer", {"path": path})

    job_id, writer_id = anyio.run(submit, backend=backend)
    mine = {s.name: s for s in exporter.get_finished_spans()}
    assert set(mine) == {"agent step", "send sleepy", "another step", "send writer"}
    producer = mine["send sleepy"]
    assert producer.kind is trace.SpanKind.PRODUCER
    trace_id, producer_id = _hex(producer)
    assert producer.parent is not None
    assert f"{producer.parent.span_id:016x}" == _hex(mine["agent step"])[1]

    spans_file, log = tmp_path / "spans.jsonl", tmp_path / "worker.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("METNOS_")}
    env["HOME"] = str(tmp_path)
    argv = ["--broker", url, "--executors", str(executors), "--log-file", str(log)]
    argv += ["--backend", backend, "--burst", "--worker-id", "W"]
    done = subprocess.run(
        [sys.executable, str(HELPER), str(spans_file), *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    theirs: list[dict[str, Any]] = [json.loads(x) for x in spans_file.read_text().splitlines()]
    writer_trace, writer_producer = _hex(mine["send writer"])
    assert {s["trace_id"] for s in theirs} == {trace_id, writer_trace}  # the producers'
    by_job = {s["attributes"]["messaging.message.id"]: s for s in theirs if s["kind"] == "CONSUMER"}
    assert set(by_job) == {job_id, writer_id}
    # The staged job: its changes committed in a commit span, its ack inside it.
    writer = by_job[writer_id]
    assert writer["parent"] == writer_producer and writer["trace_id"] == writer_trace
    assert writer["attributes"].get("metnos.job.status") == "succeeded", writer
    (commit,) = [s for s in theirs if s["name"] == "commit" and s["parent"] == writer["span_id"]]
    assert [s["name"] for s in theirs if s["parent"] == commit["span_id"]] == ["ack"]
    assert (tmp_path / "notes" / "n.txt").read_text() == "hello"
    theirs = [s for s in theirs if s["trace_id"] == trace_id]
    (consumer,) = [s for s in theirs if s["kind"] == "CONSUMER"]
    assert consumer["name"] == "process sleepy"
    assert consumer["parent"] == producer_id
    attrs = consumer["attributes"]
    assert attrs["messaging.system"] == "metnos"
    assert attrs["messaging.message.id"] == job_id
    assert attrs["messaging.destination.name"]
    assert attrs["gen_ai.operation.name"] == "execute_tool"
    assert attrs["gen_ai.tool.name"] == "sleepy"
    assert attrs["metnos.job.status"] == "succeeded"
    assert attrs["metnos.containment.files"] in ("kept", "partial", "lost")
    assert {
        f"metnos.containment.{a}" for a in ("network", "process_tree", "user", "resources")
    } <= set(attrs)
    children = {s["name"]: s for s in theirs if s["parent"] == consumer["span_id"]}
    assert {"plan", "sandbox start", "run", "ack"} <= set(children)
    # In order: the plan, then the arm's setup, then the run, then the ack.
    order = [children[n] for n in ("plan", "sandbox start", "run", "ack")]
    for before, after in itertools.pairwise(order):
        assert before["end"] <= after["start"] + 1_000_000, (before["name"], after["name"])

    records = [r for r in iter_records(log) if r.get("job_id") == job_id]
    assert {r["event"] for r in records} >= {"job.received", "job.started", "job.finished"}
    assert all(r.get("trace_id") == trace_id for r in records), records
    assert all(r.get("span_id") == consumer["span_id"] for r in records)


@pytest.mark.parametrize("flags", ["00", "01", "03", "0a"])
def test_an_unsampled_producer_gets_no_worker_spans_but_its_ids_in_the_logs(
    exporter: InMemorySpanExporter, flags: str
) -> None:
    import structlog

    from metnos_exec.messages import Job, TraceContext
    from metnos_exec.observe.tracing import Tracing

    parent = f"00-{'ab' * 16}-{'cd' * 8}-{flags}"
    job = Job(executor="x", trace=TraceContext(traceparent=parent))
    tracing = Tracing()
    bound: dict[str, Any] = {}

    def run() -> None:
        with tracing.consumer(job, 1, "q"), tracing.span("plan"):
            bound.update(structlog.contextvars.get_contextvars())

    import contextvars

    contextvars.copy_context().run(run)  # as in a job's own task
    spans = exporter.get_finished_spans()
    assert bound["trace_id"] == "ab" * 16
    if int(flags, 16) & 1:
        names = {s.name for s in spans}
        assert names == {"process x", "plan"}
        (job_span,) = [s for s in spans if s.name == "process x"]
        assert job_span.parent is not None and f"{job_span.parent.span_id:016x}" == "cd" * 8
        assert bound["span_id"] == _hex(job_span)[1]
    else:
        assert spans == ()
        assert bound["span_id"] == "cd" * 8
