"""Mount sources: opened without following a symlink, bound from the fd (issue 8)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from metnos_exec.errors import SymlinkedFolder
from metnos_exec.sandbox import mount_sources
from metnos_exec.sandbox._types import Mount, SandboxJob
from metnos_exec.sandbox.flags import BwrapFeatures, derive_bwrap_argv
from metnos_exec.sandbox.mount_sources import check_folder, open_source, symlink_on_path


@pytest.fixture(params=["openat2", "walk"])
def opener(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of opening: openat2, and the component walk kernels before 5.6 get."""
    monkeypatch.setattr(mount_sources, "_have_openat2", [request.param == "openat2"])
    return str(request.param)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "real" / "inner").mkdir(parents=True)
    (tmp_path / "real" / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "self").symlink_to(tmp_path / "real" / "inner")
    return tmp_path


def test_a_real_path_opens_as_an_o_path_fd_closed_on_exec(opener: str, tree: Path) -> None:
    for path in (tree / "real", tree / "real" / "inner", tree / "real" / "file"):
        fd = open_source(str(path))
        try:
            assert os.path.samestat(os.fstat(fd), os.stat(path))
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_PATH  # nothing read, no device
        finally:
            os.close(fd)


@pytest.mark.parametrize("rel", ["link", "link/inner", "real/self", "real/self/x"])
def test_a_symlink_anywhere_on_the_way_is_refused(opener: str, tree: Path, rel: str) -> None:
    with pytest.raises((SymlinkedFolder, FileNotFoundError)) as ei:
        os.close(open_source(str(tree / rel)))
    if rel != "real/self/x":
        assert isinstance(ei.value, SymlinkedFolder), ei.value
        assert ei.value.code == "E_SYMLINKED_FOLDER"
        assert str(tree / rel.split("/")[0]) in ei.value.message or "self" in ei.value.message


def test_missing_is_not_found_and_relative_is_refused(opener: str, tree: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_source(str(tree / "nope"))
    with pytest.raises(ValueError):
        open_source("relative/path")


def test_check_folder_and_symlink_on_path(opener: str, tree: Path) -> None:
    # With openat2 the common answer is one syscall; without it (or when it refuses)
    # the component walk answers: the same answers either way.
    assert check_folder(str(tree / "real" / "inner")) is True
    assert check_folder(str(tree / "real" / "file")) is True
    assert check_folder(str(tree / "real" / "file" / "below")) is False
    assert check_folder(str(tree / "real" / "missing" / "deeper")) is False
    assert symlink_on_path(str(tree / "link" / "inner")) == str(tree / "link")
    assert symlink_on_path(str(tree / "real" / "inner")) is None
    with pytest.raises(SymlinkedFolder, match="-> "):
        check_folder(str(tree / "link" / "missing"))
    for rel in ("link", "link/inner", "real/self", "real/self/x"):
        with pytest.raises(SymlinkedFolder, match="-> "):
            check_folder(str(tree / rel))


def test_flags_bind_from_the_fds_and_leave_out_what_was_not_opened() -> None:
    job = SandboxJob(
        argv=("x",),
        mounts=(Mount("/srv/ro", "/srv/ro"), Mount("/srv/rw", "/srv/rw", writable=True),
                Mount("/srv/gone", "/srv/gone")),
    )  # fmt: skip
    fds = {"/srv/ro": 7, "/srv/rw": 8, "/opt/py": 9}

    def argv(features: BwrapFeatures) -> list[str]:
        return derive_bwrap_argv(
            job, features=features, interpreter_roots=("/opt/py",), source_fds=fds,
            exists=lambda p: p in ("/usr", "/etc"), isdir=lambda p: True,
            readlink=lambda p: None,
        )  # fmt: skip

    got = " ".join(argv(BwrapFeatures(version=(0, 8, 0), bind_fd=True)))
    assert "--ro-bind-fd 7 /srv/ro" in got and "--bind-fd 8 /srv/rw" in got
    assert "--ro-bind-fd 9 /opt/py" in got
    assert "/srv/gone" not in got  # not opened: absent, not mounted by path
    old = " ".join(argv(BwrapFeatures(version=(0, 8, 0), bind_fd=False)))
    assert "--ro-bind /srv/ro /srv/ro" in old and "--bind /srv/rw /srv/rw" in old
    assert "-fd" not in old.replace("--json-status-fd", "")


# --- a root worker's idmapped staging -------------------------------------------------------


def need_root_staging() -> None:
    from tests.conftest import need_privileged

    need_privileged(os.geteuid() == 0, "idmapped staging is a root worker's")


def test_staged_sources_show_roots_files_as_the_slot_uid_and_detach_on_close(
    tmp_path: Path,
) -> None:
    from metnos_exec.identities import allocate
    from metnos_exec.sandbox.mount_sources import STAGE_ROOT, StagedSources

    need_root_staging()
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.md").write_text("x")
    (tmp_path / "todo.md").write_text("file mount")
    identity = allocate()
    try:
        fds = {str(folder): open_source(str(folder)), str(tmp_path / "todo.md"):
               open_source(str(tmp_path / "todo.md"))}  # fmt: skip
        try:
            staged = StagedSources(fds, identity.uid, identity.gid, identity.userns_fd)
            try:
                root = os.fstat(staged.fds[str(folder)])
                assert os.path.samestat(root, os.stat(folder))  # the very folder...
                point = os.readlink(f"/proc/self/fd/{staged.fds[str(folder)]}")
                assert point.startswith(STAGE_ROOT + "/")
                # ... shown through the idmap as the slot's: root's file, its owner.
                assert os.stat(os.path.join(point, "a.md")).st_uid == identity.uid
                assert (root.st_uid, os.stat(folder).st_uid) == (identity.uid, 0)
                file_point = os.readlink(f"/proc/self/fd/{staged.fds[str(tmp_path / 'todo.md')]}")
                with open(file_point) as f:
                    assert f.read() == "file mount"
            finally:
                staged.close()
            assert point not in _mount_points_now()
            assert (folder / "a.md").read_text() == "x"  # detached, nothing removed
        finally:
            for fd in fds.values():
                os.close(fd)
    finally:
        identity.close()


def _mount_points_now() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f]


def test_the_sweep_detaches_a_dead_workers_mounts_and_never_deletes_through_them(
    tmp_path: Path,
) -> None:
    import ctypes

    from metnos_exec.sandbox import mount_sources as ms

    need_root_staging()
    ms._stage_dir(os.getuid(), os.getgid())  # the private stage root exists
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.md").write_text("never deleted")
    dead = 4_000_000  # above pid_max on any host: never alive
    point = Path(ms.STAGE_ROOT) / str(dead) / "123" / "0"
    point.mkdir(parents=True)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mount(str(precious).encode(), str(point).encode(), None, 0x1000, None) == 0
    try:
        assert str(point) in _mount_points_now()
        ms._sweep(ms.STAGE_ROOT)
        assert str(point) not in _mount_points_now()
        assert not (Path(ms.STAGE_ROOT) / str(dead)).exists()
        assert (precious / "keep.md").read_text() == "never deleted"
    finally:
        libc.umount2(str(point).encode(), 2)
