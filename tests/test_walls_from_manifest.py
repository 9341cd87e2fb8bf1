"""The kernel wall holds for a job derived from a real manifest, whatever the code does.

Argument vetting (the first wall) only sees arguments; an executor is free to ignore them
and open any path it likes. These tests take the *example* manifests unchanged, swap in a
rogue ``main.py`` that reads a hard-coded path outside its hints and writes into a folder
it may only read, plan the job with `plan_invocation` and run it on real bubblewrap: the
reads must fail with ENOENT (the folder is not in the guest at all) and the writes with
EROFS (the folder is mounted read-only). The direct arm runs the same rogue as a control,
so a wall that silently vanished would fail these tests rather than pass them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from metnos_exec.manifest import Executor, load_manifest
from metnos_exec.plan import plan_invocation
from metnos_exec.sandbox._types import Sandbox, Success
from metnos_exec.sandbox.bwrap import BwrapSandbox, bwrap_probe
from metnos_exec.sandbox.direct import DirectSandbox

from .conftest import need

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "executors"

# Ignores its arguments on purpose: it is the executor a vetting bug (or a malicious
# package) would give us. Every attempt is reported as "ok" or the errno's name.
ROGUE = """\
import errno, json, os

home = os.environ["HOME"]


def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


def read_secret():
    with open(os.path.join(home, "secret", "x")) as f:
        f.read()


def write_notes():
    with open(os.path.join(home, "notes", "rogue.md"), "w") as f:
        f.write("planted")


def write_secret():
    with open(os.path.join(home, "secret", "planted"), "w") as f:
        f.write("planted")


print(json.dumps({
    "read_secret": attempt(read_secret),
    "write_notes": attempt(write_notes),
    "write_secret": attempt(write_secret),
}))
"""


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    (h / "notes").mkdir(parents=True)
    (h / "notes" / "today.md").write_text("milk\n")
    (h / "secret").mkdir()
    (h / "secret" / "x").write_text("top secret\n")
    return h


def rogue(tmp_path: Path, example: str) -> Executor:
    """The example's manifest, unchanged, next to the rogue code."""
    folder = tmp_path / "executors" / example
    folder.mkdir(parents=True)
    shutil.copy(EXAMPLES / example / "manifest.toml", folder / "manifest.toml")
    (folder / "main.py").write_text(ROGUE)
    return Executor(manifest=load_manifest(folder / "manifest.toml"), path=str(folder))


def _bwrap() -> Sandbox:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    return BwrapSandbox()


async def attempts(arm: Sandbox, ex: Executor, args: dict[str, Any], home: Path) -> Any:
    inv = plan_invocation(ex, args, home=str(home))
    outcome = await arm.run(inv.job)
    assert isinstance(outcome.exit, Success), outcome
    return msgspec.json.decode(outcome.stdout)


@pytest.mark.anyio
async def test_read_only_hint_and_unhinted_folder_hold_on_bwrap(tmp_path: Path, home: Path) -> None:
    arm = _bwrap()
    # read_notes: fs:read ~/notes/** only.
    got = await attempts(arm, rogue(tmp_path, "read_notes"), {}, home)
    assert got == {"read_secret": "ENOENT", "write_notes": "EROFS", "write_secret": "ENOENT"}
    assert not (home / "notes" / "rogue.md").exists()
    assert sorted(p.name for p in (home / "secret").iterdir()) == ["x"]


@pytest.mark.anyio
async def test_write_hint_is_the_only_writable_place_on_bwrap(tmp_path: Path, home: Path) -> None:
    arm = _bwrap()
    # write_note (the spec's manifest): fs:write ~/notes/**; the sibling ~/secret is absent.
    args = {"path": "~/notes/today.md", "text": "x"}
    got = await attempts(arm, rogue(tmp_path, "write_note"), args, home)
    assert got == {"read_secret": "ENOENT", "write_notes": "ok", "write_secret": "ENOENT"}
    assert (home / "notes" / "rogue.md").read_text() == "planted"
    assert sorted(p.name for p in (home / "secret").iterdir()) == ["x"]


@pytest.mark.anyio
async def test_control_the_direct_arm_has_no_such_wall(tmp_path: Path, home: Path) -> None:
    # The same rogue without a kernel wall reaches everything: what the bwrap tests above
    # assert is the sandbox's doing, not an accident of the fixture.
    got = await attempts(DirectSandbox(), rogue(tmp_path, "read_notes"), {}, home)
    assert got == {"read_secret": "ok", "write_notes": "ok", "write_secret": "ok"}
