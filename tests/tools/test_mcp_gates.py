"""An approval gate in MCP Tasks (issue 21): a job awaiting approval is ``input_required``,
its change set in ``_meta``; once answered, ``completed``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.changeset import ChangeEntry, ChangeSet
from metnos_exec.messages import Job, Result
from metnos_exec.tools.mcp_tasks import TaskPolicy, get_task

pytestmark = pytest.mark.anyio


async def test_a_gated_task_is_input_required_then_completed() -> None:
    broker = MemoryBroker()
    job = Job(executor="mutate", commit="approve")
    await broker.submit(job)
    [lease] = await broker.lease("w", visibility_s=30)
    changes = ChangeSet(
        entries=(ChangeEntry(path="/n/a.txt", kind="created", type="file"),),
        total=1,
        committed=False,
    )
    waiting = Result(job_id=job.id, status="awaiting_approval", output={}, changes=changes)
    assert await broker.ack(lease, waiting)

    async def manifests() -> dict[str, Any]:
        return {}

    gateway: Any = SimpleNamespace(client=SimpleNamespace(broker=broker), manifests=manifests)
    task = await get_task(gateway, TaskPolicy(), job.id)
    assert task["status"] == "input_required" and "result" not in task
    assert f"metnos-exec approve {job.id}" in task["statusMessage"]
    assert task["_meta"]["changes"]["entries"][0]["path"] == "/n/a.txt"

    final = msgspec.structs.replace(
        waiting,
        status="succeeded",
        undo_ids=("u",),
        changes=msgspec.structs.replace(changes, committed=True),
    )
    assert await broker.settle_gate(job.id, final)
    task = await get_task(gateway, TaskPolicy(), job.id)
    assert task["status"] == "completed" and task["result"]["_meta"]["undo_ids"] == ["u"]
