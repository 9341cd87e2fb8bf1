"""Reversible mutations end to end: real bubblewrap, real overlays, a supervisor.

Issue 10's acceptance points 1, 2, 4, 5, 6 and 7 (3, the crash in the middle of a commit,
is in ``test_commit_crash.py``; 8 is the benchmark). Every test runs on both backends.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from structlog.testing import capture_logs

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.client import Client
from metnos_exec.errors import BrokerUnavailable, UndoConflict, UndoUnavailable
from metnos_exec.messages import UNDO_EXECUTOR, DirState, Job, Put
from metnos_exec.sandbox._types import AXES
from metnos_exec.sandbox.direct import DirectSandbox
from metnos_exec.sandbox.select import ArmChoice, Degradation
from metnos_exec.undo.staging import Staging
from tests.conftest import need
from tests.undo.helpers import (
    World,
    api_undo,
    bwrap_works,
    make_world,
    seed,
    snapshot,
    staged_file_seen,
    staging_works,
    wait_for,
)

pytestmark = pytest.mark.anyio

ALL_KINDS = [
    ["write", "new.txt", "brand new\n"],
    ["append", "mod.txt", "appended\n"],
    ["rm", "del.txt"],
    ["mv", "mv.txt", "moved.txt"],
    ["chmod", "tool.sh", "755"],
    ["rmtree", "sub"],
    ["mkdir", "newdir/inner"],
    ["write", "newdir/inner/f.txt", "nested\n"],
    ["symlink", "link2", "keep.txt"],
    ["rm", "link"],
]


@pytest.fixture
async def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    try:
        yield w
    finally:
        await w.staging.aclose()


# --- 1. create, modify, delete, rename, chmod; undo; undo of the undo -------------------


async def test_commit_then_undo_then_redo_are_byte_exact(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)
    result = await world.run(ALL_KINDS)
    assert result.status == "succeeded", result
    assert len(result.undo_ids) == 1
    after = snapshot(world.notes)
    # The tree is what the job saw.
    assert after["new.txt"][2] != before.get("new.txt")
    assert (world.notes / "mod.txt").read_text() == "old content\nappended\n"
    assert "del.txt" not in after and "mv.txt" not in after and "sub" not in after
    assert (world.notes / "moved.txt").read_text() == "move me\n"
    assert after["tool.sh"][1] == "0o755"
    assert (world.notes / "newdir" / "inner" / "f.txt").read_text() == "nested\n"
    assert after["link2"] == ("link", "keep.txt") and "link" not in after
    assert result.containment is not None
    assert "disk writes bounded" in result.containment.resources.reason

    client = Client(world.broker)
    undo_id = await client.submit_undo(result.job_id)
    await world.burst()
    undone = await world.broker.get_result(undo_id)
    assert undone is not None and undone.status == "succeeded", undone
    assert snapshot(world.notes) == before  # content, names, modes, links

    redo_id = await client.submit_undo(undo_id)
    await world.burst()
    redone = await world.broker.get_result(redo_id)
    assert redone is not None and redone.status == "succeeded", redone
    assert snapshot(world.notes) == after

    # And the job can be undone again once its undo was undone.
    again = await client.submit_undo(result.job_id)
    await world.burst()
    assert (await world.broker.get_result(again)).status == "succeeded"  # type: ignore[union-attr]
    assert snapshot(world.notes) == before


async def test_undo_is_logged_and_a_second_undo_is_refused(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    result = await world.run([["write", "a.txt", "a"]])
    client = Client(world.broker)
    with capture_logs() as logs:
        undo_id = await client.submit_undo(result.job_id)
        await world.burst()
    applied = [r for r in logs if r["event"] == "undo.applied"]
    assert len(applied) == 1 and applied[0]["undone"] == result.job_id
    assert any(p.endswith("/a.txt") for p in applied[0]["paths"])
    recorded = [r for r in logs if r["event"] == "undo.recorded"]
    assert recorded and recorded[0]["reverses"] == result.undo_ids[0]

    with pytest.raises(UndoUnavailable, match=f"already undone by job {undo_id}"):
        await api_undo(world, result.job_id)


async def test_an_undo_of_a_job_without_changes_is_refused_before_queueing(world: World) -> None:
    await staging_works(world)
    result = await world.run([])
    assert result.status == "succeeded" and result.undo_ids == ()
    with pytest.raises(UndoUnavailable, match="recorded no file changes"):
        await Client(world.broker).submit_undo(result.job_id)


# --- 2. failure, timeout, cancel leave the tree untouched -------------------------------


async def test_a_failed_job_leaves_nothing(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)
    result = await world.run(ALL_KINDS, fail=True)
    assert result.status == "failed" and result.error is not None
    assert result.error.code == "E_EXIT"
    assert snapshot(world.notes) == before
    assert result.undo_ids == () and await world.entries_count() == 0


async def test_a_timed_out_job_leaves_nothing(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)
    job = Job(
        executor="mutate",
        args={"root": "~/notes", "ops": ALL_KINDS, "sleep": 30},
        timeout_s=1.0,
    )
    await world.broker.submit(job)
    await world.burst()
    result = await world.broker.get_result(job.id)
    assert result is not None and result.status == "timed_out"
    assert snapshot(world.notes) == before
    assert result.undo_ids == () and await world.entries_count() == 0


async def test_a_cancelled_job_leaves_nothing(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)
    job = Job(executor="mutate", args={"root": "~/notes", "ops": ALL_KINDS, "sleep": 30})
    await world.broker.submit(job)
    async with anyio.create_task_group() as tg:
        sup = world.supervisor(cancel_poll_s=0.05)
        tg.start_soon(sup.run)
        await wait_for(lambda: staged_file_seen(world, "new.txt"), 20)
        assert snapshot(world.notes) == before
        assert await world.broker.cancel(job.id) == "cancelling"
        await wait_for(lambda: job.id in world.broker._results, 20)
        await sup.drain(0)
    result = await world.broker.get_result(job.id)
    assert result is not None and result.status == "cancelled"
    assert snapshot(world.notes) == before
    assert result.undo_ids == () and await world.entries_count() == 0


# --- 4. undo after a later edit: refused, nothing changes --------------------------------


async def test_undo_after_a_later_edit_is_refused_and_changes_nothing(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    result = await world.run([["append", "mod.txt", "job\n"], ["write", "new.txt", "n"]])
    (world.notes / "mod.txt").write_text("edited by a person afterwards\n")
    now = snapshot(world.notes)
    client = Client(world.broker)
    undo_id = await client.submit_undo(result.job_id)
    await world.burst()
    refused = await world.broker.get_result(undo_id)
    assert refused is not None and refused.status == "rejected"
    assert refused.error is not None and refused.error.code == "E_UNDO_CONFLICT"
    assert "mod.txt" in refused.error.message and "content changed" in refused.error.message
    assert "new.txt" not in refused.error.message  # only what changed is named
    assert snapshot(world.notes) == now
    # The API raises it.
    with pytest.raises(UndoConflict, match=r"mod\.txt"):
        await api_undo(world, result.job_id)
    assert snapshot(world.notes) == now


async def test_undo_refuses_when_a_created_folder_got_new_entries(world: World) -> None:
    await staging_works(world)
    result = await world.run([["mkdir", "made"], ["write", "made/a", "a"]])
    (world.notes / "made" / "mine.txt").write_text("a person's file")
    now = snapshot(world.notes)
    undo_id = await Client(world.broker).submit_undo(result.job_id)
    await world.burst()
    refused = await world.broker.get_result(undo_id)
    assert refused is not None and refused.error is not None
    assert refused.error.code == "E_UNDO_CONFLICT" and "mine.txt" in refused.error.message
    assert snapshot(world.notes) == now


# --- 5. symlinks, setuid, disk budget ----------------------------------------------------


async def test_a_planted_symlink_stays_inert(world: World, tmp_path: Path) -> None:
    await staging_works(world)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret"
    secret.write_text("host secret\n")
    parts = str(secret).strip("/").split("/")
    result = await world.run(
        [
            ["symlink_abs", "evil", *parts],
            ["symlink_abs", "evildir", *str(outside).strip("/").split("/")],
        ]
    )
    assert result.status == "succeeded", result
    # Committed as links, never followed: the host file is untouched.
    assert os.readlink(world.notes / "evil") == str(secret)
    assert secret.read_text() == "host secret\n" and sorted(os.listdir(outside)) == ["secret"]
    # A later job handed a path through the link is refused by vetting (links resolved).
    job = Job(executor="mutate", args={"root": "~/notes", "target": "~/notes/evil"})
    await world.broker.submit(job)
    await world.burst()
    denied = await world.broker.get_result(job.id)
    assert denied is not None and denied.error is not None
    assert denied.error.code == "E_CAPABILITY_DENIED"
    # And writing through it from inside the sandbox reaches nothing on the host.
    through = await world.run([["write", "evildir/planted", "x"]])
    assert through.status == "failed"
    assert sorted(os.listdir(outside)) == ["secret"]


SETID_OPS = [
    ["chmod", "tool.sh", "4755"],
    ["write", "new.sh", "#!/bin/sh\n"],
    ["chmod", "new.sh", "6755"],
    ["mkdir", "gdir"],
    ["chmod", "gdir", "2775"],
]


async def test_setuid_and_setgid_bits_never_reach_the_host(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    await staging_works(world)
    seed(world.notes)
    # The first wall: the bwrap arm's seccomp filter refuses the chmod (issue 8), the job
    # fails and nothing is committed.
    refused = await world.run(SETID_OPS)
    assert refused.status == "failed", refused
    assert "Operation not permitted" in refused.stderr, refused
    assert stat.S_IMODE(os.lstat(world.notes / "tool.sh").st_mode) == 0o644
    # The second wall, the commit's filter, with the first one off: the bits are set in
    # the overlay, and stripped on their way to the host.
    from metnos_exec.sandbox import bwrap

    hard = bwrap.host_hardening()
    off = msgspec.structs.replace(hard, seccomp_arch=None, seccomp="off for this test")
    monkeypatch.setattr(bwrap, "host_hardening", lambda: off)
    with capture_logs() as logs:
        result = await world.run(SETID_OPS)
    assert result.status == "succeeded", result
    for name in ("tool.sh", "new.sh", "gdir"):
        mode = os.lstat(world.notes / name).st_mode
        assert not mode & (stat.S_ISUID | stat.S_ISGID), (name, oct(mode))
    assert stat.S_IMODE(os.lstat(world.notes / "tool.sh").st_mode) == 0o755
    filtered = [r for r in logs if r["event"] == "commit.filtered"]
    assert {Path(r["path"]).name for r in filtered} == {"tool.sh", "new.sh", "gdir"}


async def test_fifos_are_not_committed(world: World) -> None:
    await staging_works(world)
    with capture_logs() as logs:
        result = await world.run([["mkfifo", "pipe"], ["write", "ok.txt", "ok"]])
    assert result.status == "succeeded", result
    assert not (world.notes / "pipe").exists() and (world.notes / "ok.txt").exists()
    assert any(r["event"] == "commit.filtered" and r["path"].endswith("/pipe") for r in logs)


async def test_a_job_over_its_disk_budget_fails_and_leaves_nothing(tmp_path: Path) -> None:
    world = make_world(tmp_path, disk_mb=1)
    try:
        await staging_works(world)
        seed(world.notes)
        before = snapshot(world.notes)
        # 2 MiB into a 1 MiB budget: the kernel refuses while the job runs (ENOSPC).
        result = await world.run([["write", "small.txt", "fits"], ["fill", "big.bin", "32"]])
        assert result.status == "failed"
        assert result.error is not None and result.error.code == "E_DISK", result.error
        assert snapshot(world.notes) == before
        assert result.undo_ids == () and await world.entries_count() == 0
        # Under the budget it commits.
        ok = await world.run([["fill", "half.bin", "8"]])
        assert ok.status == "succeeded" and (world.notes / "half.bin").stat().st_size == 8 * 65536
        # The disk wall holds, and adds nothing "partial" to the resources axis (which may
        # be partial for other reasons, e.g. no pids cgroup for an unprivileged worker).
        assert ok.containment is not None
        assert "disk writes bounded (1 MiB staged)" in ok.containment.resources.reason
        assert "unbounded" not in ok.containment.resources.reason
    finally:
        await world.staging.aclose()


async def test_a_host_change_during_the_job_refuses_the_commit(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    (world.notes / "go").write_text("wait")
    ops = [["append", "mod.txt", "job\n"], ["write", "n", "n"], ["waitfor", "go"]]
    job = Job(executor="mutate", args={"root": "~/notes", "ops": ops})
    await world.broker.submit(job)
    async with anyio.create_task_group() as tg:
        tg.start_soon(world.burst)
        await wait_for(lambda: staged_file_seen(world, "n"), 20)
        (world.notes / "mod.txt").write_text("a person edited it meanwhile\n")
        (world.notes / "go").write_text("go")
        now = snapshot(world.notes)
    result = await world.broker.get_result(job.id)
    assert result is not None and result.status == "failed"
    assert result.error is not None and result.error.code == "E_COMMIT_CONFLICT"
    assert "mod.txt" in result.error.message
    assert snapshot(world.notes) == now  # nothing applied: "n" was not created
    assert result.undo_ids == () and await world.entries_count() == 0


@pytest.mark.parametrize(
    ("ops", "removed"),
    [
        ([["append", "mod.txt", "job\n"]], "mod.txt"),
        ([["write", "sub/new.txt", "job\n"]], "sub"),
        ([["append", "sub/deep.txt", "job\n"]], "sub"),
    ],
    ids=["file", "folder_written_into", "file_in_folder"],
)
async def test_a_host_deletion_during_the_job_refuses_the_commit(
    world: World, ops: list[list[str]], removed: str
) -> None:
    # A path the job changed that the host removed meanwhile "vanished": the commit must
    # not bring it back (it did, silently, with the job's version).
    await staging_works(world)
    seed(world.notes)
    (world.notes / "go").write_text("wait")
    job = Job(
        executor="mutate",
        args={"root": "~/notes", "ops": [*ops, ["write", "n", "n"], ["waitfor", "go"]]},
    )
    await world.broker.submit(job)
    async with anyio.create_task_group() as tg:
        tg.start_soon(world.burst)
        await wait_for(lambda: staged_file_seen(world, "n"), 20)
        gone = world.notes / removed
        if gone.is_dir():
            shutil.rmtree(gone)
        else:
            gone.unlink()
        (world.notes / "go").write_text("go")
        now = snapshot(world.notes)
    result = await world.broker.get_result(job.id)
    assert snapshot(world.notes) == now  # nothing applied, nothing brought back
    assert result is not None and result.status == "failed", result
    assert result.error is not None and result.error.code == "E_COMMIT_CONFLICT", result.error
    assert removed in result.error.message
    assert result.undo_ids == () and await world.entries_count() == 0


# --- 6. without staging: the declared targets are backed up and restored ----------------


def _direct_chooser(runtime: str, *, require_sandbox: bool) -> ArmChoice:
    return ArmChoice(
        DirectSandbox(),
        Degradation(requested="bwrap", used="none", reason="sandbox_off", axes_lost=AXES),
    )


@pytest.mark.parametrize("how", ["direct_arm", "no_overlay"])
async def test_without_staging_the_declared_targets_are_backed_up(tmp_path: Path, how: str) -> None:
    world = make_world(tmp_path, overlay=how != "no_overlay")
    kw = {"arm_chooser": _direct_chooser} if how == "direct_arm" else {}
    if how == "no_overlay":
        bwrap_works()
    try:
        target = world.notes / "target.txt"
        target.write_text("precious\n")
        os.chmod(target, 0o640)
        before = snapshot(world.notes)
        ops = [["write", "target.txt", "overwritten"], ["write", "other.txt", "not declared"]]

        # A failure: the target is put back at once; the undeclared file stays.
        job = Job(executor="mutate", args={"root": "~/notes", "ops": ops, "fail": True})
        await world.broker.submit(job)
        with capture_logs() as logs:
            await world.burst(**kw)
        failed = await world.broker.get_result(job.id)
        assert failed is not None and failed.status == "failed" and failed.undo_ids == ()
        assert target.read_text() == "precious\n" and stat.S_IMODE(target.stat().st_mode) == 0o640
        assert (world.notes / "other.txt").exists()  # lost: said in the degradation
        degraded = [
            r for r in logs if r["event"] == "sandbox.degraded" and r["reason"] == "no_staging"
        ]
        assert len(degraded) == 1, degraded  # once for the job, whatever it touched
        assert "only the 2 declared target(s)" in degraded[0]["detail"]  # root, target
        assert failed.containment is not None
        assert failed.containment.resources.state != "kept"
        assert "disk writes unbounded" in failed.containment.resources.reason
        (world.notes / "other.txt").unlink()

        # A success: recorded as a backup entry; undo restores the target exactly.
        job = Job(executor="mutate", args={"root": "~/notes", "ops": ops})
        await world.broker.submit(job)
        await world.burst(**kw)
        ok = await world.broker.get_result(job.id)
        assert ok is not None and ok.status == "succeeded" and len(ok.undo_ids) == 1
        assert target.read_text() == "overwritten"
        [record] = await world.broker.get_undo(ok.undo_ids)
        assert record.entry.method == "backup" and record.entry.lost
        undo_id = await Client(world.broker).submit_undo(job.id)
        await world.burst(**kw)
        undone = await world.broker.get_result(undo_id)
        assert undone is not None and undone.status == "succeeded", undone
        (world.notes / "other.txt").unlink()
        assert snapshot(world.notes) == before
    finally:
        await world.staging.aclose()


# --- 7. an undo runs on the device that made the change, and nowhere else ---------------


async def test_an_undo_runs_on_the_device_that_made_the_change(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)
    job = Job(
        executor="mutate",
        args={"root": "~/notes", "ops": [["write", "from-d.txt", "d"]]},
        device="phone-d",
    )
    await world.broker.submit(job)
    await world.burst(device="phone-d")
    done = await world.broker.get_result(job.id)
    assert done is not None and done.status == "succeeded" and done.device == "phone-d"

    undo_id = await Client(world.broker).submit_undo(job.id)
    state = await world.broker.get_job_state(undo_id)
    assert state is not None and state.state == "queued"
    # Server workers and other devices never see it.
    await world.burst()
    await world.burst(device="tablet-e")
    state = await world.broker.get_job_state(undo_id)
    assert state is not None and state.state == "queued" and state.attempt == 0
    assert (world.notes / "from-d.txt").exists()
    # Device D does.
    await world.burst(device="phone-d")
    undone = await world.broker.get_result(undo_id)
    assert undone is not None and undone.status == "succeeded" and undone.device == "phone-d"
    assert snapshot(world.notes) == before


async def test_an_undo_misrouted_by_hand_is_refused_by_the_wrong_device(world: World) -> None:
    await staging_works(world)
    job = Job(executor="mutate", args={"root": "~/notes", "ops": [["write", "x", "x"]]}, device="d")
    await world.broker.submit(job)
    await world.burst(device="d")
    undo = Job(executor=UNDO_EXECUTOR, args={"job_id": job.id}, device="e")
    await world.broker.submit(undo)
    await world.burst(device="e")
    refused = await world.broker.get_result(undo.id)
    assert refused is not None and refused.error is not None
    assert refused.error.code == "E_UNDO_UNAVAILABLE" and "device 'd'" in refused.error.message
    assert (world.notes / "x").read_text() == "x"


def _acl(*entries: tuple[int, int, int]) -> bytes:
    """A ``system.posix_acl_access`` value: version 2, then (tag, perm, id) entries."""
    import struct

    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


#: user::rw-, user:N:rw-, group::---, mask::rw-, other::---: mode 0660, whose group bits
#: are the mask, not the owning group's (which has nothing). N: another user as root; the
#: worker's own uid otherwise, the one uid an unprivileged worker's user namespace maps
#: (the overlay cannot copy up an ACL naming an unmapped one: the job's write fails).
_NAMED = 4242 if os.geteuid() == 0 else os.geteuid()
_NAMED_USER_ACL = _acl(
    (0x01, 6, 0xFFFFFFFF), (0x02, 6, _NAMED), (0x04, 0, 0xFFFFFFFF), (0x10, 6, 0xFFFFFFFF),
    (0x20, 0, 0xFFFFFFFF),
)  # fmt: skip


async def test_a_files_access_acl_survives_its_commit_and_its_undo(world: World) -> None:
    """A commit writes changed content into a new file and renames it over the old one:
    the old one's ACL went with it, and its owning group gained the mask's rights (a
    0660 file with ``group::---`` and a named user became a plain 0660 file)."""
    await staging_works(world)
    shared = world.notes / "shared.txt"
    shared.write_text("old\n")
    os.chmod(shared, 0o660)
    try:
        os.setxattr(shared, "system.posix_acl_access", _NAMED_USER_ACL)
    except OSError as exc:
        need(False, f"no POSIX ACLs on {world.notes}'s file system: {exc}")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o660
    result = await world.run([["append", "shared.txt", "job\n"]])
    assert result.status == "succeeded", result
    assert shared.read_text() == "old\njob\n"
    assert os.getxattr(shared, "system.posix_acl_access") == _NAMED_USER_ACL
    assert stat.S_IMODE(shared.stat().st_mode) == 0o660
    await api_undo(world, result.job_id)
    assert shared.read_text() == "old\n"
    assert os.getxattr(shared, "system.posix_acl_access") == _NAMED_USER_ACL


async def test_an_undo_without_the_originals_is_refused_and_changes_nothing(
    world: World,
) -> None:
    await staging_works(world)
    seed(world.notes)
    result = await world.run([["append", "mod.txt", "job\n"], ["rm", "del.txt"]])
    now = snapshot(world.notes)
    # The originals pruned from the blob store (by hand: retention never takes a blob an
    # entry still needs).
    (record,) = await world.broker.get_undo(result.undo_ids)
    for digest in record.entry.blobs():
        world.staging.store.path(digest).unlink()
    undo_id = await Client(world.broker).submit_undo(result.job_id)
    await world.burst()
    refused = await world.broker.get_result(undo_id)
    assert refused is not None and refused.error is not None
    assert refused.error.code == "E_UNDO_UNAVAILABLE" and "blob store" in refused.error.message
    assert "mod.txt" in refused.error.message and "del.txt" in refused.error.message
    assert snapshot(world.notes) == now


async def test_an_entry_not_sealed_by_this_device_is_refused_before_anything_is_read(
    world: World, tmp_path: Path
) -> None:
    """An entry is the broker's word, which whoever can write the store may forge (a
    producer, a job with network access to an unauthenticated Redis): a forged one made
    a root worker chmod a folder outside every hint. Undo checks the device's seal
    (`metnos_exec.undo.seal`) first."""
    await staging_works(world)
    seed(world.notes)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    result = await world.run([["append", "mod.txt", "job\n"]])
    now = snapshot(world.notes)
    (record,) = await world.broker.get_undo(result.undo_ids)
    entry = record.entry
    assert entry.seal is not None
    forged = msgspec.structs.replace(
        entry,
        roots=(*entry.roots, str(victim)),
        ops=(
            *entry.ops,
            # "Undo" to 0777 a folder that is 0700 now: what check_ops finds, so only the
            # seal stands in the way.
            Put(path=str(victim), before=DirState(mode=0o700), after=DirState(mode=0o777)),
        ),
    )
    world.broker._undo[entry.id] = msgspec.structs.replace(record, entry=forged)
    undo_id = await Client(world.broker).submit_undo(result.job_id)
    await world.burst()
    refused = await world.broker.get_result(undo_id)
    assert refused is not None and refused.error is not None
    assert refused.error.code == "E_UNDO_UNAVAILABLE" and "seal" in refused.error.message
    assert stat.S_IMODE(victim.stat().st_mode) == 0o700
    assert snapshot(world.notes) == now
    # Unsealed (an entry from before seals, or written by hand): refused the same way.
    world.broker._undo[entry.id] = msgspec.structs.replace(
        record, entry=msgspec.structs.replace(entry, seal=None)
    )
    undo_id = await Client(world.broker).submit_undo(result.job_id)
    await world.burst()
    refused = await world.broker.get_result(undo_id)
    assert refused is not None and refused.error is not None and "seal" in refused.error.message
    # A worker of the same device with another blob store (another machine): it has
    # neither the key nor the originals.
    world.broker._undo[entry.id] = record
    elsewhere = Staging(tmp_path / "elsewhere")
    try:
        undo_id = await Client(world.broker).submit_undo(result.job_id)
        await world.burst(staging=elsewhere)
    finally:
        await elsewhere.aclose()
    refused = await world.broker.get_result(undo_id)
    assert refused is not None and refused.error is not None
    assert refused.error.code == "E_UNDO_UNAVAILABLE" and "blob store" in refused.error.message
    assert snapshot(world.notes) == now
    # The genuine entry, on this device: undone.
    undo_id = await Client(world.broker).submit_undo(result.job_id)
    await world.burst()
    done = await world.broker.get_result(undo_id)
    assert done is not None and done.status == "succeeded", done


# --- the store failing while an entry is recorded ---------------------------------------


class RecordFailsTwice(MemoryBroker):
    """`record_undo` fails twice (Redis restarting, a held lock), then works."""

    def __init__(self) -> None:
        super().__init__()
        self.record_failures = 0

    async def record_undo(self, *a: Any, **kw: Any) -> bool:
        if self.record_failures < 2:
            self.record_failures += 1
            raise BrokerUnavailable("cannot reach Redis (test)")
        return await super().record_undo(*a, **kw)


async def test_an_entry_the_store_fails_to_record_is_recorded_once_it_is_back(
    world: World,
) -> None:
    """Found by the chaos run (Redis SIGKILLed under staged jobs): a job whose undo entry
    met the store failing was rolled back and logged `lease.lost` although its lease
    stood; with max_attempts = 1 it then ended dead (E_LEASE_EXPIRED) without a fault of
    its own. Like an ack, the record is kept and tried again with backoff."""
    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)
    world.broker = RecordFailsTwice()
    job = Job(
        executor="mutate",
        args={"root": "~/notes", "ops": [["append", "mod.txt", "job\n"]]},
        max_attempts=1,
    )
    await world.broker.submit(job)
    with capture_logs() as logs:
        await world.burst(store_backoff=lambda n: 0.01)
    result = await world.broker.get_result(job.id)
    assert result is not None and result.status == "succeeded", result
    assert len(result.undo_ids) == 1
    assert (world.notes / "mod.txt").read_text() == "old content\njob\n"
    events = [r["event"] for r in logs]
    # Both failures, said once (an outage is one record; `supervisor.outage`) and counted
    # by the recovery.
    assert "lease.lost" not in events and events.count("broker.error") == 1
    [back] = [r for r in logs if r["event"] == "broker.recovered"]
    assert back["failures"] == 2

    # The undo's own entry (the redo) meets the same store.
    world.broker.record_failures = 0
    undo = Job(executor=UNDO_EXECUTOR, args={"job_id": job.id}, max_attempts=1)
    await world.broker.submit(undo)
    with capture_logs() as logs:
        await world.burst(store_backoff=lambda n: 0.01)
    undone = await world.broker.get_result(undo.id)
    assert undone is not None and undone.status == "succeeded", undone
    assert snapshot(world.notes) == before
    assert "lease.lost" not in [r["event"] for r in logs]


class ResultsFailing(MemoryBroker):
    """`get_result` fails `failing` more times (the store down while a worker starts)."""

    def __init__(self, clock: Any) -> None:
        super().__init__(clock=clock)
        self.failing = 0

    async def get_result(self, job_id: str) -> Any:
        if self.failing:
            self.failing -= 1
            raise BrokerUnavailable("cannot reach Redis (test)")
        return await super().get_result(job_id)


async def half_committed(world: World) -> tuple[ResultsFailing, Any, Job]:
    """A job leased and started by a worker that died in the middle of its commit (an
    append to ``mod.txt`` applied and journalled, its result never stored), on a broker
    whose results can be made to fail; ``(broker, its clock, the job)``."""
    from metnos_exec.messages import FileState
    from metnos_exec.undo.journal import (
        BlobSource,
        HostTree,
        JournalRecord,
        apply_ops,
        fingerprints,
    )
    from tests.brokers.conformance import VirtualClock

    clock = VirtualClock()
    world.broker = broker = ResultsFailing(clock)
    job = Job(executor="mutate", args={"root": "~/notes", "ops": [["append", "mod.txt", "job\n"]]})
    await broker.submit(job)
    [dead] = await broker.lease("dead-worker", visibility_s=10)
    assert await broker.mark_started(dead)
    store, path = world.staging.store, str(world.notes / "mod.txt")
    old, new = b"old content\n", b"old content\njob\n"
    op = Put(
        path=path,
        before=FileState(sha256=store.put_bytes(old), size=len(old), mode=0o644),
        after=FileState(sha256=store.put_bytes(new), size=len(new), mode=0o644),
    )
    root = str(world.notes)
    with HostTree([root]) as tree:
        expect = fingerprints(tree, {path: None})
        apply_ops(tree, (op,), source=BlobSource(store), store=store, expect=expect, tag="t")
    record = JournalRecord(job_id=job.id, entry_id="E-dead", roots=(root,), ops=(op,))
    world.staging.journal.begin(record).close(remove=False)  # its worker "died"
    return broker, clock, job


async def test_a_redelivered_job_waits_for_its_half_commit_to_be_settled(world: World) -> None:
    """A worker died in the middle of a job's commit; the job comes back to a worker
    while the store fails. The journal recovery cannot ask the store whether the commit
    stood, and the job used to run anyway, on the half-committed tree: its append was
    committed twice. It now waits for the recovery."""
    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)
    broker, clock, job = await half_committed(world)
    clock.advance(60)  # the dead worker's lease lapses

    broker.failing = 2  # the start's recovery, then the redelivered job's
    with capture_logs() as logs:
        await world.burst(store_backoff=lambda n: 0.01)
    result = await broker.get_result(job.id)
    assert result is not None and result.status == "succeeded", result
    assert (world.notes / "mod.txt").read_text() == "old content\njob\n"
    recovered = [r for r in logs if r["event"] == "journal.recovered"]
    assert [(r["job_id"], r["action"]) for r in recovered] == [(job.id, "rolled_back")]
    assert list(world.staging.journal.folder.iterdir()) == []
    undo = await Client(broker).submit_undo(job.id)
    await world.burst()
    assert (await broker.get_result(undo)).status == "succeeded"  # type: ignore[union-attr]
    assert snapshot(world.notes) == before


async def test_a_fresh_job_waits_too_while_a_half_commit_is_unsettled(world: World) -> None:
    """The start's recovery failed (the store was down); a *new* job on the same files
    then ran on the half-committed tree: the dead job's append was committed under it,
    could no longer be rolled back, and was made again when that job was redelivered.
    Every writing job now waits for the recovery while one is owed."""
    await staging_works(world)
    seed(world.notes)
    broker, _, job = await half_committed(world)
    fresh = Job(
        executor="mutate", args={"root": "~/notes", "ops": [["append", "mod.txt", "fresh\n"]]}
    )
    await broker.submit(fresh)  # before the dead worker's lease lapses: it runs first

    broker.failing = 1  # the start's recovery
    with capture_logs() as logs:
        await world.burst(store_backoff=lambda n: 0.01)
    result = await broker.get_result(fresh.id)
    assert result is not None and result.status == "succeeded", result
    assert (world.notes / "mod.txt").read_text() == "old content\nfresh\n"
    recovered = [r for r in logs if r["event"] == "journal.recovered"]
    assert [(r["job_id"], r["action"], r["left"]) for r in recovered] == [
        (job.id, "rolled_back", [])
    ]
    assert list(world.staging.journal.folder.iterdir()) == []


async def test_an_undo_whose_original_was_cut_short_is_refused_and_changes_nothing(
    world: World,
) -> None:
    """A blob stored short (see tests/undo/test_blobs.py) would have been restored as it is:
    the user's file replaced by its first bytes."""
    await staging_works(world)
    seed(world.notes)
    result = await world.run([["append", "mod.txt", "job\n"]])
    assert result.status == "succeeded", result
    now = snapshot(world.notes)
    [record] = await world.broker.get_undo(result.undo_ids)
    [op] = record.entry.ops
    original = op.after.sha256  # type: ignore[union-attr]
    os.truncate(world.staging.store.path(original), 3)
    undo_id = await Client(world.broker).submit_undo(result.job_id)
    await world.burst()
    refused = await world.broker.get_result(undo_id)
    assert refused is not None and refused.error is not None
    assert refused.error.code == "E_UNDO_UNAVAILABLE" and "mod.txt" in refused.error.message
    assert snapshot(world.notes) == now


