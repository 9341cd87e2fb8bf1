from __future__ import annotations

import errno
import io
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
from structlog.testing import capture_logs

from metnos_exec.logs import (
    EVENTS,
    configure_logging,
    finished_level,
    iter_records,
    render_record,
    tail,
)
from metnos_exec.sandbox._types import Usage

TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def test_vocabulary_holds_the_spec_events() -> None:
    for name in [
        "worker.started",
        "job.received",
        "job.rejected",
        "job.started",
        "sandbox.degraded",
        "job.finished",
        "job.retry_scheduled",
        "job.dead_lettered",
        "undo.recorded",
        "undo.applied",
        "lease.lost",
        "worker.draining",
        "worker.stopped",
    ]:
        assert name in EVENTS


def test_json_lines_with_context_and_structs() -> None:
    buf = io.BytesIO()
    configure_logging(file=buf, level="info")
    log = structlog.get_logger("metnos_exec")
    with structlog.contextvars.bound_contextvars(job_id="j1", executor="e", worker="w"):
        log.info("job.finished", usage=Usage(wall_s=0.5), path=Path("/x"))
    log.debug("job.received")  # below the level: dropped
    log.warning("lease.lost", err=ValueError("boom"))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    first = msgspec.json.decode(lines[0])
    assert list(first)[:3] == ["ts", "level", "event"]
    assert TS_RE.match(first["ts"])
    assert first["level"] == "info"
    assert first["job_id"] == "j1" and first["executor"] == "e" and first["worker"] == "w"
    assert first["usage"]["wall_s"] == 0.5
    assert first["path"] == "/x"
    second = msgspec.json.decode(lines[1])
    assert "job_id" not in second  # context unbound after the block
    assert second["err"] == "ValueError: boom"


def _chain_record(method: str, **kw: Any) -> dict[str, Any]:
    """What structlog's processor chain (the renderer before the one-pass `_json_line`)
    makes of a call: the reference the fast path must match."""
    from metnos_exec.logs import _order_keys, _timestamp

    event_dict: Any = dict(kw)
    for proc in (
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _timestamp,
        structlog.processors.StackInfoRenderer(),
        structlog.processors.dict_tracebacks,
        _order_keys,
    ):
        event_dict = proc(None, method, event_dict)
    return dict(event_dict)


def test_the_one_pass_renderer_writes_what_the_processor_chain_did() -> None:
    """Same keys, same order (ts, level, event, the call's fields, the context), the
    call's fields winning over the context, ts and level always the renderer's, and
    tracebacks rendered: for info, warning, exception and a level given by number."""
    buf = io.BytesIO()
    configure_logging(file=buf, level="debug")
    log = structlog.get_logger("metnos_exec")
    calls: list[tuple[str, dict[str, Any]]] = [
        ("info", {"event": "job.started", "timeout_s": 3.0, "degraded": False}),
        ("warning", {"event": "lease.lost", "executor": "call-wins", "visibility_s": 30}),
        ("info", {"event": "job.finished", "level": "bogus", "ts": "bogus", "n": 1}),
        ("debug", {"event": "job.received", "usage": Usage(wall_s=0.25)}),
    ]
    with structlog.contextvars.bound_contextvars(job_id="j1", executor="e", sandbox=None):
        for method, kw in calls:
            getattr(log, method)(**kw)
        log.log(30, "worker.error", error="by number")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("worker.error", error="x")
        expected = [_chain_record(m, **kw) for m, kw in calls]
        calls.append(("warning", {"event": "worker.error", "error": "by number"}))
        expected.append(_chain_record(*calls[-1][:1], **calls[-1][1]))
    lines = [msgspec.json.decode(line) for line in buf.getvalue().splitlines()]
    assert len(lines) == 6
    context = {"job_id", "executor", "sandbox"}
    assert len(expected) == 5
    for got, want, (_, kw) in zip(lines, expected, calls, strict=False):
        want = msgspec.json.decode(msgspec.json.encode(want))  # Structs as JSON
        assert TS_RE.match(got.pop("ts")) and TS_RE.match(want.pop("ts"))
        # The context's own keys come last, in no promised order (the chain's followed
        # the interpreter's context mapping).
        own = [k for k in want if k not in context or k in kw]
        assert list(got)[: len(own)] == own
        assert got == want
    assert lines[1]["executor"] == "call-wins"
    assert lines[2]["level"] == "info"
    failed = lines[5]
    assert list(failed)[:3] == ["ts", "level", "event"]
    assert failed["level"] == "error" and failed["job_id"] == "j1"
    assert failed["exception"][0]["exc_type"] == "ValueError"
    assert failed["exception"][0]["exc_value"] == "boom"


