"""Progress from executors (`metnos_exec.sandbox.progress`): the line protocol, the reader's
bounds (size, coalescing, malformed lines), and the channel through the real bwrap arm
(the guest inherits the pipe; the walls are the same) and the direct arm."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from metnos_exec.sandbox._types import ResourceLimits, SandboxJob, Success
from metnos_exec.sandbox.bwrap import BwrapSandbox, bwrap_probe
from metnos_exec.sandbox.direct import DirectSandbox
from metnos_exec.sandbox.progress import (
    MAX_LINE_BYTES,
    MAX_MESSAGE_CHARS,
    PROGRESS_FD_ENV,
    ProgressReader,
    ProgressReport,
    parse_line,
    progress_sink,
    reporting_progress,
)
from tests.conftest import need

PY = "/usr/bin/python3"


# --- the protocol, pure ---------------------------------------------------------------


def test_parse_line_takes_a_fraction_a_message_or_both() -> None:
    assert parse_line(b'{"progress": 0.5, "message": "half"}') == (0.5, "half")
    assert parse_line(b'{"progress": 1}') == (1.0, "")
    assert parse_line(b'{"message": "only words"}') == (None, "only words")
    long = json.dumps({"message": "x" * 300}).encode()
    assert parse_line(long) == (None, "x" * MAX_MESSAGE_CHARS)


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[0.5]",
        b"{}",
        b'{"progress": 1.5}',
        b'{"progress": -0.1}',
        b'{"progress": "half"}',
        b'{"progress": true}',
        b'{"progress": NaN}',
        b'{"message": 7}',
        b'{"progress": 0.1, "message": "' + b"x" * MAX_LINE_BYTES + b'"}',
        b"\xff\xfe",
    ],
)
def test_parse_line_refuses_what_is_not_a_progress_object(line: bytes) -> None:
    assert parse_line(line) is None


def test_reader_keeps_the_latest_and_counts_the_rest() -> None:
    seen: list[ProgressReport] = []
    reader = ProgressReader(seen.append)
    reader.feed(b'{"progress": 0.1}\n{"progress": 0.2}\n{"progress": 0.3, "mess')
    assert seen[-1] == ProgressReport(0.2, "", lines=2, dropped=1, malformed=0)
    reader.feed(b'age": "three"}\n')  # the rest of a line split across two reads
    assert seen[-1] == ProgressReport(0.3, "three", lines=3, dropped=1, malformed=0)
    reader.feed(b"garbage\n")
    assert seen[-1] == ProgressReport(0.3, "three", lines=4, dropped=1, malformed=1)
    reader.feed(b'{"message": "no fraction"}\n')  # the fraction stays the last one given
    assert seen[-1] == ProgressReport(0.3, "no fraction", lines=5, dropped=1, malformed=1)


def test_reader_skips_a_line_too_long_without_keeping_it() -> None:
    seen: list[ProgressReport] = []
    reader = ProgressReader(seen.append)
    reader.feed(b"x" * MAX_LINE_BYTES)  # no newline yet, and already too long
    assert seen[-1].malformed == 1 and reader._partial == b""
    reader.feed(b"y" * 100_000)  # still the same line: not kept, not counted again
    assert reader._partial == b"" and seen[-1].malformed == 1
    reader.feed(b'yyy\n{"progress": 0.75}\n')
    assert seen[-1] == ProgressReport(0.75, "", lines=2, dropped=0, malformed=1)


def test_no_sink_outside_a_reporting_scope() -> None:
    assert progress_sink() is None
    seen: list[ProgressReport] = []
    with reporting_progress(seen.append):
        assert progress_sink() is not None
    assert progress_sink() is None


# --- through the arms -------------------------------------------------------------------

GUEST = r"""
import json, os, sys
fd = os.environ.get("METNOS_PROGRESS_FD")
if fd is None:
    print(json.dumps({"channel": None}))
    sys.exit(0)
out = os.fdopen(int(fd), "w", buffering=1)
for i in range(1, 4):
    out.write(json.dumps({"progress": i / 4, "message": f"step {i}"}) + "\n")
