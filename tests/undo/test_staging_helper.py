"""The staging namespace helper: it is started once, replaced when it dies, reported by
``status`` as it really is, and refused for folders an unprivileged worker does not own."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from metnos_exec.sandbox.status import status
from metnos_exec.undo import staging as staging_mod
from metnos_exec.undo.staging import BackupRun, OverlayRun, Staging
from tests.undo.helpers import World, make_world, staging_works

pytestmark = pytest.mark.anyio


@pytest.fixture
async def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    try:
        yield w
    finally:
        await w.staging.aclose()


async def test_a_dead_helper_is_replaced_at_the_next_job(world: World) -> None:
    await staging_works(world)
    first = await world.run([["write", "one.txt", "1"]])
    assert first.status == "succeeded" and len(first.undo_ids) == 1
    helper = world.staging._ns
    assert helper is not None
    old_pid = helper.pid
    os.kill(old_pid, signal.SIGKILL)
    # Reaped by the next start (it waits for the old process before starting anew).
    second = await world.run([["write", "two.txt", "2"]])
    assert second.status == "succeeded" and len(second.undo_ids) == 1, second
    assert helper.running and helper.pid != old_pid
    assert (world.notes / "two.txt").read_text() == "2"


async def test_status_says_what_staging_really_does(tmp_path: Path) -> None:
    staging = Staging(tmp_path / "state")
    try:
        reason = await staging.start()
    finally:
        await staging.aclose()
    reported = status().overlay_staging
    if reason is None:
        assert reported.startswith("available")
    else:
        assert reported.startswith("unavailable: ")


async def test_an_unprivileged_worker_does_not_stage_folders_it_does_not_own(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    await staging_works(world)
    owner = world.notes.stat()
    # Seen as another user: the overlay of its user namespace could not copy these up.
    monkeypatch.setattr(staging_mod.os, "geteuid", lambda: owner.st_uid + 1)
    monkeypatch.setattr(staging_mod.os, "getuid", lambda: owner.st_uid + 1)
    sjob = world.registry["mutate"]
    from metnos_exec.plan import plan_invocation

    inv = plan_invocation(sjob, {"root": "~/notes"}, home=str(world.home))
    run = await world.staging.prepare(
        job_id="J",
        executor="mutate",
        device="server",
        job=inv.job,
        write_roots=inv.write_roots,
        write_targets=inv.write_targets,
        arm_stages=True,
    )
    assert isinstance(run, BackupRun) and run.no_staging is not None
    assert "not the worker's" in run.no_staging
    await run.discard()
    monkeypatch.undo()
    run2 = await world.staging.prepare(
        job_id="K",
        executor="mutate",
        device="server",
        job=inv.job,
        write_roots=inv.write_roots,
        write_targets=inv.write_targets,
        arm_stages=True,
    )
    assert isinstance(run2, OverlayRun)
    await run2.discard()


async def test_a_relative_state_folder_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    world = make_world(tmp_path)
    await world.staging.aclose()
    world.staging = Staging("state")  # as `./dev demo` and `--state-dir state` give it
    try:
        await staging_works(world)
        result = await world.run([["write", "rel.txt", "r"]])
        assert result.status == "succeeded", result
        assert (world.notes / "rel.txt").read_text() == "r"
    finally:
        await world.staging.aclose()
