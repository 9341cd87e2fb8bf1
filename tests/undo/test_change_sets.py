"""A staged job's change set (issue 21): every path created, modified, deleted, renamed,
with sizes, modes and a diff for small text files; derived from the commit's plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from metnos_exec.changeset import MAX_DIFF_BYTES, ChangeSet, describe_changes
from metnos_exec.messages import Absent, FileState, Move, Put, Result
from metnos_exec.undo.change_report import change_set
from tests.undo.helpers import World, make_world, seed, staging_works

pytestmark = pytest.mark.anyio

KINDS = [
    ["write", "new.txt", "brand new\n"],
    ["append", "mod.txt", "appended\n"],
    ["rm", "del.txt"],
    ["mv", "mv.txt", "moved.txt"],
    ["chmod", "tool.sh", "755"],
    ["fill", "big.bin", "2"],
    ["mkdir", "newdir"],
    ["symlink", "link2", "keep.txt"],
]


@pytest.fixture
async def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    try:
        yield w
    finally:
        await w.staging.aclose()


async def test_a_staged_result_lists_its_change_set(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    result = await world.run(KINDS)
    assert result.status == "succeeded", result
    changes = result.changes
    assert changes is not None and changes.committed and not changes.truncated
    by = {e.path.removeprefix(f"{world.notes}/"): e for e in changes.entries}
    assert by["new.txt"].kind == "created" and by["new.txt"].size_after == 10
    assert by["new.txt"].diff is not None and "+brand new" in by["new.txt"].diff
    mod = by["mod.txt"]
    assert mod.kind == "modified" and (mod.size_before, mod.size_after) == (12, 21)
    assert mod.diff is not None and "+appended" in mod.diff and " old content" in mod.diff
    assert by["del.txt"].kind == "deleted" and by["del.txt"].diff is not None
    assert "-delete me" in by["del.txt"].diff
    moved = by["moved.txt"]
    assert moved.kind == "renamed" and moved.src == str(world.notes / "mv.txt")
    assert "mv.txt" not in by  # listed once, as the rename
    tool = by["tool.sh"]
    assert tool.kind == "modified" and (tool.mode_before, tool.mode_after) == (0o644, 0o755)
    assert tool.diff is None  # same bytes
    big = by["big.bin"]
    assert big.size_after == 2 * 65536 > MAX_DIFF_BYTES and big.diff_omitted == "too_large"
    assert by["newdir"].type == "dir" and by["newdir"].kind == "created"
    assert by["link2"].type == "symlink" and by["link2"].target_after == "keep.txt"
    assert changes.total == len(changes.entries) == 8
    text = describe_changes(changes)
    assert "renamed" in text and "+appended" in text and "8 change(s), committed" in text
    # On the wire: the Result round-trips with it.
    import msgspec

    again = msgspec.json.decode(msgspec.json.encode(result), type=Result)
    assert again.changes == changes


def test_binary_and_capped_sets() -> None:
    ops = [
        Put(
            path=f"/r/f{i:04d}", before=Absent(), after=FileState(sha256=f"{i}", size=1, mode=0o644)
        )
        for i in range(1005)
    ]
    ops.append(Move(src="/r/a", dst="/r/b", state=FileState(sha256="s", size=1, mode=0o644)))
    got = change_set(ops, before=lambda p, s: b"x", after=lambda p, s: b"\xff\xfe")
    assert isinstance(got, ChangeSet)
    assert got.total == 1006 and len(got.entries) == got.max_entries == 1000 and got.truncated
    assert got.entries[0].binary and got.entries[0].diff is None
    assert "only the first 1000 listed" in describe_changes(got)
