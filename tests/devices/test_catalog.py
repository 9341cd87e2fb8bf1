"""The executor catalog: server workers publish, submit refuses device jobs that must stay."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers import Broker, open_broker
from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.brokers.sqlite import SCHEMA_VERSION, SQLiteBroker
from metnos_exec.client import Client
from metnos_exec.devices.catalog import ExecutorInfo, device_refusal
from metnos_exec.errors import BrokerUnavailable, ServerPinned
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.sandbox.doubles import EchoSandbox
from metnos_exec.sandbox.select import ArmChoice
from metnos_exec.supervisor import Supervisor
from metnos_exec.supervisor.config import split_settings

pytestmark = pytest.mark.anyio

HEAD = 'version = "1"\nruntime = "python"\nentry = "main.py"\n'


@pytest.fixture
def executors(tmp_path: Path) -> Path:
    root = tmp_path / "executors"
    specs = {
        "portable": "",
        "server_only": "packable = false\n",
        # Provider authority only in "send" mode: pinned per invocation, not per executor.
        "mailer": '[args.mode]\ntype = "string"\nenum = ["draft", "send"]\ndefault = "draft"\n'
        '[[capabilities]]\nname = "provider:access"\nhints = ["google_mail"]\n'
        'when = { arg = "mode", values = ["send"] }\n',
    }
    for name, extra in specs.items():
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "manifest.toml").write_text(f'name = "{name}"\n{HEAD}{extra}')
        (folder / "main.py").write_text("print('{}')\n")
    return root


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def broker(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Broker]:
    b: Broker
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        b = open_broker(f"{server.url}?prefix={tmp_path.name}")
    else:
        b = MemoryBroker() if request.param == "memory" else SQLiteBroker(tmp_path / "q.db")
    async with b:
        yield b


def server(broker: Broker, executors: Path, **kw: Any) -> Supervisor:
    """A worker on the echo double (``device="server"`` unless given)."""
    config, collaborators = split_settings({"worker_id": "srv", **kw})
    return Supervisor(
        broker,
        ExecutorRegistry.load(executors),
        config,
        arm_chooser=lambda runtime, **_: ArmChoice(sandbox=EchoSandbox()),
        **collaborators,
    )


async def publish(broker: Broker, executors: Path, device: str = "server") -> None:
    await server(broker, executors, device=device).run(burst=True)


async def test_a_device_job_for_a_non_packable_executor_is_refused_at_submit(
    broker: Broker, executors: Path
) -> None:
    await publish(broker, executors)
    client = Client(broker)
    with pytest.raises(ServerPinned, match="not packable") as info:
        await client.submit("server_only", {}, device="phone")
    assert info.value.code == "E_SERVER_PINNED"
    with pytest.raises(ServerPinned, match="provider authority"):
        await client.submit("mailer", {"mode": "send"}, device="phone")
    assert (await broker.stats()).queued == 0  # nothing was queued
    # What may go: a packable executor, a provider executor whose binding is inactive,
    # and anything for the server.
    await client.submit("portable", {}, device="phone")
    await client.submit("mailer", {"mode": "draft"}, device="phone")
    await client.submit("server_only", {})
    await client.submit("server_only", {}, device="server")
    assert (await broker.stats()).queued == 4


async def test_an_executor_nobody_published_is_queued_and_the_device_refuses_it(
    broker: Broker, executors: Path
) -> None:
    # No server worker has run yet: submit cannot know; the device worker is the backstop.
    client = Client(broker)
    job_id = await client.submit("server_only", {}, device="phone")
    await publish(broker, executors, device="phone")  # a device worker publishes nothing
    result = await broker.get_result(job_id)
    assert result is not None and result.status == "rejected"
    assert result.error is not None and result.error.code == "E_SERVER_PINNED"
    assert await broker.executor_info("server_only") is None


async def lose_catalog(broker: Broker) -> None:
    """What a broker restart without its data does to the catalog (Redis without
    persistence, a queue file restored from before the worker started)."""
    if isinstance(broker, MemoryBroker):
        broker._catalog.clear()
    elif isinstance(broker, SQLiteBroker):
        with contextlib.closing(sqlite3.connect(broker.path)) as db, db:
            db.execute("DELETE FROM executors")
    else:
        from metnos_exec.brokers.redis import RedisBroker

        assert isinstance(broker, RedisBroker)
        await broker._redis.delete([broker.keys.executors])


async def wait_published(broker: Broker, name: str) -> None:
    with anyio.fail_after(10):
        while await broker.executor_info(name) is None:  # noqa: ASYNC110 - polls another store
            await anyio.sleep(0.01)


async def test_a_catalog_lost_while_the_worker_runs_is_published_again(
    broker: Broker, executors: Path
) -> None:
    sup = server(broker, executors, idle_poll_s=0.05, catalog_every_s=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        await wait_published(broker, "server_only")
        await lose_catalog(broker)
        assert await broker.executor_info("server_only") is None
        await wait_published(broker, "server_only")
        with pytest.raises(ServerPinned):
            await Client(broker).submit("server_only", {}, device="phone")
        await sup.drain(0)


async def test_a_publication_that_failed_at_start_is_tried_again(executors: Path) -> None:
    class Flaky(MemoryBroker):
        failures = 2

        async def publish_executors(self, infos: Sequence[ExecutorInfo]) -> None:
            if self.failures:
                self.failures -= 1
                raise BrokerUnavailable("the store restarts")
            await super().publish_executors(infos)

    broker = Flaky()
    sup = server(broker, executors, idle_poll_s=0.05, store_backoff=lambda n: 0.01 * n)
    async with broker, anyio.create_task_group() as tg:
        await tg.start(sup.run)
        # The next try is the store's backoff away, not catalog_every_s (5 minutes).
        await wait_published(broker, "server_only")
        assert broker.failures == 0 and sup.stats["broker_errors"] == 2
        await sup.drain(0)


def test_device_refusal_mirrors_the_planner(executors: Path) -> None:
    registry = ExecutorRegistry.load(executors)
    assert device_refusal(registry["portable"].manifest, {}) is None
    assert device_refusal(registry["mailer"].manifest, {}) is None
    assert device_refusal(registry["mailer"].manifest, {"mode": "send"}) is not None
    # Arguments the schema refuses: the worker says why, with the precise error.
    assert device_refusal(registry["mailer"].manifest, {"mode": 3}) is None


def test_cli_submit_to_a_device_exits_3(
    executors: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import anyio

    from metnos_exec.cli import main

    url = f"sqlite:///{tmp_path}/cli.db"

    async def serve_once() -> None:
        async with open_broker(url) as b:
            await publish(b, executors)

    anyio.run(serve_once)
    with pytest.raises(SystemExit) as info:
        main(["submit", "server_only", "--device", "phone", "--broker", url])
    assert info.value.code == 3
    assert "E_SERVER_PINNED" in capsys.readouterr().err
    assert main(["submit", "portable", "--device", "phone", "--broker", url]) == 0


def test_a_queue_file_made_before_the_catalog_gains_it(tmp_path: Path) -> None:
    import anyio

    db = tmp_path / "old.db"
    SQLiteBroker(db)._db.close()
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("DROP TABLE executors")
        conn.commit()

    async def check() -> None:
        async with SQLiteBroker(db) as b:
            assert await b.executor_info("x") is None
            await b.publish_executors([])

    anyio.run(check)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        assert conn.execute("SELECT count(*) FROM executors").fetchone() == (0,)


def test_a_newer_workers_entry_is_read_without_the_fields_this_build_lacks(
    executors: Path,
) -> None:
    """A rolling upgrade: a newer worker publishes manifests with fields this build does
    not know (top level, in limits, in an argument, in a capability). An older producer
    still reads what it knows (the pinning and the tool schema), instead of losing the
    executor from its submit-time checks and its MCP tools; a known field with a value it
    cannot read still makes the entry unreadable, and so do bytes that are not JSON."""
    import json

    from metnos_exec.devices.catalog import decode_info, encode_info

    manifest = ExecutorRegistry.load(executors)["mailer"].manifest
    entry = json.loads(encode_info(ExecutorInfo(name="mailer", manifest=manifest, worker="w2")))
    entry["from_the_future"] = 1
    entry["manifest"]["sandbox_profile"] = "strict"
    entry["manifest"]["limits"]["gpu_mb"] = 512
    entry["manifest"]["args"]["mode"]["widget"] = "radio"
    entry["manifest"]["capabilities"][0]["scope"] = "mail.send"
    info = decode_info(json.dumps(entry))
    assert info is not None
    assert info.manifest == manifest and info.worker == "w2"
    assert device_refusal(info.manifest, {"mode": "send"}) is not None
    assert device_refusal(info.manifest, {"mode": "draft"}) is None

    entry["manifest"]["limits"]["timeout_s"] = "soon"
    assert decode_info(json.dumps(entry)) is None
    assert decode_info(b"\xff not json") is None
