"""Shared pieces of the staging tests: an executor that mutates a folder on request, a
home with notes, and a byte-exact snapshot of a tree."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Job, Result
from metnos_exec.sandbox.bwrap import bwrap_probe
from metnos_exec.supervisor import Supervisor
from metnos_exec.supervisor.config import split_settings
from metnos_exec.undo.staging import Staging
from tests.conftest import need

MUTATE_MANIFEST = """\
name = "mutate"
version = "1"
runtime = "python"
entry = "main.py"
[args.root]
type = "string"
format = "path"
required = true
[args.target]
type = "string"
format = "path"
default = "~/notes/target.txt"
[args.ops]
type = "array"
default = []
[args.fail]
type = "boolean"
default = false
[args.sleep]
type = "number"
default = 0
[[capabilities]]
name = "fs:write"
hints = ["~/notes/**"]
[limits]
timeout_s = 20
disk_mb = {disk_mb}
"""

# Does what `ops` say, relative to `root`; each op is [kind, name, *more]. Paths outside
# the hints are spelled as segments ("abs" ops) so argument vetting lets the *executor*
# misbehave: the kernel wall and the commit rules are what the tests are about.
MUTATE_MAIN = """\
import ctypes, errno, json, os, shutil, sys, time

HELD = []
a = json.load(sys.stdin)
root = a["root"]
for kind, name, *more in a["ops"]:
    p = os.path.join(root, name)
    if kind == "write":
        with open(p, "w") as f:
            f.write(more[0])
    elif kind == "append":
        with open(p, "a") as f:
            f.write(more[0])
    elif kind == "fill":
        with open(p, "wb") as f:
            for _ in range(int(more[0])):
                f.write(b"x" * 65536)
    elif kind == "rm":
        os.remove(p)
    elif kind == "rmtree":
        shutil.rmtree(p)
    elif kind == "mv":
        os.rename(p, os.path.join(root, more[0]))
    elif kind == "chmod":
        os.chmod(p, int(more[0], 8))
    elif kind == "mkdir":
        os.makedirs(p)
    elif kind == "symlink":
        os.symlink(more[0], p)
    elif kind == "symlink_abs":
        os.symlink("/" + "/".join(more), p)
    elif kind == "mkfifo":
        os.mkfifo(p)
    elif kind == "waitfor":
        # The host writes "go" into this (existing) file when the test has done its part:
        # read through the overlay from the live lower file (a name the host creates
        # later is not seen: the overlay caches the lookup). A deadline keeps a broken
        # test from hanging.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with open(p) as f:
                if f.read() == "go":
                    break
            time.sleep(0.01)
    elif kind == "many":
        for i in range(int(more[0])):
            with open(os.path.join(p, f"f{i}"), "w") as f:
                f.write("x" * 100)
    elif kind == "readabs":
        # What the job may read outside its folders, written into `name`.
        try:
            with open("/" + "/".join(more)) as f:
                said = "read:" + f.read()
        except OSError as exc:
            said = "denied:" + (errno.errorcode.get(exc.errno) or str(exc.errno))
        with open(p, "w") as f:
            f.write(said)
    elif kind == "inotify":
        # Inotify instances until the kernel refuses one (held until the job ends).
        libc = ctypes.CDLL(None, use_errno=True)
        while True:
            fd = libc.inotify_init1(os.O_CLOEXEC)
            if fd < 0:
                break
            HELD.append(fd)
        with open(p, "w") as f:
            f.write(f"{len(HELD)} {errno.errorcode.get(ctypes.get_errno())}")
    elif kind == "spawn":
        # Children that outlive the step (the sandbox's end kills them).
        for _ in range(int(more[0])):
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
    else:
        raise SystemExit(f"unknown op {kind}")
if a["sleep"]:
    time.sleep(a["sleep"])
if a["fail"]:
    sys.exit(3)