out.write("not a progress line\n")
out.write(json.dumps({"progress": 1.0, "message": "done"}) + "\n")
fds = sorted(os.listdir("/proc/self/fd"))
print(json.dumps({"channel": int(fd), "uid": os.getuid(), "fds": fds}))
"""


def _bwrap() -> BwrapSandbox:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    return BwrapSandbox()


def _job() -> SandboxJob:
    need(os.path.exists(PY), f"{PY} (a system interpreter the guest can see) is missing")
    return SandboxJob(
        argv=(PY, "-I", "-c", GUEST),
        env={"PATH": "/usr/bin:/bin"},
        limits=ResourceLimits(wall_time_s=30),
    )


@pytest.mark.anyio
@pytest.mark.bwrap
@pytest.mark.parametrize("arm_name", ["bwrap", "direct"])
async def test_the_guest_reports_through_the_channel(arm_name: str) -> None:
    arm = _bwrap() if arm_name == "bwrap" else DirectSandbox()
    seen: list[ProgressReport] = []
    with reporting_progress(seen.append):
        outcome = await arm.run(_job())
    assert isinstance(outcome.exit, Success), outcome.stderr
    doc = json.loads(outcome.stdout)
    assert doc["channel"] is not None
    # The latest line and its message; the malformed one never fails the job (read in
    # one go with the others, it is coalesced away: dropped, or malformed if parsed).
    assert seen[-1].fraction == 1.0 and seen[-1].message == "done"
    assert seen[-1].lines == 5 and seen[-1].dropped + seen[-1].malformed <= 4
    if arm_name == "bwrap":
        # The walls are the same: the guest is still the unprivileged user, and the only
        # descriptors it holds are its stdio, the progress pipe and listdir's own.
        assert doc["uid"] != 0
        assert {int(fd) for fd in doc["fds"]} - {0, 1, 2, doc["channel"]} <= {3}
        assert outcome.containment.process_tree.state == "kept"


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_no_channel_without_a_listener() -> None:
    outcome = await _bwrap().run(_job())
    assert isinstance(outcome.exit, Success), outcome.stderr
    assert json.loads(outcome.stdout) == {"channel": None}
    assert PROGRESS_FD_ENV not in _job().env


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_a_flood_is_throttled_and_the_job_still_succeeds(tmp_path: Path) -> None:
    """A guest writing progress as fast as it can for 1.5 s: its writes block on the full
    pipe (the worker reads at most 160 KiB a second), and it ends on time with Success."""
    flood = r"""
import json, os, sys, time
out = os.fdopen(int(os.environ["METNOS_PROGRESS_FD"]), "wb", buffering=0)
line = b'{"progress": 0.5, "message": "flooding"}\n'
end, n = time.monotonic() + 1.5, 0
while time.monotonic() < end:
    out.write(line * 64)
    n += 64
out.write(b'{"progress": 1.0, "message": "flood over"}\n')
print(json.dumps({"written": (n + 1), "bytes": n * len(line)}))
"""
    job = msgspec.structs.replace(_job(), argv=(PY, "-I", "-c", flood))
    seen: list[ProgressReport] = []
    with reporting_progress(seen.append):
        outcome = await _bwrap().run(job)
    assert isinstance(outcome.exit, Success), outcome.stderr
    doc = json.loads(outcome.stdout)
    # Throttled: what it could write is bounded by the reader's rate, plus a pipe's worth.
    bound = 160 * 1024 * (outcome.usage.wall_s + 0.5) + 128 * 1024
    assert doc["bytes"] < bound, (doc, outcome.usage.wall_s)
    assert seen[-1].dropped > 0 and seen[-1].malformed == 0
    assert seen[-1].fraction == 1.0 and seen[-1].message == "flood over"
    # The reader read it all in the end (nothing lost but what it coalesced).
    assert seen[-1].lines == doc["written"]
    # The sink was called at most once a read: about ten times a second, not per line.
    assert len(seen) < 10 * (outcome.usage.wall_s + 1) + 5