def test_configure_to_path_creates_parent(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "w.jsonl"
    configure_logging(file=target)
    structlog.get_logger("metnos_exec").info("worker.started", concurrency=2)
    # Close the file structlog holds (process-wide in real use; a test must not leak it).
    structlog.get_config()["logger_factory"]._file.close()
    rec = msgspec.json.decode(target.read_bytes().splitlines()[0])
    assert rec["event"] == "worker.started" and rec["concurrency"] == 2


def test_bad_level_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging(level="loud")


def test_capture_logs_sees_library_records() -> None:
    with capture_logs() as logs:
        structlog.get_logger("metnos_exec").info("job.started", timeout_s=3)
    assert logs == [{"event": "job.started", "timeout_s": 3, "log_level": "info"}]


def _write(path: Path, *recs: dict[str, object]) -> None:
    with open(path, "ab") as f:
        for r in recs:
            f.write(msgspec.json.encode(r) + b"\n")


def test_tail_filters(tmp_path: Path) -> None:
    log = tmp_path / "w.jsonl"
    _write(
        log,
        {"ts": "t", "level": "info", "event": "job.received", "job_id": "a"},
        {"ts": "t", "level": "info", "event": "job.finished", "job_id": "a", "status": "ok"},
        {"ts": "t", "level": "warning", "event": "sandbox.degraded", "job_id": "b"},
        {"ts": "t", "level": "info", "event": "job.finished", "job_id": "b"},
    )
    with open(log, "ab") as f:
        f.write(b"not json\n")

    def events(
        job: str | None = None, event: str | None = None, level: str | None = None
    ) -> list[str]:
        return [r["event"] for r in iter_records(log, job=job, event=event, level=level)]

    assert events(job="a") == ["job.received", "job.finished"]
    assert events(event="job.finished") == ["job.finished", "job.finished"]
    assert events(event="job.") == ["job.received", "job.finished", "job.finished"]
    assert events(level="warning") == ["sandbox.degraded"]
    assert events()[-1] == "<unparsed>"
    out = io.StringIO()
    assert tail(log, job="b", out=out) == 2
    text = out.getvalue().splitlines()
    assert "sandbox.degraded" in text[0] and "job_id=b" in text[0]
    assert "\x1b[" not in out.getvalue()
    out = io.StringIO()
    tail(log, event="job.finished", raw=True, out=out)
    assert [msgspec.json.decode(x)["job_id"] for x in out.getvalue().splitlines()] == ["a", "b"]


def test_tail_json_prints_unparsable_lines_raw(tmp_path: Path) -> None:
    log = tmp_path / "w.jsonl"
    _write(log, {"ts": "t", "level": "info", "event": "job.received", "job_id": "a"})
    with open(log, "ab") as f:
        f.write(b"Traceback (most recent call last): {oops\n")
    out = io.StringIO()
    assert tail(log, raw=True, out=out) == 2
    lines = out.getvalue().splitlines()
    assert msgspec.json.decode(lines[0])["job_id"] == "a"
    assert lines[1] == "Traceback (most recent call last): {oops"


def test_finished_level_makes_failures_visible_at_warning(tmp_path: Path) -> None:
    import logging

    assert finished_level("succeeded") == logging.INFO
    assert finished_level("cancelled") == logging.INFO
    assert finished_level("failed") == logging.WARNING
    assert finished_level("timed_out") == logging.WARNING
    assert finished_level("dead") == logging.ERROR
    assert finished_level("succeeded", stored=False) == logging.WARNING
    assert finished_level("dead", stored=False) == logging.ERROR
    assert finished_level("something_new") == logging.WARNING
    # Through the real pipeline and `tail --level warning`.
    log = tmp_path / "w.jsonl"
    stream = open(log, "wb")  # noqa: SIM115 - closed below, after the records are written
    configure_logging(file=stream, level="debug")
    logger = structlog.get_logger("metnos_exec")
    for job, status, stored in [
        ("a", "succeeded", True),
        ("b", "failed", True),
        ("c", "dead", True),
        ("d", "succeeded", False),
    ]:
        logger.log(
            finished_level(status, stored=stored),
            "job.finished",
            job_id=job,
            status=status,
            stored=stored,
        )
    stream.close()
    warned = [r["job_id"] for r in iter_records(log, level="warning")]
    assert warned == ["b", "c", "d"]


def test_render_color() -> None:
    line = render_record({"ts": "t", "level": "error", "event": "job.finished"}, color=True)
    assert "\x1b[" in line and "job.finished" in line


def test_follow_survives_truncation_and_rotation(tmp_path: Path) -> None:
    log = tmp_path / "w.jsonl"
    _write(log, {"level": "info", "event": "e1"})
    seen: list[str] = []
    got = threading.Condition()
    stop = threading.Event()

    def reader() -> None:
        for rec in iter_records(log, follow=True, poll_s=0.01, should_stop=stop.is_set):
            with got:
                seen.append(str(rec["event"]))
                got.notify_all()

    def wait_for(n: int) -> None:
        with got:
            assert got.wait_for(lambda: len(seen) >= n, timeout=5), seen

    t = threading.Thread(target=reader)
    t.start()
    try:
        wait_for(1)
        # A half-written line is held until its newline arrives.
        with open(log, "ab") as f:
            f.write(b'{"event": "e2"')
            f.flush()
            f.write(b"}\n")
        wait_for(2)
        # Truncation: start again from the top.
        log.write_bytes(b'{"event": "e3"}\n')
        wait_for(3)
        # Rotation: the path names a new file.
        os.rename(log, tmp_path / "w.jsonl.1")
        _write(log, {"event": "e4"})
        wait_for(4)
    finally:
        stop.set()
        t.join(5)
    assert seen == ["e1", "e2", "e3", "e4"]


def test_every_event_the_package_emits_is_in_the_vocabulary() -> None:
    import metnos_exec.logs as logs_mod

    root = Path(logs_mod.__file__).parent
    # `_log.info("event", ...)`, or `_log.log(level, "event", ...)` (computed levels).
    call = re.compile(
        r"_log\.(?:(?:debug|info|warning|error|critical|exception)\("
        r"|log\([^,()]*(?:\([^()]*\))?[^,()]*,)\s*\"([^\"]+)\""
    )
    assert call.findall('_log.log(finished_level(r.status, stored=ok), "job.finished",') == [
        "job.finished"
    ]
    emitted = {m for p in root.rglob("*.py") for m in call.findall(p.read_text())}
    assert {"job.received", "job.finished", "worker.started"} <= emitted  # the scan works
    assert sorted(emitted - set(EVENTS)) == []


def test_timestamps_are_utc_milliseconds_across_a_second_boundary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from metnos_exec import logs

    stamps: list[str] = []
    for now in (1_700_000_000.9996, 1_700_000_001.0004, 1_700_000_001.25, 1_699_999_999.5):
        monkeypatch.setattr(logs.time, "time", lambda now=now: now)
        stamps.append(logs._timestamp(None, "info", {})["ts"])
    assert stamps == [
        "2023-11-14T22:13:20.999Z",
        "2023-11-14T22:13:21.000Z",
        "2023-11-14T22:13:21.250Z",
        "2023-11-14T22:13:19.500Z",
    ]


class _FullDisk(io.BytesIO):
    """A log file on a disk that is full until `full` is cleared."""

    def __init__(self) -> None:
        super().__init__()
        self.full = True

    def write(self, data: Any) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def test_a_log_record_that_cannot_be_written_never_raises() -> None:
    """Issue 9: the log on a full disk (often the queue's disk) must not take the worker
    down; what was lost is said once the disk has room again."""
    stream = _FullDisk()
    configure_logging(file=stream)
    log = structlog.get_logger("metnos_exec")
    for _ in range(3):
        log.error("broker.error", op="ack", code="E_BROKER_FULL")
    stream.full = False
    log.info("broker.recovered", op="ack")
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [(r["event"], r.get("count")) for r in lines] == [
        ("log.dropped", 3),
        ("broker.recovered", None),
    ]
    assert TS_RE.match(lines[0]["ts"])


def test_tail_survives_a_line_no_decoder_can_take(tmp_path: Path) -> None:
    """Issue 9, finding 1's class: a line nested too deeply for the JSON decoder is shown
    as an unparsed line, not a crash of `tail`."""
    log = tmp_path / "w.jsonl"
    deep = b'{"event":"x","a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    log.write_bytes(b'{"event":"job.received"}\n' + deep + b'\n{"event":"job.finished"}\n')
    events = [r["event"] for r in iter_records(log)]
    assert events == ["job.received", "<unparsed>", "job.finished"]


class _FillingDisk(io.BytesIO):
    """A log file whose disk fills up in the middle of a record: the first write takes
    only part of what it is given (as write(2) does at the last free block), the next
    ones fail, until `full` is cleared."""

    def __init__(self) -> None:
        super().__init__()
        self.room: int | None = 7
        self.full = False

    def write(self, data: Any) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        if self.room is not None:
            part = bytes(data)[: self.room]
            self.room, self.full = None, True
            return super().write(part)
        return super().write(data)


def test_a_record_cut_short_by_a_full_disk_leaves_every_other_line_whole() -> None:
    stream = _FillingDisk()
    configure_logging(file=stream)
    log = structlog.get_logger("metnos_exec")
    log.info("worker.started")  # 7 bytes of it reach the file
    log.error("broker.error", op="ack")
    stream.full = False
    log.info("broker.recovered", op="ack")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[0] == b'{"ts":"'  # the torn record, ended
    events = [json.loads(x)["event"] for x in lines[1:]]
    assert events == ["log.dropped", "broker.recovered"]


#: A program using the Python API that never configures logging; its queue file was made
#: readable by everyone, so opening it logs `files.tightened` warnings (and `--configured`
#: configures structlog itself first, as an application with its own logging does).
API_PROGRAM = """\
import sys
import anyio
import structlog
from metnos_exec.client import Client

if "--configured" in sys.argv:
    structlog.configure(
        processors=[lambda _l, _m, ev: f"APP {ev['event']}"],
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
    )

async def main() -> None:
    async with Client("sqlite:///q.db") as client:
        print("result:", await client.result("01NOSUCHJOB"))

anyio.run(main)
"""


def test_the_python_api_never_prints_log_records_on_stdout(tmp_path: Path) -> None:
    """Issue 18, item 10: a program using `Client` without configuring logging got the
    library's records on its stdout (structlog's default prints there), in the middle of
    what the program prints. Unconfigured, the package writes warnings and errors as JSON
    lines on stderr and nothing else; an application that configures structlog gets them
    its way."""
    import subprocess
    import sys

    (tmp_path / "prog.py").write_text(API_PROGRAM)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "prog.py", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )

    first = run()
    assert first.returncode == 0 and first.stdout == "result: None\n", first
    for name in ("q.db", "q.db-wal", "q.db-shm"):
        if (tmp_path / name).exists():
            (tmp_path / name).chmod(0o644)
    out = run()
    assert out.returncode == 0, out.stderr
    assert out.stdout == "result: None\n"
    records = [json.loads(line) for line in out.stderr.splitlines()]
    assert records and {r["event"] for r in records} == {"files.tightened"}
    assert all(r["level"] == "warning" and TS_RE.match(r["ts"]) for r in records)

    (tmp_path / "q.db").chmod(0o644)
    app = run("--configured")
    assert app.returncode == 0 and app.stderr == "", app.stderr
    *logged, printed = app.stdout.splitlines()
    assert printed == "result: None" and logged and set(logged) == {"APP files.tightened"}


def test_library_code_logs_only_through_the_package_logger() -> None:
    # `structlog.get_logger()` directly would print to stdout in a program that configured
    # nothing (see the test above): every module takes `metnos_exec.logs.get_logger()`.
    import metnos_exec.logs as logs_mod

    root = Path(logs_mod.__file__).parent
    direct = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "logs.py" and "structlog.get_logger(" in p.read_text()
    ]
    assert direct == []
