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


def test_check_folder_and_symlink_on_path(tree: Path) -> None:
    assert check_folder(str(tree / "real" / "inner")) is True
    assert check_folder(str(tree / "real" / "missing" / "deeper")) is False
    assert symlink_on_path(str(tree / "link" / "inner")) == str(tree / "link")
    assert symlink_on_path(str(tree / "real" / "inner")) is None
    with pytest.raises(SymlinkedFolder, match="-> "):
        check_folder(str(tree / "link" / "missing"))


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