async def test_a_full_state_folder_fails_the_commit_naming_it(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos run's state folder on a full tmpfs: the jobs ended `E_HOST_FAULT:
    commit failed: [Errno 28] No space left on device`, naming no folder (the job's own
    folders were not full). Real ENOSPC is in the chaos notes (a root-only tmpfs); here
    the blob store's write is refused the same way."""
    import errno

    import metnos_exec.undo.overlay_run as staging_module

    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)

    def full(*a: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(staging_module, "store_originals", full)
    job = Job(
        executor="mutate",
        args={"root": "~/notes", "ops": [["append", "mod.txt", "job\n"]]},
        max_attempts=1,
    )
    await world.broker.submit(job)
    await world.burst()
    result = await world.broker.get_result(job.id)
    assert result is not None and result.error is not None, result
    assert str(world.staging.state_dir) in result.error.message
    assert "is full" in result.error.message and "nothing was applied" in result.error.message
    assert snapshot(world.notes) == before


# --- a file the worker cannot read: the job's verdict, not the host's -------------------


def _unreadable_by_the_worker(path: Path) -> None:
    # The instance is a root-owned 0600 file under an unprivileged worker; a 000
    # file of the worker's own is the same to it (no CAP_DAC_OVERRIDE), and needs no root
    # to make. A root worker reads every file: there is no such case to test.
    if os.geteuid() == 0:
        pytest.skip(
            "root reads every file: a file the worker cannot read needs an "
            "unprivileged worker (the unprivileged half runs this)"
        )
    os.chmod(path, 0)


def _listing(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry's kind, mode and inode: readable whatever the modes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (
                stat.S_IFMT(st.st_mode),
                stat.S_IMODE(st.st_mode),
                st.st_ino,
            )
    return out


@pytest.mark.parametrize(
    ("ops", "named"),
    [
        ([["rm", "secret"]], "secret"),
        ([["write", "new.txt", "x"], ["mv", "new.txt", "secret"]], "secret"),
        ([["write", "made.txt", "x"], ["chmod", "made.txt", "000"]], "made.txt"),
        (
            [["mkdir", "d"], ["write", "d/f", "x"], ["chmod", "d", "000"]],
            "d",
        ),
    ],
    ids=["host_file_deleted", "host_file_replaced", "job_file_unreadable", "job_folder_closed"],
)
async def test_a_change_the_worker_cannot_read_is_the_jobs_conflict(
    world: World, ops: list[list[str]], named: str
) -> None:
    """Issue 15 item 12: an unprivileged worker, a file in the job's own folder that it
    cannot read (the job deleted or replaced it, or made its own file unreadable): the
    commit cannot keep the original for undo, or cannot read what to commit. It died as
    a host fault, retried and dead-lettered ``E_HOST_FAULT``; it is the job's own
    ``E_COMMIT_CONFLICT``, naming the path, nothing applied."""
    await staging_works(world)
    seed(world.notes)
    secret = world.notes / "secret"
    secret.write_text("not for the worker\n")
    _unreadable_by_the_worker(secret)
    before = _listing(world.notes)
    result = await world.run(ops)
    assert result.status == "failed", result
    assert result.error is not None and result.error.code == "E_COMMIT_CONFLICT", result.error
    assert f"notes/{named} (" in result.error.message and "read" in result.error.message
    assert result.attempt == 1  # not retried
    assert _listing(world.notes) == before
    assert result.undo_ids == () and await world.entries_count() == 0


@pytest.mark.parametrize("how", ["direct_arm", "no_overlay"])
async def test_a_declared_target_the_worker_cannot_read_is_refused_before_the_job(
    tmp_path: Path, how: str
) -> None:
    """Without staging the declared targets are backed up before the job runs: one the
    worker cannot read is the job's refused argument (``E_BAD_ARGS``, named), not a
    host fault."""
    world = make_world(tmp_path, overlay=how != "no_overlay")
    kw = {"arm_chooser": _direct_chooser} if how == "direct_arm" else {}
    if how == "no_overlay":
        bwrap_works()
    try:
        target = world.notes / "target.txt"
        target.write_text("precious\n")
        _unreadable_by_the_worker(target)
        before = _listing(world.notes)
        job = Job(executor="mutate", args={"root": "~/notes", "ops": [["rm", "target.txt"]]})
        await world.broker.submit(job)
        await world.burst(**kw)
        result = await world.broker.get_result(job.id)
        assert result is not None and result.status == "rejected", result
        assert result.error is not None and result.error.code == "E_BAD_ARGS", result.error
        assert "target.txt" in result.error.message and "read" in result.error.message
        assert _listing(world.notes) == before
    finally:
        await world.staging.aclose()


@pytest.mark.parametrize("how", ["direct_arm", "no_overlay"])
async def test_a_declared_target_the_job_leaves_unreadable_fails_the_job_naming_it(
    tmp_path: Path, how: str
) -> None:
    """Without staging: a target the job made unreadable to the worker (``chmod 0``)
    cannot be recorded for undo. The job's ``E_COMMIT_CONFLICT`` naming it, no entry;
    it was a host fault, retried."""
    if os.geteuid() == 0:
        pytest.skip("root reads every file: an unreadable target needs an unprivileged worker")
    world = make_world(tmp_path, overlay=how != "no_overlay")
    kw = {"arm_chooser": _direct_chooser} if how == "direct_arm" else {}
    if how == "no_overlay":
        bwrap_works()
    try:
        (world.notes / "target.txt").write_text("precious\n")
        job = Job(
            executor="mutate", args={"root": "~/notes", "ops": [["chmod", "target.txt", "000"]]}
        )
        await world.broker.submit(job)
        await world.burst(**kw)
        result = await world.broker.get_result(job.id)
        assert result is not None and result.status == "failed", result
        assert result.error is not None and result.error.code == "E_COMMIT_CONFLICT", result.error
        assert "notes/target.txt (" in result.error.message and "read" in result.error.message
        assert result.attempt == 1 and result.undo_ids == ()
        assert await world.entries_count() == 0
    finally:
        await world.staging.aclose()


#: A folder the unprivileged user owns, holding ``secret``: root's, 0600. Only root can
#: make it, and only an unprivileged worker cannot read it: `.ci/run` makes one before
#: its unprivileged half. The test borrows it (moved into its home, and back).
ROOT_OWNED_ENV = "METNOS_TEST_ROOT_OWNED_DIR"


async def test_a_job_deleting_a_root_owned_file_gets_a_conflict_not_a_host_fault(
    tmp_path: Path,
) -> None:
    """Issue 15 item 12 as found: an unprivileged worker, a root-owned 0600 file in the
    job's own writable folder, the job deletes it."""
    if os.geteuid() == 0:
        pytest.skip("a root worker reads root's files: the case needs an unprivileged worker")
    prepared = os.environ.get(ROOT_OWNED_ENV, "")
    need(
        bool(prepared) and (Path(prepared) / "secret").exists(),
        f"a root-owned 0600 file made by root beforehand ({ROOT_OWNED_ENV}; .ci/run makes it)",
    )
    (tmp_path / "home").mkdir()
    notes = tmp_path / "home" / "notes"
    os.rename(prepared, notes)
    world = make_world(tmp_path, existing=True)
    try:
        st = os.lstat(notes / "secret")
        assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
        await staging_works(world)
        before = _listing(notes)
        result = await world.run([["rm", "secret"]])
        assert result.status == "failed", result
        assert result.error is not None and result.error.code == "E_COMMIT_CONFLICT", result.error
        assert "notes/secret (" in result.error.message and "read" in result.error.message
        assert result.attempt == 1 and result.undo_ids == ()
        assert _listing(notes) == before
    finally:
        os.rename(notes, prepared)  # for the other backend's run
        await world.staging.aclose()


# --- a hint naming one file: bound alone, backed up, undone -----------------------------

ONE_FILE_MANIFEST = """\
name = "edit_one"
version = "1"
runtime = "python"
entry = "main.py"
[args.path]
type = "string"
format = "{path_format}"
default = "~/notes/todo.txt"
[args.text]
type = "string"
default = ""
[args.fail]
type = "boolean"
default = false
[[capabilities]]
name = "fs:write"
hints = ["~/notes/todo.txt"]
[limits]
timeout_s = 20
"""

# Appends `text` to `path`, then tries to write beside it (the hint gives one file, and
# the host folder around it is not mounted).
ONE_FILE_MAIN = """\
import json, os, sys
a = json.load(sys.stdin)
with open(os.path.expanduser(a["path"]), "a") as f:
    f.write(a["text"])
try:
    with open(os.path.join(os.path.dirname(os.path.expanduser(a["path"])), "beside.txt"), "w") as f:
        f.write("x")
    beside = "written"
except OSError as exc:
    beside = type(exc).__name__
print(json.dumps({"beside": beside}))
sys.exit(3 if a["fail"] else 0)
"""


@pytest.mark.parametrize("named", [True, False], ids=["path_argument", "text_argument"])
async def test_a_hint_naming_one_file_binds_it_alone_and_undo_restores_it(
    tmp_path: Path, named: bool
) -> None:
    """Issue 15 item 15: the README says a hint naming one file binds it alone, not
    staged; a job whose path argument named that file was refused ``E_BAD_ARGS``
    ("cannot be opened as a plain folder"). Now the file is backed up (named by an
    argument or not: it is all the job can write), written in place, restored when the
    job fails, recorded for undo; undo and redo are exact; nothing beside it is
    writable."""
    bwrap_works()
    world = make_world(tmp_path)
    folder = tmp_path / "executors" / "edit_one"
    folder.mkdir(parents=True)
    # Named by a path argument (vetted against the hint, a declared target), or only
    # by a text one the executor reads as a path (no declared target: the file is one
    # anyway, all the job can write there).
    (folder / "manifest.toml").write_text(
        ONE_FILE_MANIFEST.format(path_format="path" if named else "text")
    )
    (folder / "main.py").write_text(ONE_FILE_MAIN)
    from metnos_exec.manifest import ExecutorRegistry

    world.registry = ExecutorRegistry.load(folder.parent)
    todo = world.notes / "todo.txt"
    todo.write_text("old\n")
    os.chmod(todo, 0o640)
    before = snapshot(world.notes)
    args: dict[str, Any] = {"path": "~/notes/todo.txt"}

    async def run(**more: Any) -> Any:
        job = Job(executor="edit_one", args={**args, **more})
        await world.broker.submit(job)
        await world.burst()
        return await world.broker.get_result(job.id)

    try:
        failed = await run(text="half\n", fail=True)
        assert failed is not None and failed.status == "failed", failed
        assert snapshot(world.notes) == before  # put back at once
        done = await run(text="new\n")
        assert done is not None and done.status == "succeeded", done
        # Beside it the sandbox has no host folder (a write there, if any, is the
        # sandbox's own scratch): the host has only the file.
        assert todo.read_text() == "old\nnew\n" and not (world.notes / "beside.txt").exists()
        after = snapshot(world.notes)
        (record,) = await world.broker.get_undo(done.undo_ids)
        assert record.entry.method == "backup"
        assert record.entry.paths() == [str(todo)]
        client = Client(world.broker)
        undo_id = await client.submit_undo(done.job_id)
        await world.burst()
        undone = await world.broker.get_result(undo_id)
        assert undone is not None and undone.status == "succeeded", undone
        assert snapshot(world.notes) == before
        redo_id = await client.submit_undo(undo_id)
        await world.burst()
        assert (await world.broker.get_result(redo_id)).status == "succeeded"  # type: ignore[union-attr]
        assert snapshot(world.notes) == after
    finally:
        await world.staging.aclose()
