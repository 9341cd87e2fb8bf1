"""The parts of `metnos_exec.observe`: the bind rule, the reason classes, the no-op
default, the exposition (parsed by prometheus_client's own parser) and the ``/metrics``
listener with its queue cache (a double of the worker and its broker: unit tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.errors import BadConfig
from metnos_exec.messages import Job, Result
from metnos_exec.observe import NULL_OBSERVER, make_observer
from metnos_exec.observe.http import PUBLIC_FLAG, check_bind, serve_metrics
from metnos_exec.observe.metrics import QUEUE_CACHE_S, Metrics, egress_reason
from metnos_exec.sandbox._types import AXES, AxisVerdict, ContainmentReport, Success

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("127.0.0.2:0", ("127.0.0.2", 0)),
        ("[::1]:9464", ("::1", 9464)),
        ("localhost:9464", ("localhost", 9464)),
    ],
)
def test_loopback_binds_are_taken(text: str, want: tuple[str, int]) -> None:
    assert check_bind(text) == want


def test_a_bind_outside_loopback_needs_the_public_flag() -> None:
    with pytest.raises(BadConfig) as err:
        check_bind("metrics.example:9464")
    assert PUBLIC_FLAG in err.value.message
    assert check_bind("metrics.example:9464", public=True) == ("metrics.example", 9464)


@pytest.mark.parametrize("text", ["9464", "127.0.0.1", "127.0.0.1:x", "127.0.0.1:70000", ":1"])
def test_a_malformed_bind_is_refused(text: str) -> None:
    with pytest.raises(BadConfig, match="HOST:PORT"):
        check_bind(text)


def test_the_worker_refuses_a_public_bind_without_the_flag(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "metnos_exec", "worker", "--executors", str(tmp_path)]
    argv += ["--broker", f"sqlite:///{tmp_path / 'q.db'}", "--metrics", "metrics.example:9464"]
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    assert done.returncode == 2
    assert PUBLIC_FLAG in done.stderr.decode()
    assert not (tmp_path / "q.db").exists()  # refused before anything was opened


def test_egress_reasons_become_bounded_classes() -> None:
    assert egress_reason(True, "allowed by network:https example.com") == "rule"
    assert egress_reason(False, "evil.example resolves to an address on the deny list") == (
        "deny_list"
    )
    assert egress_reason(False, "nowhere.example does not resolve") == "no_resolve"
    assert egress_reason(False, "anything else, with a host in it") == "policy"


def test_nothing_asked_is_the_no_op_observer() -> None:
    # This process has no tracer provider (the tracing tests unset theirs).
    assert make_observer() is NULL_OBSERVER
    with NULL_OBSERVER.phase("plan", Job(executor="x")):
        pass


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_exposition_parses_and_counts() -> None:
    m = Metrics()
    job = Job(executor="noop", submitted_at=100.0)
    m.leased(job, 1, 100.25)
    for seconds in (0.0002, 0.003, 0.003, 7.0, 5000.0):
        m.phase("run", "noop", seconds)
    kept = AxisVerdict("kept", "")
    report = ContainmentReport("bwrap", kept, AxisVerdict("lost", "x"), kept, kept, kept)
    m.finished(job, Result(job_id=job.id, status="succeeded", exit=Success(), containment=report))
    fams = _families(m.render().decode())
    run = {
        (s.name, s.labels.get("le")): s.value
        for s in fams["metnos_job_phase_seconds"].samples
        if s.labels["phase"] == "run"
    }
    assert run[("metnos_job_phase_seconds_bucket", "0.0005")] == 1
    assert run[("metnos_job_phase_seconds_bucket", "0.005")] == 3
    assert run[("metnos_job_phase_seconds_bucket", "10.0")] == 4
    assert run[("metnos_job_phase_seconds_bucket", "+Inf")] == 5
    assert run[("metnos_job_phase_seconds_count", None)] == 5
    assert run[("metnos_job_phase_seconds_sum", None)] == pytest.approx(5007.0062)
    wait = [
        s.value
        for s in fams["metnos_job_phase_seconds"].samples
        if s.labels["phase"] == "queue_wait" and s.name.endswith("_sum")
    ]
    assert wait == [pytest.approx(0.25)]
    walls = {
        (s.labels["axis"], s.labels["verdict"]): s.value for s in fams["metnos_containment"].samples
    }
    assert walls == {**{(a, "kept"): 1.0 for a in AXES if a != "network"}, ("network", "lost"): 1}
    (finished,) = fams["metnos_jobs_finished"].samples
    assert finished.name == "metnos_jobs_finished_total"
    assert finished.labels == {
        "executor": "noop",
        "status": "succeeded",
        "exit": "success",
        "arm": "bwrap",
    }


class _Stats:
    queued, delayed, running, done, dead = 3, 1, 2, 10, 1
    oldest_queued_at = 1.0


class _Broker:
    queue_id = "q"

    def __init__(self) -> None:
        self.calls = 0

    async def stats(self) -> _Stats:
        self.calls += 1
        return _Stats()


class _Worker:
    running, free_slots = 2, 2

    def __init__(self) -> None:
        self.broker = _Broker()


async def _get(port: int, request: bytes) -> bytes:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(request)
        out = b""
        try:
            while True:
                out += await stream.receive()
        except anyio.EndOfStream:
            return out


@pytest.mark.anyio
async def test_metrics_are_served_and_the_queue_read_once_per_window() -> None:
    m = Metrics(bind=("127.0.0.1", 0))
    worker = _Worker()
    async with anyio.create_task_group() as tg:
        await tg.start(serve_metrics, m, worker)
        assert m.port
        first = await _get(m.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        second = await _get(m.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        missing = await _get(m.port, b"GET / HTTP/1.1\r\n\r\n")
        posted = await _get(m.port, b"POST /metrics HTTP/1.1\r\n\r\n")
        tg.cancel_scope.cancel()
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and second.startswith(b"HTTP/1.1 200")
    assert missing.startswith(b"HTTP/1.1 404") and posted.startswith(b"HTTP/1.1 405")
    # Two scrapes within QUEUE_CACHE_S: the broker was asked once.
    assert worker.broker.calls == 1 and QUEUE_CACHE_S > 0
    body = first.split(b"\r\n\r\n", 1)[1].decode()
    queue = {s.labels["state"]: s.value for s in _families(body)["metnos_queue_jobs"].samples}
    assert queue == {"queued": 3, "delayed": 1, "leased": 2, "done": 10, "dead": 1}
    assert _families(body)["metnos_slots_free"].samples[0].value == 2


@pytest.mark.anyio
async def test_a_taken_port_is_a_config_error() -> None:
    m = Metrics(bind=("127.0.0.1", 0))
    async with anyio.create_task_group() as tg:
        await tg.start(serve_metrics, m, _Worker())
        assert m.port
        again = Metrics(bind=("127.0.0.1", m.port))
        with pytest.raises(BadConfig, match="cannot serve metrics"):
            await serve_metrics(again, _Worker())
        tg.cancel_scope.cancel()


def test_the_worker_refuses_a_metrics_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "executors").mkdir()
        argv = [sys.executable, "-m", "metnos_exec", "worker", "--burst"]
        argv += ["--executors", str(tmp_path / "executors"), "--log-file", str(tmp_path / "w")]
        argv += ["--broker", f"sqlite:///{tmp_path / 'q.db'}", "--metrics", f"127.0.0.1:{port}"]
        env = {**os.environ, "HOME": str(tmp_path)}
        done = subprocess.run(argv, capture_output=True, timeout=60, check=False, env=env)
    assert done.returncode == 2, done.stderr
    assert f"E_CONFIG: cannot serve metrics on 127.0.0.1:{port}" in done.stderr.decode()


@pytest.mark.anyio
async def test_a_producer_counts_its_submits_and_sends_no_trace_untraced() -> None:
    from prometheus_client import REGISTRY

    from metnos_exec.brokers.memory import MemoryBroker
    from metnos_exec.client import Client

    def count() -> float:
        got = REGISTRY.get_sample_value("metnos_jobs_submitted_total", {"executor": "counted"})
        return got or 0.0

    before = count()
    broker = MemoryBroker()
    async with Client(broker) as client:
        job_id = await client.submit("counted", {})
        await client.submit("counted", {})
    assert count() == before + 2
    leases = await broker.lease("w", visibility_s=5)
    assert leases[0].job.id == job_id and leases[0].job.trace is None
