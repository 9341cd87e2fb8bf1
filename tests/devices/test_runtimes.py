"""Runtimes obtained through robust_fetch: python.wasm and a standalone CPython.

No real download: each test serves the bytes from a server on 127.0.0.1 (python.wasm is
the installed extra's own file, served as a mirror would serve it).
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import msgspec
import pytest

from metnos_exec.devices.fetch import FetchError
from metnos_exec.devices.runtimes import (
    device_python_source,
    obtain_device_python,
    obtain_python_wasm,
)
from metnos_exec.errors import BadConfig
from metnos_exec.manifest import Executor, load_manifest
from metnos_exec.plan import plan_invocation
from metnos_exec.sandbox._types import Sandbox, Success
from metnos_exec.sandbox._wasm_runtime import find_python_wasm, verified_python_wasm
from metnos_exec.sandbox.flags import guest_python
from metnos_exec.worker import check_worker_config
from tests.conftest import need, need_import
from tests.helpers.http_server import Bad, serving

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _needs_device_extra() -> None:
    need_import("httpx", "device")


async def test_python_wasm_is_fetched_when_the_extra_is_missing(tmp_path: Path) -> None:
    installed = find_python_wasm({}, use_package=True)
    need(
        installed is not None and installed.path.is_file(),
        "the wasm-python extra (the runtime served here) is not installed",
    )
    assert installed is not None
    env = {"METNOS_CACHE_DIR": str(tmp_path / "cache")}
    # Without the extra and without a URL: nothing to do, nothing found.
    assert await obtain_python_wasm(env, use_package=False) is None
    assert find_python_wasm(env, use_package=False) is None
    with serving() as start:
        bad = Bad(installed.path.read_bytes(), "ok")
        env["METNOS_PYTHON_WASM_URL"] = start(bad, "python-3.12.0.wasm")
        got = await obtain_python_wasm(env, use_package=False)
        assert got == tmp_path / "cache" / "runtimes" / "python-3.12.0.wasm"
        assert bad.sent == installed.path.stat().st_size
        # Found from now on, and verified against the pin like any other source.
        found = find_python_wasm(env, use_package=False)
        assert found is not None and found.source == "fetched"
        assert verified_python_wasm(env, use_package=False) == got
        # Present: never fetched again.
        assert await obtain_python_wasm(env, use_package=False) is None
        assert len(bad.requests) == 4  # 26 MiB in 8 MiB ranges, once


async def test_a_mirror_serving_another_python_wasm_is_refused(tmp_path: Path) -> None:
    env = {"METNOS_CACHE_DIR": str(tmp_path / "cache")}
    with serving() as start:
        env["METNOS_PYTHON_WASM_URL"] = start(Bad(b"not the runtime" * 1000, "ok"))
        with pytest.raises(FetchError, match="two downloads agree"):
            await obtain_python_wasm(env, use_package=False)
    assert find_python_wasm(env, use_package=False) is None
    assert not list((tmp_path / "cache" / "runtimes").iterdir())


def test_a_device_python_url_needs_its_pinned_hash() -> None:
    assert device_python_source({}) is None
    env = {"METNOS_DEVICE_PYTHON_URL": "http://127.0.0.1:1/python.tar.gz"}
    with pytest.raises(BadConfig, match="nothing is downloaded without a pinned hash"):
        device_python_source(env)
    with pytest.raises(BadConfig, match="pinned hash"):
        check_worker_config(environ=env)
    with pytest.raises(BadConfig, match="without METNOS_DEVICE_PYTHON_URL"):
        device_python_source({"METNOS_DEVICE_PYTHON_SHA256": "0" * 64})


def test_the_fallback_data_filter_refuses_what_the_data_filter_refuses(tmp_path: Path) -> None:
    from metnos_exec.devices.runtimes import _data_members

    def archive(*members: tarfile.TarInfo) -> tarfile.TarFile:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for m in members:
                tar.addfile(m, io.BytesIO(b"") if m.isfile() else None)
        buf.seek(0)
        return tarfile.open(fileobj=buf)

    def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644):
        m = tarfile.TarInfo(name)
        m.type, m.linkname, m.mode = kind, link, mode
        return m

    ok = _data_members(
        archive(
            member("python/bin/python3.12", mode=0o6777),
            member("python/bin/python3", tarfile.SYMTYPE, "python3.12"),
        )
    )
    assert len(ok) == 2 and ok[0].mode == 0o755  # setuid, setgid and o+w gone
    for bad in (
        member("/etc/passwd"),
        member("python/../../x"),
        member("python/bin/sh", tarfile.SYMTYPE, "/bin/sh"),
        member("python/bin/up", tarfile.SYMTYPE, "../../../etc"),
        member("python/dev", tarfile.CHRTYPE),
    ):
        with pytest.raises(tarfile.TarError):
            _data_members(archive(bad))


def _standalone_archive() -> bytes:
    """An install_only-shaped archive whose python3 marks the jobs it runs."""
    script = f'#!/bin/sh\nMETNOS_STANDALONE=yes exec {guest_python()} "$@"\n'.encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("python", "python/bin"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        info = tarfile.TarInfo("python/bin/python3")
        info.size, info.mode = len(script), 0o4755  # the setuid bit must not survive
        tar.addfile(info, io.BytesIO(script))
    return buf.getvalue()


async def test_a_standalone_cpython_is_fetched_and_runs_native_jobs(
    tmp_path: Path, native_arm: Sandbox
) -> None:
    import hashlib

    arm = native_arm
    archive = _standalone_archive()
    env = {
        "METNOS_CACHE_DIR": str(tmp_path / "cache"),
        "METNOS_DEVICE_PYTHON_SHA256": hashlib.sha256(archive).hexdigest(),
    }
    with serving() as start:
        bad = Bad(archive, "ok")
        env["METNOS_DEVICE_PYTHON_URL"] = start(bad, "cpython.tar.gz")
        exe = await obtain_device_python(env)
        assert exe is not None and exe.name == "python3"
        assert not os.stat(exe).st_mode & 0o6000
        # Unpacked once: a second worker start reuses it without a request.
        assert await obtain_device_python(env) == exe
        assert len(bad.requests) == 1
    folder = tmp_path / "ex" / "which"
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text(
        'name = "which"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
    )
    (folder / "main.py").write_text(
        'import json, os\nprint(json.dumps({"standalone": os.environ.get("METNOS_STANDALONE")}))\n'
    )
    ex = Executor(manifest=load_manifest(folder / "manifest.toml"), path=str(folder))
    inv = plan_invocation(ex, {}, home=str(tmp_path), python=str(exe))
    assert inv.job.argv is not None and inv.job.argv[0] == str(exe)
    outcome = await arm.run(inv.job)
    assert isinstance(outcome.exit, Success), outcome
    assert msgspec.json.decode(outcome.stdout) == {"standalone": "yes"}
