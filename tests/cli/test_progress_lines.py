"""How ``result`` and ``status --jobs`` show a running job's progress (the line for people,
and ``--json``'s field)."""

from __future__ import annotations

from metnos_exec.brokers.presence import JobListing
from metnos_exec.cli.queue import _job_lines, _jobs_doc
from metnos_exec.messages import Progress, describe_progress


def test_describe_progress() -> None:
    assert describe_progress(Progress(fraction=0.4, message="note 2 of 5")) == (
        "progress 40% (note 2 of 5)"
    )
    assert describe_progress(Progress(message="thinking")) == "progress (thinking)"
    assert describe_progress(Progress(fraction=1.0)) == "progress 100%"


def test_status_jobs_shows_the_running_jobs_progress() -> None:
    jobs = [
        JobListing(job_id="J1", executor="slow", device="server", state="running", attempt=1),
        JobListing(job_id="J2", executor="slow", device="server", state="queued"),
    ]
    progress = {"J1": Progress(fraction=0.5, message="half way", attempt=1)}
    lines = _job_lines(jobs, progress)
    assert lines[1].endswith("progress 50% (half way)") and "progress" not in lines[2]
    docs = _jobs_doc(jobs, progress)
    assert docs[0]["progress"]["fraction"] == 0.5 and "progress" not in docs[1]
