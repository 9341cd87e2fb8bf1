"""The change set read from an overlay's upper folder, built here by hand."""

from __future__ import annotations

import os
import stat
import struct
import tempfile
import time
from pathlib import Path

import pytest

from metnos_exec.messages import Absent, DirState, FileState, LinkState, Move, Put
from metnos_exec.undo.changes import MAX_DEPTH, CommitPlan, change_stamp, plan_commit
from metnos_exec.undo.journal import HostTree
from tests.conftest import need_privileged

XATTR = "user."


def whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def plan(root: Path, upper: Path, since_ns: int) -> CommitPlan:
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with HostTree([str(root)]) as tree:
            result = plan_commit(tree, [(str(root), fd)], since_ns=since_ns, xattr_prefix=XATTR)
            result.source.close()
            return result
    finally:
        os.close(fd)


_stamps: list[Path] = []


def stamp_after(*paths: Path) -> int:
    """A "job start" stamp taken now, as staging takes it (after the changes of `paths`,
    which the test made just before)."""
    folder = Path(tempfile.mkdtemp(prefix="stamp-"))
    _stamps.append(folder)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        stamp = change_stamp(fd)
    finally:
        os.close(fd)
    assert all(p.lstat().st_ctime_ns < stamp for p in paths)
    return stamp


@pytest.fixture
def trees(tmp_path: Path) -> tuple[Path, Path]:
    root, upper = tmp_path / "root", tmp_path / "upper"
    root.mkdir()
    upper.mkdir()
    return root, upper


def can_whiteout(tmp_path: Path) -> bool:
    try:
        whiteout(tmp_path / ".probe")
    except PermissionError:
        return False
    os.unlink(tmp_path / ".probe")
    return True


def test_whiteouts_opaque_folders_and_moves(trees: tuple[Path, Path], tmp_path: Path) -> None:
    if not can_whiteout(tmp_path):
        pytest.skip("this kernel refuses whiteouts (char 0/0) to this user")
    root, upper = trees
    (root / "gone").write_text("gone")
    (root / "old").write_text("moved content")
    (root / "dir").mkdir()
    (root / "dir" / "a").write_text("a")
    (root / "dir" / "b").write_text("b")
    since = stamp_after(root / "gone", root / "old", root / "dir" / "b")
    whiteout(upper / "gone")
    whiteout(upper / "old")
    (upper / "new").write_text("moved content")
    (upper / "dir").mkdir()
    os.setxattr(upper / "dir", f"{XATTR}overlay.opaque", b"y")
    (upper / "dir" / "b").write_text("b again")
    result = plan(root, upper, since)
    assert result.conflicts == []
    ops = {
        (type(op).__name__, op.path if isinstance(op, Put) else (op.src, op.dst))
        for op in result.ops
    }
    assert ("Put", str(root / "gone")) in ops  # a whiteout is a deletion, never a node
    assert ("Move", (str(root / "old"), str(root / "new"))) in ops  # content reappeared
    assert ("Put", str(root / "dir" / "a")) in ops  # opaque: what was not staged again goes
    assert ("Put", str(root / "dir" / "b")) in ops  # and the restaged one replaces
    removed = [op for op in result.ops if isinstance(op, Put) and op.path == str(root / "gone")]
    assert isinstance(removed[0].after, Absent) and isinstance(removed[0].before, FileState)
    assert str(root / "gone") in result.destroyed and str(root / "old") not in result.destroyed


