"""A root worker's staged jobs run as the slot's own unprivileged host uid.

Before, a job whose writes were staged ran as host root (a slot's uid could not enter the
staging namespace): it could read root-only files of the system trees, spend root's
per-user kernel quotas for the whole machine (inotify instances), and its files and user
axes said ``partial``. Now bubblewrap drops to the slot's uid inside the staging
namespace, and the overlays are built on idmapped layers (`metnos_exec.undo.overlay`).
Every test runs real bubblewrap and a real supervisor, as root (they skip otherwise; the
unprivileged worker's staging is the rest of ``tests/undo``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.client import Client
from metnos_exec.identities import SLOT_UIDS_ENV, SlotIdentity, slot_uid_range
from metnos_exec.messages import Job, Result
from metnos_exec.sandbox import staged as staged_mod
from metnos_exec.sandbox.bwrap import ROOT_QUOTAS_REASON
from metnos_exec.sandbox.staged import IdmapUnavailable, StagedPlacement
from tests.conftest import need, need_privileged
from tests.helpers.kernel import inotify_refused
from tests.sandbox.test_bwrap import need_slot_uids
from tests.undo.helpers import World, make_world, staging_works, wait_for

pytestmark = pytest.mark.anyio

AS_ROOT = os.geteuid() == 0
#: A uid and gid that own a folder of the job's but run nothing: "a user of the machine".
OTHER = 4242


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    need_privileged(AS_ROOT, "slot uids are a root worker's")
    w = make_world(tmp_path)
    try:
        yield w
    finally:
        await w.staging.aclose()


async def ready(world: World) -> None:
    need_slot_uids()
    await staging_works(world)


def slot_range() -> range:
    found = slot_uid_range({}) if os.environ.get(SLOT_UIDS_ENV) == "off" else slot_uid_range()
    assert found is not None
    return range(found[0], found[0] + found[1])


def job_processes(token: str) -> dict[int, dict[str, tuple[int, ...]]]:
    """pid → its host ids (``Uid``, ``Gid``: real, effective, saved, fs; ``Groups``) for
    every process whose argv holds `token` (bubblewrap, the guest and its children)."""
    found: dict[int, dict[str, tuple[int, ...]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if token.encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        found[int(entry)] = {
            key: tuple(int(x) for x in fields[key].split()) for key in ("Uid", "Gid", "Groups")
        }
    return found


async def submit(world: World, ops: list[list[Any]]) -> Job:
    job = Job(executor="mutate", args={"root": "~/notes", "ops": ops}, max_attempts=1)
    await world.broker.submit(job)
    return job


async def serve_until_done(world: World, job: Job, during: Any) -> Result:
    """Run a worker while `during()` (async) looks at the job from the host; the job waits
    for the host's ``go`` in ``notes/go``, which is written whatever `during` does."""
    sup = world.supervisor(idle_poll_s=0.01)
    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        try:
            await during()
        finally:
            (world.notes / "go").write_text("go")
            with anyio.fail_after(30):
                while await world.broker.get_result(job.id) is None:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            await sup.drain(0)
    result = await world.broker.get_result(job.id)
    assert result is not None
    return result


# --- as whom -----------------------------------------------------------------------------


async def test_a_staged_job_runs_as_its_slots_uid_seen_from_the_host(world: World) -> None:
    await ready(world)
    (world.notes / "go").write_text("wait")
    main = world.registry["mutate"].entry_path  # in every argv of the job
    job = await submit(
        world,
        [["write", "made.txt", "x"], ["spawn", "_", "2"], ["waitfor", "go"]],
    )
    seen: dict[int, dict[str, tuple[int, ...]]] = {}

    async def look() -> None:
        # Polling with a deadline: bubblewrap, the guest and its two children take a
        # moment to start (four processes or more: bubblewrap's monitor and init too).
        def enough() -> bool:
            seen.update(job_processes(main))
            return len(seen) >= 5

        await wait_for(enough, 20)

    result = await serve_until_done(world, job, look)
    assert result.status == "succeeded", result
    uids = {u for ids in seen.values() for u in ids["Uid"]}
    gids = {g for ids in seen.values() for g in ids["Gid"]}
    assert len(uids) == 1 and uids == gids, seen  # real, effective, saved, fs: all one id
    (uid,) = uids
    assert uid in slot_range() and uid != 0, seen
    assert all(ids["Groups"] == () for ids in seen.values()), seen  # root's groups dropped
    report = result.containment
    assert report is not None
    assert report.files.state == report.user.state == "kept", report
    assert f"host uid {uid}" in report.user.reason and f"host uid {uid}" in report.files.reason
    assert "disk writes bounded" in report.resources.reason
    # What it wrote is committed, root's (the folder's owner), never the slot's.
    made = (world.notes / "made.txt").stat()
    assert (world.notes / "made.txt").read_text() == "x" and (made.st_uid, made.st_gid) == (0, 0)


