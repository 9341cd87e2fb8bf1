from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers import open_broker
from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.client import Client, SyncClient, default_broker_url
from metnos_exec.errors import BadMessage, IdempotencyConflict, UndoUnavailable
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.sandbox.doubles import EchoSandbox
from metnos_exec.sandbox.select import ArmChoice
from metnos_exec.supervisor import Supervisor, SupervisorConfig


@pytest.fixture
def registry(tmp_path: Path) -> ExecutorRegistry:
    d = tmp_path / "ex" / "echo"
    d.mkdir(parents=True)
    (d / "manifest.toml").write_text(
        'name = "echo"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
        '[args.text]\ntype = "string"\ndefault = ""\n'
    )
    (d / "main.py").write_text("")
    return ExecutorRegistry.load(tmp_path / "ex")


def echo_chooser(runtime: str, **_: Any) -> ArmChoice:
    return ArmChoice(EchoSandbox())


def supervisor(broker: Any, registry: ExecutorRegistry) -> Supervisor:
    return Supervisor(
        broker,
        registry,
        SupervisorConfig(worker_id="w", home="/none"),
        arm_chooser=echo_chooser,
    )


@pytest.mark.anyio
async def test_submit_result_run_cancel(registry: ExecutorRegistry) -> None:
    broker = MemoryBroker()
    async with Client(broker) as client:
        job_id = await client.submit("echo", {"text": "a"}, idempotency_key="k1")
        assert await client.submit("echo", {"text": "a"}, idempotency_key="k1") == job_id
        with pytest.raises(IdempotencyConflict):
            await client.submit("echo", {"text": "other"}, idempotency_key="k1")
        assert await client.result(job_id) is None
        assert await client.result(job_id, wait=0.01) is None
        queued = await client.submit("echo", {"text": "b"})
        assert await client.cancel(queued) == "cancelled"
        assert await client.cancel("nope") == "unknown"
        async with anyio.create_task_group() as tg:
            sup = supervisor(broker, registry)
            await tg.start(sup.run)
            result = await client.run("echo", {"text": "hi"}, timeout=5)
            assert result.status == "succeeded" and result.output == {"text": "hi"}
            first = await client.result(job_id, wait=True)
            assert first is not None and first.output == {"text": "a"}
            await sup.drain(1)
        cancelled = await client.result(queued)
        assert cancelled is not None and cancelled.status == "cancelled"
        # An echo job changes no file: there is nothing to undo, said before queueing.
        with pytest.raises(UndoUnavailable, match="recorded no file changes") as info:
            await client.undo(job_id)
        assert info.value.code == "E_UNDO_UNAVAILABLE"
        with pytest.raises(UndoUnavailable, match="no result"):
            await client.submit_undo("nope")
        with pytest.raises(BadMessage, match="max_attempts"):
            await client.submit("echo", {}, max_attempts=0)
    # The client did not own the broker: it is still usable.
    assert (await broker.stats()).done == 3


@pytest.mark.anyio
async def test_run_times_out_waiting(registry: ExecutorRegistry) -> None:
    async with Client("memory://") as client:
        with pytest.raises(TimeoutError):
            await client.run("echo", {}, wait=0.01)


def test_default_broker_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("METNOS_BROKER", raising=False)
    assert default_broker_url() == "sqlite:///./metnos.db"
    monkeypatch.setenv("METNOS_BROKER", "memory://")
    assert default_broker_url() == "memory://"


def test_sync_client_on_sqlite(tmp_path: Path, registry: ExecutorRegistry) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    with SyncClient(url) as client:
        job_id = client.submit("echo", {"text": "sync"})
        assert client.result(job_id) is None

        async def serve() -> None:
            async with open_broker(url) as broker:
                await supervisor(broker, registry).run(burst=True)

        anyio.run(serve)
        result = client.result(job_id, wait=5)
        assert result is not None and result.status == "succeeded"
        assert result.output == {"text": "sync"}
        assert client.cancel(job_id) == "finished"
        with pytest.raises(UndoUnavailable):
            client.undo(job_id)
    client.close()  # idempotent


def test_sync_client_idempotency_conflict(tmp_path: Path) -> None:
    with SyncClient(f"sqlite:///{tmp_path / 'q.db'}") as client:
        first = client.submit("echo", {"text": "a"}, idempotency_key="step-1")
        assert client.submit("echo", {"text": "a"}, idempotency_key="step-1") == first
        with pytest.raises(IdempotencyConflict) as info:
            client.submit("echo", {"text": "b"}, idempotency_key="step-1")
        assert info.value.original_job_id == first