def test_setuid_and_special_files_are_filtered(trees: tuple[Path, Path]) -> None:
    root, upper = trees
    (upper / "suid").write_text("x")
    os.chmod(upper / "suid", 0o6755)
    (upper / "sgid_dir").mkdir()
    os.chmod(upper / "sgid_dir", 0o2775)
    os.mkfifo(upper / "fifo")
    if os.geteuid() == 0:
        os.mknod(upper / "dev", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's
    result = plan(root, upper, time.time_ns())
    after = {op.path: op.after for op in result.ops if isinstance(op, Put)}
    assert isinstance(after[str(root / "suid")], FileState)
    assert after[str(root / "suid")].mode == 0o755  # type: ignore[union-attr]
    sgid_dir = after[str(root / "sgid_dir")]
    assert isinstance(sgid_dir, DirState) and sgid_dir.mode == 0o775  # (a root worker's: owned)
    assert str(root / "fifo") not in after and str(root / "dev") not in after
    what = dict(result.filtered)
    assert "setuid/setgid" in what[str(root / "suid")]
    assert "special file" in what[str(root / "fifo")]
    if os.geteuid() == 0:
        assert "special file" in what[str(root / "dev")]


def test_the_hosts_own_setuid_and_setgid_bits_are_kept(trees: tuple[Path, Path]) -> None:
    # A job writing into a shared folder with the setgid bit (g+s: new files take the
    # team's group) took the bit off the host's folder: the overlay copies the folder up
    # with its mode, and the commit stripped it as if the job had set it. Only bits the
    # job added go; a file whose content the job changed loses them all the same.
    root, upper = trees
    (root / "team").mkdir()
    os.chmod(root / "team", 0o2775)
    (root / "tool").write_text("tool")
    os.chmod(root / "tool", 0o4755)
    (root / "changed").write_text("old")
    os.chmod(root / "changed", 0o4755)
    (root / "rootonly").write_text("r")
    os.chmod(root / "rootonly", 0o4700)
    since = stamp_after(root / "team", root / "tool", root / "changed", root / "rootonly")
    (upper / "team").mkdir()
    os.chmod(upper / "team", 0o2775)  # copied up, as the overlay does
    (upper / "team" / "new.txt").write_text("n")
    (upper / "tool").write_text("tool")  # copied up, unchanged
    os.chmod(upper / "tool", 0o4755)
    (upper / "changed").write_text("new content")
    os.chmod(upper / "changed", 0o4755)
    (upper / "rootonly").write_text("r")  # made 4755 (only without the seccomp filter)
    os.chmod(upper / "rootonly", 0o4755)
    result = plan(root, upper, since)
    assert result.conflicts == []
    after = {op.path: op.after for op in result.ops if isinstance(op, Put)}
    assert str(root / "team") not in after and str(root / "tool") not in after
    assert set(after) == {
        str(root / "team" / "new.txt"),
        str(root / "changed"),
        str(root / "rootonly"),
    }
    for name in ("changed", "rootonly"):
        state = after[str(root / name)]
        assert isinstance(state, FileState) and state.mode == 0o755, name
        assert "setuid/setgid" in dict(result.filtered)[str(root / name)]


def test_links_are_committed_as_links(trees: tuple[Path, Path]) -> None:
    root, upper = trees
    os.symlink("/etc/shadow", upper / "evil")
    result = plan(root, upper, time.time_ns())
    [op] = result.ops
    assert op == Put(
        path=str(root / "evil"), before=Absent(), after=LinkState(target="/etc/shadow")
    )


def test_a_name_or_link_target_that_is_not_utf8_refuses_the_commit(
    trees: tuple[Path, Path],
) -> None:
    # The journal and the undo entry are JSON: such a name made the commit crash as a host
    # fault (tests/adversarial: files.names_that_are_not_utf8). Now nothing is applied and
    # each one is named, its bytes spelled out.
    root, upper = trees
    (upper / "fine").write_text("x")
    with open(os.fsencode(upper) + b"/\xff-file", "w") as f:
        f.write("x")
    os.mkdir(os.fsencode(upper) + b"/\xfe-dir")
    os.symlink(b"\xfd-target", os.fsencode(upper) + b"/link")
    result = plan(root, upper, time.time_ns())
    refused = {c.path: c.reason for c in result.conflicts}
    assert sorted(refused) == sorted([f"{root}/link", f"{root}/\\xfe-dir", f"{root}/\\xff-file"])
    assert "link target is not valid UTF-8" in refused[f"{root}/link"]
    assert "name is not valid UTF-8" in refused[f"{root}/\\xff-file"]


def test_folders_nested_past_the_limit_refuse_the_commit(trees: tuple[Path, Path]) -> None:
    # 1,500 nested folders crashed the planner (RecursionError) as a host fault
    # (tests/adversarial: files.folders_nested_without_end).
    root, upper = trees
    deep = upper.joinpath(*["d"] * MAX_DEPTH)
    deep.mkdir(parents=True)
    (deep / "leaf").write_text("x")  # at the limit: committed
    result = plan(root, upper, time.time_ns())
    assert result.conflicts == [] and len(result.ops) == MAX_DEPTH + 1
    (deep / "d" / "d").mkdir(parents=True)  # past it
    result = plan(root, upper, time.time_ns())
    [refused] = result.conflicts
    assert refused.path == str(root.joinpath(*["d"] * (MAX_DEPTH + 1)))
    assert f"nested more than {MAX_DEPTH} deep" in refused.reason


def test_a_copy_up_without_change_is_no_change(trees: tuple[Path, Path]) -> None:
    root, upper = trees
    (root / "same").write_text("same")
    (root / "chmodded").write_text("c")
    since = stamp_after(root / "same", root / "chmodded")
    (upper / "same").write_text("same")
    (upper / "chmodded").write_text("c")
    os.chmod(upper / "chmodded", 0o600)
    result = plan(root, upper, since)
    [op] = result.ops
    assert isinstance(op, Put) and op.path == str(root / "chmodded")
    assert isinstance(op.before, FileState) and isinstance(op.after, FileState)
    assert op.before.sha256 == op.after.sha256 and op.after.mode == 0o600
    assert result.destroyed == {}  # no content lost: no blob needed


def test_a_target_changed_on_the_host_since_the_start_is_a_conflict(
    trees: tuple[Path, Path],
) -> None:
    root, upper = trees
    (root / "edited").write_text("v1")
    (root / "untouched").write_text("u")
    since = stamp_after(root / "edited", root / "untouched")
    (root / "edited").write_text("v2 by a person")  # while the job ran
    (root / "appeared").write_text("the host made it too")
    (root / "untouched").write_text("changed, but the job did not touch it")
    (upper / "edited").write_text("the job's version")
    (upper / "appeared").write_text("the job's")
    (upper / "mine").write_text("new")
    result = plan(root, upper, since)
    assert sorted(c.path for c in result.conflicts) == [
        str(root / "appeared"),
        str(root / "edited"),
    ]
    assert result.ops == ()  # refused as a whole


def test_a_moved_file_keeps_its_inode(trees: tuple[Path, Path], tmp_path: Path) -> None:
    if not can_whiteout(tmp_path):
        pytest.skip("this kernel refuses whiteouts (char 0/0) to this user")
    root, upper = trees
    (root / "src").write_text("content")
    since = stamp_after(root / "src")
    whiteout(upper / "src")
    (upper / "dst").write_text("content")
    result = plan(root, upper, since)
    assert [type(op) for op in result.ops] == [Move]


def test_below_an_opaque_folder_the_host_is_replaced_whole(trees: tuple[Path, Path]) -> None:
    root, upper = trees
    (root / "d" / "e").mkdir(parents=True)
    (root / "d" / "e" / "old.txt").write_text("old")
    (root / "d" / "e" / "f.txt").write_text("f0")
    (root / "d" / "x").write_text("x")
    since = stamp_after(root / "d" / "e" / "old.txt", root / "d" / "e" / "f.txt", root / "d" / "x")
    # rm -r d; mkdir -p d/e; echo f1 > d/e/f.txt: only d carries the opaque mark.
    (upper / "d" / "e").mkdir(parents=True)
    os.setxattr(upper / "d", f"{XATTR}overlay.opaque", b"y")
    (upper / "d" / "e" / "f.txt").write_text("f1")
    result = plan(root, upper, since)
    assert result.conflicts == []
    gone = {op.path for op in result.ops if isinstance(op, Put) and isinstance(op.after, Absent)}
    assert gone == {str(root / "d" / "x"), str(root / "d" / "e" / "old.txt")}
    replaced = [op for op in result.ops if isinstance(op, Put) and op.path.endswith("/f.txt")]
    assert len(replaced) == 1 and isinstance(replaced[0].after, FileState)


def test_a_host_entry_next_to_the_jobs_is_no_conflict(trees: tuple[Path, Path]) -> None:
    root, upper = trees
    (root / "sub").mkdir()
    (root / "sub" / "a").write_text("a")
    since = stamp_after(root / "sub", root / "sub" / "a")
    (root / "sub" / "theirs.txt").write_text("a person saved a note meanwhile")
    (upper / "sub").mkdir()  # copied up: the job added an entry in it
    os.chmod(upper / "sub", stat.S_IMODE((root / "sub").stat().st_mode))
    (upper / "sub" / "mine.txt").write_text("the job's note")
    result = plan(root, upper, since)
    assert result.conflicts == []
    assert [op.path for op in result.ops if isinstance(op, Put)] == [str(root / "sub" / "mine.txt")]


def plan_as(root: Path, upper: Path, since_ns: int, *, as_root: bool) -> CommitPlan:
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with HostTree([str(root)], as_root=as_root) as tree:
            result = plan_commit(tree, [(str(root), fd)], since_ns=since_ns, xattr_prefix=XATTR)
            result.source.close()
            return result
    finally:
        os.close(fd)


def test_a_root_workers_commit_gives_new_entries_their_folders_owner(
    trees: tuple[Path, Path],
) -> None:
    # What the staged files' owners were is never carried over (a slot's uid, recycled);
    # new entries get the owner of the folder they land in, changed files keep theirs.
    from tests.conftest import need_privileged

    need_privileged(os.geteuid() == 0, "giving a folder to another owner")
    root, upper = trees
    other = 4242
    theirs = root / "theirs"
    theirs.mkdir()
    (theirs / "old.txt").write_text("old")
    for path in (theirs, theirs / "old.txt"):
        os.chown(path, other, other + 1)
    (root / "mine.txt").write_text("mine")
    since = stamp_after(theirs, theirs / "old.txt", root / "mine.txt")
    (upper / "theirs" / "made" / "deeper").mkdir(parents=True)
    (upper / "theirs" / "made" / "deeper" / "f").write_text("new")
    (upper / "theirs" / "old.txt").write_text("changed")
    (upper / "mine.txt").write_text("changed")
    (upper / "new.txt").write_text("new")
    for path in upper.rglob("*"):
        os.chown(path, 0x70000001, 0x70000001)  # as a slot's job leaves them
    for as_root in (True, False):
        after = {
            op.path: op.after
            for op in plan_as(root, upper, since, as_root=as_root).ops
            if isinstance(op, Put)
        }
        owners = {
            os.path.relpath(p, root): (s.uid, s.gid)
            for p, s in after.items()
            if isinstance(s, FileState | DirState)
        }
        if not as_root:  # an unprivileged worker's commit sets no owner at all
            assert set(owners.values()) == {(None, None)}, owners
            continue
        assert owners == {
            "theirs/made": (other, other + 1),
            "theirs/made/deeper": (other, other + 1),
            "theirs/made/deeper/f": (other, other + 1),
            "theirs/old.txt": (other, other + 1),
            "mine.txt": (0, 0),
            "new.txt": (0, 0),
        }, owners


def test_a_change_set_too_large_to_record_refuses_the_commit(
    trees: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every path a job creates is written into the journal and the undo entry (and held
    # several times in the worker's memory meanwhile): 30,000 empty files below 120
    # folders with 255-byte names (a 30 KiB path each, within any disk budget) made a
    # 940 MB undo entry and took the worker from 38 MB to 3.7 GB (tests/adversarial:
    # resources.commit_record_size).
    from metnos_exec.undo import change_checks

    monkeypatch.setattr(change_checks, "MAX_RECORD_BYTES", 64 * 1024)
    root, upper = trees
    deep = upper.joinpath(*["d" * 200] * 10)
    deep.mkdir(parents=True)
    for i in range(20):
        (deep / f"{i:03d}").write_text("x")
    result = plan(root, upper, time.time_ns())  # ~44 KiB of names: committed
    assert result.conflicts == [] and len(result.ops) == 30
    for i in range(20, 40):
        (deep / f"{i:03d}").write_text("x")
    result = plan(root, upper, time.time_ns())  # ~88 KiB: refused, once
    [refused] = result.conflicts
    assert "too many or too long names" in refused.reason and result.ops == ()


def test_small_files_are_held_in_memory_only_up_to_a_total(
    trees: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Files up to 64 KiB were all read into the worker's memory for the commit: the
    # whole disk budget (a manifest's disk_mb of 8 GiB: 8 GiB in the worker). Past
    # `INLINE_TOTAL` they are read from the upper folder when written, as larger ones are.
    from metnos_exec.undo import changes

    monkeypatch.setattr(changes, "INLINE_TOTAL", 10 * 1024)
    root, upper = trees
    for i in range(8):
        (upper / f"f{i}").write_bytes(bytes([i]) * 4096)
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with HostTree([str(root)]) as tree:
            result = plan_commit(
                tree, [(str(root), fd)], since_ns=time.time_ns(), xattr_prefix=XATTR
            )
            held = sum(len(d) for d in result.source._data.values())
            assert held <= 10 * 1024 and len(result.source._data) == 2
            for i in range(8):  # every one still committed with its content
                got = result.source.fetch(str(root / f"f{i}"), FileState(sha256="", size=0, mode=0))
                if isinstance(got, int):
                    with os.fdopen(got, "rb") as f:
                        got = f.read()
                assert got == bytes([i]) * 4096
            result.source.close()
    finally:
        os.close(fd)


def test_a_host_file_with_capabilities_is_not_made_executable_by_a_commit(
    trees: tuple[Path, Path],
) -> None:
    # A root-only tool with file capabilities (0700, cap_setuid) in a writable folder: the
    # job (owner of root's files there) made it 0755 and the commit applied the mode to
    # the host inode, capabilities kept, so any local user could run it (setuid bits are
    # refused and stripped; capabilities were not looked at).
    need_privileged(os.geteuid() == 0, "setting file capabilities needs root")
    root, upper = trees
    tool = root / "tool"
    tool.write_bytes(b"\x7fELF tool")
    tool.chmod(0o700)
    # VFS_CAP_REVISION_2, CAP_SETUID permitted + effective
    os.setxattr(tool, "security.capability", struct.pack("<IIIII", 0x02000001, 1 << 7, 0, 0, 0))
    plain = root / "plain"
    plain.write_bytes(b"plain")
    plain.chmod(0o700)
    since = stamp_after(tool, plain)
    for name in ("tool", "plain"):
        (upper / name).write_bytes((root / name).read_bytes())
        (upper / name).chmod(0o755)
    result = plan(root, upper, since)
    [refused] = result.conflicts
    assert refused.path == str(tool) and "file capabilities" in refused.reason
    # Taking execute away, or changing a file without capabilities, is no conflict.
    (upper / "tool").chmod(0o600)
    result = plan(root, upper, since)
    assert result.conflicts == [] and len(result.ops) == 2
