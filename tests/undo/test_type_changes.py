"""Issue 15, item 6: a commit that changes the type of a path undoes, and its undo undoes.

Real staged jobs (bubblewrap, overlays) turn a file, a folder or a symlink into one of the
other two, alone and nested (a folder with contents becoming a file, a file becoming a
folder with contents). Each job is undone, the undo undone, and the job undone again: every
step byte-exact (names, kinds, modes, contents, link targets; the originals' mtimes).
A folder becoming a file could never be undone (``E_UNDO_CONFLICT``: the undo looked for
the folder's entries through the file, "... is not a plain folder"), and the undo of a
file becoming a folder could not be undone in turn (the same look-up, the other way).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from metnos_exec.client import Client
from tests.undo.helpers import World, make_world, staging_works

pytestmark = pytest.mark.anyio


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    w = make_world(tmp_path)
    try:
        yield w
    finally:
        await w.staging.aclose()


def seed_types(notes: Path) -> None:
    """One of each kind, some with contents, to change the type of."""
    (notes / "f").write_text("a file\n")
    os.chmod(notes / "f", 0o640)
    (notes / "d").mkdir(mode=0o750)
    (notes / "d" / "a.txt").write_text("in the folder\n")
    (notes / "d" / "s").mkdir()
    (notes / "d" / "s" / "b.txt").write_text("deeper\n")
    os.symlink("f", notes / "l")
    (notes / "keep.txt").write_text("keep\n")
    # Old times on the originals: an undo restores them (a new file would get now's).
    for path in (notes / "f", notes / "d" / "a.txt", notes / "d" / "s" / "b.txt"):
        os.utime(path, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))


def full_snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry below `root`: kind, mode, owner, content, link target, and a file's
    mtime (an undo restores the originals' own)."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = ("dir", oct(st.st_mode & 0o7777), st.st_uid, st.st_gid)
            else:
                content = Path(path).read_bytes()
                out[rel] = ("file", oct(st.st_mode & 0o7777), st.st_uid, st.st_gid, content)
                out[rel + "@mtime"] = (st.st_mtime_ns,)
    return out


#: name → the job's ops (the mutate executor's, relative to ~/notes).
CASES: dict[str, list[list[Any]]] = {
    "file_to_folder": [["rm", "f"], ["mkdir", "f"]],
    "file_to_folder_with_contents": [
        ["rm", "f"],
        ["mkdir", "f/q"],
        ["write", "f/x", "x\n"],
        ["write", "f/q/y", "y\n"],
    ],
    "folder_to_file": [["rmtree", "d"], ["write", "d", "now a file\n"]],
    "file_to_symlink": [["rm", "f"], ["symlink", "f", "keep.txt"]],
    "symlink_to_file": [["rm", "l"], ["write", "l", "now a file\n"]],
    "folder_to_symlink": [["rmtree", "d"], ["symlink", "d", "keep.txt"]],
    "symlink_to_folder": [["rm", "l"], ["mkdir", "l"], ["write", "l/z", "z\n"]],
    "nested_folder_to_file": [["rmtree", "d/s"], ["write", "d/s", "was a folder\n"]],
    # Not type changes, but what an unprivileged worker cannot write into: a folder it
    # makes read-only with contents, made and taken away.
    "new_read_only_folder_with_contents": [
        ["mkdir", "ro/sub"],
        ["write", "ro/sub/x", "x\n"],
        ["chmod", "ro/sub", "555"],
        ["chmod", "ro", "500"],
    ],
    "nested_all_at_once": [
        ["rmtree", "d"],
        ["mkdir", "d"],
        ["symlink", "d/s", "elsewhere"],
        ["write", "d/a.txt", "a file again, new content\n"],
        ["rm", "f"],
        ["mkdir", "f/f"],
        ["write", "f/f/f", "f\n"],
        ["rm", "l"],
        ["symlink", "l", "d"],
    ],
}


async def undo(world: World, job_id: str) -> str:
    """Undo `job_id` through the queue; the undo job's id (it must have succeeded)."""
    undo_id = await Client(world.broker).submit_undo(job_id)
    await world.burst()
    result = await world.broker.get_result(undo_id)
    assert result is not None and result.status == "succeeded", result
    return undo_id


@pytest.mark.parametrize("case", list(CASES))
async def test_a_type_change_undoes_and_its_undo_undoes(world: World, case: str) -> None:
    await staging_works(world)
    seed_types(world.notes)
    before = full_snapshot(world.notes)
    result = await world.run(CASES[case])
    assert result.status == "succeeded" and len(result.undo_ids) == 1, result
    after = full_snapshot(world.notes)
    assert after != before

    undo_id = await undo(world, result.job_id)
    assert full_snapshot(world.notes) == before
    await undo(world, undo_id)
    assert full_snapshot(world.notes) == after
    await undo(world, result.job_id)
    assert full_snapshot(world.notes) == before