def mount_points(pid: int) -> list[str]:
    with open(f"/proc/{pid}/mountinfo") as f:
        return [line.split()[4] for line in f]


async def test_nothing_of_a_job_stays_mounted_in_the_staging_namespace(world: World) -> None:
    await ready(world)
    result = await world.run([["write", "a.txt", "a"]])
    assert result.status == "succeeded", result
    helper = world.staging._ns
    assert helper is not None and helper.running

    def below() -> list[str]:
        return [p for p in mount_points(helper.pid) if p.startswith(f"{helper.base}/")]

    def left() -> list[str]:
        return os.listdir(f"/proc/{helper.pid}/root{helper.base}")

    # The release is a message nobody waits for, and it detaches first and removes the
    # mount points after: poll for both, with a deadline.
    with contextlib.suppress(TimeoutError):
        await wait_for(lambda: not below() and not left(), 5)
    assert below() == []  # the job's tmpfs, lower layers, overlays, sources: detached
    assert left() == []  # their mount points


# --- files: what a slot's uid may read ---------------------------------------------------


@pytest.fixture
def system_secret() -> Iterator[Path]:
    """A root-only file in a system tree every job sees read-only (``/opt``)."""
    need(os.path.isdir("/opt"), "/opt absent on this host")
    base = Path(tempfile.mkdtemp(prefix="metnos-rootonly-", dir="/opt"))
    try:
        base.chmod(0o755)
        secret = base / "key"
        secret.write_text("root secret")
        secret.chmod(0o600)
        yield secret
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("mode", ["slot uid", "slot uids off"])
async def test_a_staged_job_cannot_read_root_only_files(
    world: World, system_secret: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    await ready(world)
    if mode == "slot uids off":  # the control: as root, the same job reads it
        monkeypatch.setenv(SLOT_UIDS_ENV, "off")
    # A root-only file of the job's own folder stays the job's (owner rights kept).
    own = world.notes / "own.txt"
    own.write_text("mine")
    own.chmod(0o600)
    parts = system_secret.parts[1:]
    result = await world.run(
        [["readabs", "secret.txt", *parts], ["readabs", "own_read.txt", *own.parts[1:]]]
    )
    assert result.status == "succeeded", result
    said = (world.notes / "secret.txt").read_text()
    assert result.containment is not None
    files, user = result.containment.files, result.containment.user
    assert (world.notes / "own_read.txt").read_text() == "read:mine"
    if mode == "slot uids off":
        assert said == "read:root secret"  # why the report says partial as root
        assert files.state == user.state == "partial", (files, user)
        assert f"{SLOT_UIDS_ENV}=off" in files.reason
        # Root's per-user kernel quotas too (see the inotify test below).
        resources = result.containment.resources
        assert resources.state == "partial" and ROOT_QUOTAS_REASON in resources.reason
        return
    assert said == "denied:EACCES", said
    assert files.state == user.state == "kept", (files, user)
    assert result.containment.resources.state == "kept", result.containment.resources


# --- resources: root's per-user kernel quotas ---------------------------------------------


def inotify_limit() -> int:
    return int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())