print(json.dumps({"ok": True}))
"""


def bwrap_works() -> None:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap cannot build a sandbox here: {probe.error}")


def write_executor(root: Path, *, disk_mb: int = 64) -> Path:
    folder = root / "executors" / "mutate"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.toml").write_text(MUTATE_MANIFEST.format(disk_mb=disk_mb))
    (folder / "main.py").write_text(MUTATE_MAIN)
    return folder.parent


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry below `root`: kind, permission bits, content hash or link target."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", oct(stat.S_IMODE(st.st_mode)))
            elif stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                out[rel] = ("file", oct(stat.S_IMODE(st.st_mode)), digest)
            else:
                out[rel] = ("special", oct(st.st_mode))
    return out


@dataclass
class World:
    """A home with ``notes/``, the mutate executor, a memory broker, a staging."""

    tmp: Path
    home: Path
    notes: Path
    registry: ExecutorRegistry
    broker: MemoryBroker
    staging: Staging
    device: str = "server"
    supervisors: list[Supervisor] = field(default_factory=list)

    def supervisor(
        self, *, device: str | None = None, staging: Staging | None = None, **kw: Any
    ) -> Supervisor:
        config, collaborators = split_settings(
            {
                "worker_id": f"w-{device or self.device}",
                "device": device or self.device,
                "home": str(self.home),
                **kw,
            }
        )
        return Supervisor(
            self.broker, self.registry, config, staging=staging or self.staging, **collaborators
        )

    async def burst(
        self, *, device: str | None = None, staging: Staging | None = None, **kw: Any
    ) -> None:
        await self.supervisor(device=device, staging=staging, **kw).run(burst=True)

    async def run(self, ops: list[list[Any]], **args: Any) -> Result:
        job = Job(executor="mutate", args={"root": "~/notes", "ops": ops, **args})
        await self.broker.submit(job)
        await self.burst()
        result = await self.broker.get_result(job.id)
        assert result is not None
        return result

    async def entries_count(self) -> int:
        return len(self.broker._undo)


def make_world(
    tmp: Path, *, disk_mb: int = 64, overlay: bool = True, existing: bool = False
) -> World:
    """`existing`: ``<tmp>/home/notes`` is there already (made by the test)."""
    home = tmp / "home"
    notes = home / "notes"
    notes.mkdir(parents=True, exist_ok=existing)
    registry = ExecutorRegistry.load(write_executor(tmp, disk_mb=disk_mb))
    return World(
        tmp=tmp,
        home=home,
        notes=notes,
        registry=registry,
        broker=MemoryBroker(),
        staging=Staging(tmp / "state", overlay=overlay),
    )


async def staging_works(world: World) -> None:
    bwrap_works()
    reason = await world.staging.start()
    need(reason is None, f"overlay staging is unavailable here: {reason}")


def seed(notes: Path) -> None:
    (notes / "keep.txt").write_text("keep\n")
    (notes / "mod.txt").write_text("old content\n")
    (notes / "del.txt").write_text("delete me\n")
    (notes / "mv.txt").write_text("move me\n")
    (notes / "tool.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(notes / "tool.sh", 0o644)
    (notes / "sub").mkdir()
    (notes / "sub" / "deep.txt").write_text("deep\n")
    os.symlink("keep.txt", notes / "link")


async def api_undo(world: World, job_id: str, *, device: str | None = None) -> Result:
    """`Client.undo` (submit and wait) against a worker serving meanwhile; an error the
    client raises is raised here, outside the task group."""
    from metnos_exec.client import Client

    sup = world.supervisor(device=device, idle_poll_s=0.01)
    error: BaseException | None = None
    result: Result | None = None
    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        try:
            result = await Client(world.broker).undo(job_id, wait=20)
        except Exception as exc:
            error = exc
        finally:
            await sup.drain(0)
    if error is not None:
        raise error
    assert result is not None
    return result


def staged_file_seen(world: World, name: str) -> bool:
    """Whether a running job's overlay holds `name` in its upper folder (the job wrote
    it): looked at inside the staging helper's namespace, never visible on the host."""
    helper = world.staging._ns
    if helper is None or not helper.running:
        return False
    base = Path(f"/proc/{helper.pid}/root{helper.base}")
    return any((d / "t" / "u0" / name).exists() for d in base.iterdir())


async def wait_for(pred: Any, deadline_s: float = 10.0) -> None:
    """Poll `pred` (a plain callable: a host file, a broker dict) until true, with a
    deadline: what it watches has no event to wait on."""
    with anyio.fail_after(deadline_s):
        while not pred():  # noqa: ASYNC110 - polling with a deadline, nothing to wait on
            await anyio.sleep(0.01)