async def test_a_staged_job_cannot_use_up_roots_inotify_instances(world: World) -> None:
    # Inotify instances are counted per user, machine-wide (fs.inotify.max_user_instances).
    # As root, a staged job's instances were root's: while it held them every root
    # process of the host got EMFILE. As its slot's uid, it spends the slot's own quota.
    await ready(world)
    (world.notes / "go").write_text("wait")
    job = await submit(world, [["inotify", "held.txt"], ["waitfor", "go"]])
    refused: list[int] = []

    async def look() -> None:
        # The job writes its count into its overlay before it waits: seen in the helper.
        from tests.undo.helpers import staged_file_seen

        await wait_for(lambda: staged_file_seen(world, "held.txt"), 20)
        refused.append(inotify_refused())  # root: this test process

    result = await serve_until_done(world, job, look)
    assert result.status == "succeeded", result
    held, why = (world.notes / "held.txt").read_text().split()
    limit = inotify_limit()
    assert why == "EMFILE" and 0 < int(held) <= limit, (held, why)  # it hit *a* limit...
    assert refused == [0], f"root was refused an inotify instance: {errno.errorcode[refused[0]]}"
    assert result.containment is not None and result.containment.resources.state == "kept"


# --- the commit: owners ---------------------------------------------------------------------


def owners(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry below `root` (and `root`): owner, and kind with mode and content."""
    out: dict[str, tuple[int, int, str]] = {}
    for top, dirs, files in os.walk(root):
        for name in [".", *dirs, *files] if top == str(root) else [*dirs, *files]:
            path = os.path.join(top, name)
            st = os.lstat(path)
            what = oct(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                what += ":" + Path(path).read_text()
            out[os.path.normpath(os.path.relpath(path, root))] = (st.st_uid, st.st_gid, what)
    return out


@pytest.mark.parametrize("mode", ["slot uid", "slot uids off"])
async def test_committed_files_belong_to_their_folders_owner_and_undo_restores_owners(
    world: World, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    await ready(world)
    if mode == "slot uids off":  # the commit's policy does not depend on who ran the job
        monkeypatch.setenv(SLOT_UIDS_ENV, "off")
    notes = world.notes
    (notes / "mine.txt").write_text("root's\n")
    shared = notes / "shared"  # another user's folder that anyone may write (like /tmp)
    shared.mkdir()
    theirs = shared / "theirs.txt"
    theirs.write_text("theirs\n")
    for path, mode_bits in ((shared, 0o777), (theirs, 0o666)):
        os.chown(path, OTHER, OTHER)
        path.chmod(mode_bits)
    before = owners(notes)
    result = await world.run(
        [
            ["write", "new.txt", "new\n"],
            ["append", "mine.txt", "more\n"],
            ["append", "shared/theirs.txt", "more\n"],
            ["write", "shared/new.txt", "new\n"],
            ["mkdir", "shared/d/e"],
            ["write", "shared/d/e/f.txt", "deep\n"],
            ["mkdir", "top/inner"],
        ]
    )
    assert result.status == "succeeded", result
    after = owners(notes)
    slot_ids = slot_range()
    assert not [p for p, (u, g, _) in after.items() if u in slot_ids or g in slot_ids], after
    want = {
        "new.txt": (0, 0),  # in root's folder: root's
        "mine.txt": (0, 0),  # changed: its owner stays
        "shared/theirs.txt": (OTHER, OTHER),  # changed: its owner stays
        "shared/new.txt": (OTHER, OTHER),  # in their folder: theirs
        "shared/d": (OTHER, OTHER),
        "shared/d/e": (OTHER, OTHER),  # a new folder's entries: its owner's
        "shared/d/e/f.txt": (OTHER, OTHER),
        "top": (0, 0),
        "top/inner": (0, 0),
    }
    assert {p: after[p][:2] for p in want} == want, after
    assert after["shared/theirs.txt"][2].endswith("theirs\nmore\n")

    client = Client(world.broker)
    undo_id = await client.submit_undo(result.job_id)
    await world.burst()
    undone = await world.broker.get_result(undo_id)
    assert undone is not None and undone.status == "succeeded", undone
    assert owners(notes) == before  # content, modes and owners: byte for byte

    redo_id = await client.submit_undo(undo_id)
    await world.burst()
    redone = await world.broker.get_result(redo_id)
    assert redone is not None and redone.status == "succeeded", redone
    assert owners(notes) == after


# --- when a slot's uid cannot be used -------------------------------------------------------


@pytest.mark.parametrize("where", ["worker", "helper"])
async def test_folders_that_cannot_be_idmapped_run_the_job_as_root_and_say_why(
    world: World, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    await ready(world)
    import metnos_exec.undo.overlay_run as staging_pkg
    from metnos_exec.undo.overlay import OverlayNamespace

    if where == "worker":

        def refuse(*_: Any, **__: Any) -> int:
            raise OSError(errno.EOPNOTSUPP, "idmapped mount: Operation not supported")

        monkeypatch.setattr(staging_pkg, "idmapped_clone", refuse)
    else:
        stage = OverlayNamespace.stage

        async def refusing(self: OverlayNamespace, *args: Any, **kw: Any) -> Any:
            if kw.get("lowers"):
                raise IdmapUnavailable("the staging helper refused an idmapped mount: test")
            return await stage(self, *args, **kw)

        monkeypatch.setattr(OverlayNamespace, "stage", refusing)
    result = await world.run([["write", "a.txt", "a"]])
    assert result.status == "succeeded", result  # the job still runs...
    assert (world.notes / "a.txt").read_text() == "a"
    assert result.containment is not None  # ... and its report says as whom
    files, user = result.containment.files, result.containment.user
    assert files.state == user.state == "partial", (files, user)
    assert "cannot mount as the slot uid" in files.reason, files


# --- the seam, on a real slot -----------------------------------------------------------------


class RecordingStager:
    """A `Stager` that records as whom it was asked to place, refusing slot uids when told."""

    def __init__(self, refuse_idmap: bool = False) -> None:
        self.asked: list[int | None] = []
        self.refuse_idmap = refuse_idmap

    async def place(
        self, identity: SlotIdentity | None, sources: Mapping[str, int]
    ) -> StagedPlacement:
        self.asked.append(None if identity is None else identity.uid)
        if identity is not None and self.refuse_idmap:
            raise IdmapUnavailable("refused")
        if identity is None:
            return StagedPlacement(("nsenter", "--"), dict(sources))
        return StagedPlacement(
            ("nsenter", "-S", str(identity.uid), "--"), dict(sources), uid=identity.uid
        )


@pytest.mark.parametrize("refuse", [False, True])
async def test_the_arm_places_a_staged_job_for_its_slots_uid(refuse: bool) -> None:
    from metnos_exec.process import pooled_slot
    from metnos_exec.sandbox import bwrap as bwrap_mod

    need_privileged(AS_ROOT, "slot uids are a root worker's")
    need_slot_uids()
    stager = RecordingStager(refuse_idmap=refuse)
    key = f"test-{os.getpid()}-{refuse}"
    staged_mod.register(key, stager)
    try:
        async with pooled_slot() as slot:
            assert slot is not None
            place = await bwrap_mod._placement(slot, {}, stage=key)
            identity = await slot.identity()
    finally:
        staged_mod.unregister(key)
    assert identity is not None
    if refuse:
        assert stager.asked == [identity.uid, None]  # asked for the slot, then as root
        assert not place.as_slot_user and place.root_reason is not None
        assert "cannot mount as the slot uid" in place.root_reason
        return
    assert stager.asked == [identity.uid]
    assert place.as_slot_user and place.uid == identity.uid and place.root_reason is None
    assert place.enter[:2] == ("nsenter", "-S")


async def test_a_stage_without_its_staging_layer_is_a_host_fault() -> None:
    from metnos_exec.errors import HostFault
    from metnos_exec.process import pooled_slot
    from metnos_exec.sandbox import bwrap as bwrap_mod

    async with pooled_slot() as slot:
        with pytest.raises(HostFault, match="no staging layer"):
            await bwrap_mod._placement(slot, {}, stage="never-registered")


def test_a_slots_user_namespace_maps_only_root_to_the_slot() -> None:
    from metnos_exec.identities import _id_map

    uid = 0x70000005
    lines = [tuple(int(x) for x in line.split()) for line in _id_map(uid).splitlines()]
    assert lines[0] == (0, uid, 1)
    # Every other id but the slot's own is itself; nothing maps to host root.
    covered = [(inside, outside, n) for inside, outside, n in lines[1:]]
    assert all(inside == outside for inside, outside, _ in covered)
    assert [(lo, lo + n - 1) for lo, _, n in covered] == [(1, uid - 1), (uid + 1, 2**32 - 2)]
    assert all(outside != 0 for _, outside, _ in lines)
