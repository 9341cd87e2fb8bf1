"""``metnos-exec doctor`` on this machine and on one with a mechanism removed.

Each run is a real ``metnos-exec doctor`` process (probes are cached per process), as root
and as an unprivileged user (uid 65534 through ``setpriv``), with bubblewrap taken off the
``PATH`` for the "removed" machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from metnos_exec.sandbox.bwrap import bwrap_probe

from .conftest import need, need_privileged

pytestmark = pytest.mark.slow


@pytest.fixture
def world() -> Iterator[Path]:
    """A world-readable folder (an unprivileged run must reach it): a PATH without
    bubblewrap, and a HOME."""
    root = Path(tempfile.mkdtemp(prefix="metnos-doctor-test-"))
    try:
        os.chmod(root, 0o755)
        (root / "bin").mkdir(mode=0o755)
        for tool in ("unshare", "mount", "sh"):
            found = shutil.which(tool)
            if found:
                (root / "bin" / tool).symlink_to(found)
        (root / "home").mkdir(mode=0o777)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def doctor(
    world: Path,
    *args: str,
    unprivileged: bool = False,
    path: str | None = None,
    broker: str = "memory://",
    as_json: bool = True,
    **env: str,
) -> tuple[int, Any]:
    argv = [sys.executable, "-m", "metnos_exec", "doctor", "--broker", broker]
    argv += ["--json"] if as_json else []
    if not unprivileged and os.geteuid() != 0:
        pytest.skip("the root half needs root")
    if unprivileged and os.geteuid() != 0:
        pass  # already unprivileged: run as we are
    elif unprivileged:
        setpriv = shutil.which("setpriv")
        need(setpriv is not None, "setpriv (util-linux) not installed")
        assert setpriv is not None
        argv = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--", *argv]
    run = subprocess.run(
        [*argv, *args],
        capture_output=True,
        timeout=120,
        check=False,
        cwd="/",
        env={
            "PATH": path if path is not None else str(world / "bin"),
            "HOME": str(world / "home"),
            "METNOS_CACHE_DIR": str(world / "home" / "cache"),
            **env,
        },
    )
    assert run.returncode in (0, 1), run.stderr.decode()[-2000:]
    return run.returncode, msgspec.json.decode(run.stdout) if as_json else run.stdout.decode()


def finding(report: dict[str, Any], check: str) -> dict[str, Any]:
    [found] = [f for f in report["findings"] if f["check"] == check]
    return found


@pytest.mark.parametrize("unprivileged", [False, True], ids=["root", "unprivileged"])
def test_bubblewrap_off_the_path_is_reported_with_its_fix(world: Path, unprivileged: bool) -> None:
    code, report = doctor(world, unprivileged=unprivileged, METNOS_REQUIRE_SANDBOX="always")
    assert (report["uid"] != 0) == unprivileged
    bwrap = finding(report, "bwrap")
    assert bwrap["state"] == "missing" and bwrap["required"] is True
    assert "not installed" in bwrap["detail"]
    assert "sandbox: none" in bwrap["meaning"]
    assert bwrap["fix"].startswith("apt-get install bubblewrap")
    # The policy requires the kernel wall, and it is missing: non-zero.
    assert code == 1 and report["healthy"] is False
    # The same machine under a policy that lets jobs degrade: the gap is reported, and
    # nothing required is missing.
    code, report = doctor(world, unprivileged=unprivileged, METNOS_REQUIRE_SANDBOX="never")
    assert finding(report, "bwrap")["state"] == "missing"
    assert finding(report, "bwrap")["required"] is False
    assert code == 0 and report["healthy"] is True
    user = finding(report, "worker_user")
    if unprivileged:
        assert user["state"] == "ok"
        cgroups = finding(report, "cgroups")
        # Not root and not delegated here: limits fall back to rlimits, and it says how.
        assert cgroups["state"] == "weakened" and "partial" in cgroups["meaning"]
        assert cgroups["fix"]
    else:
        # Without bubblewrap a root worker's jobs run on the direct arm: full root.
        assert user["state"] == "weakened" and "full root" in user["meaning"]
        assert "not_kept" in user["meaning"] and "useradd" in user["fix"]


@pytest.mark.parametrize("unprivileged", [False, True], ids=["root", "unprivileged"])
def test_this_machine_as_it_is(world: Path, unprivileged: bool) -> None:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    code, report = doctor(world, unprivileged=unprivileged, path="/usr/bin:/bin")
    assert finding(report, "bwrap")["state"] == "ok"
    assert finding(report, "user_namespaces")["state"] == "ok"
    assert finding(report, "broker")["state"] == "ok"
    for f in report["findings"]:
        # Every gap comes with what it means; every real gap with a fix.
        if f["state"] in ("weakened", "missing"):
            assert f["meaning"] and f["fix"], f
    assert code == 0, [f for f in report["findings"] if f["required"] and f["state"] != "ok"]


def test_a_device_worker_without_a_trust_key_is_not_healthy(world: Path) -> None:
    code, report = doctor(world, "--device", "phone", METNOS_REQUIRE_SANDBOX="never")
    trust = finding(report, "trust")
    assert trust["state"] == "missing" and trust["required"] is True
    assert "metnos-exec keygen" in trust["fix"]
    assert code == 1


def test_an_unreachable_broker_is_required(world: Path) -> None:
    bad = world / "home" / "not-a-db"
    bad.write_text("this is not SQLite")
    code, report = doctor(world, broker=f"sqlite:///{bad}", METNOS_REQUIRE_SANDBOX="never")
    broker = finding(report, "broker")
    assert broker["state"] == "missing" and broker["required"] and broker["fix"]
    assert code == 1


def test_a_redis_that_would_lose_acknowledged_jobs_is_weakened(
    world: Path, redis_server: Any
) -> None:
    # The suite's server runs queue/redis.conf with --appendonly no and no save points.
    _, report = doctor(world, broker=redis_server.url, METNOS_REQUIRE_SANDBOX="never")
    broker = finding(report, "broker")
    assert broker["state"] == "weakened" and not broker["required"]
    assert "keeps nothing on disk" in broker["detail"]
    assert "appendonly yes" in broker["fix"]


def test_text_output_names_each_gap_and_its_fix(world: Path) -> None:
    code, out = doctor(world, as_json=False, METNOS_REQUIRE_SANDBOX="always")
    assert code == 1
    assert "MISS bwrap: bubblewrap is not installed" in out and "[required]" in out
    assert "fix:   apt-get install bubblewrap" in out
    assert "NOT healthy: required and missing: bwrap" in out


def test_the_cgroup_probe_is_honest_for_a_user_who_cannot_create_one() -> None:
    # Root made the `metnos` parent (a root worker, or this suite, did before): an
    # unprivileged process saw mkdir(exist_ok=True) succeed and claimed pids limits
    # ("pids (cgroup)" in the direct arm's report) it could not create.
    from metnos_exec.process import pids_cgroup_available

    need_privileged(os.geteuid() == 0, "the parent cgroup must be made by root first")
    need_privileged(pids_cgroup_available(), "no writable pids cgroup hierarchy here")
    setpriv = shutil.which("setpriv")
    need(setpriv is not None, "setpriv (util-linux) not installed")
    assert setpriv is not None
    code = (
        "from metnos_exec.process import memory_cgroup_available, pids_cgroup_available\n"
        "print(pids_cgroup_available(), memory_cgroup_available())\n"
    )
    argv = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    run = subprocess.run(
        [*argv, sys.executable, "-c", code],
        capture_output=True,
        timeout=60,
        check=False,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.split() == [b"False", b"False"]


def _as(unprivileged: bool, code: str) -> str:
    """`code`'s output, run by this interpreter as the doctor's user (65534 or root)."""
    argv = [sys.executable, "-c", code]
    if unprivileged and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        need(setpriv is not None, "setpriv (util-linux) not installed")
        assert setpriv is not None
        argv = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--", *argv]
    run = subprocess.run(argv, capture_output=True, timeout=60, check=False, cwd="/")
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    return run.stdout.decode().strip()


@pytest.mark.parametrize("unprivileged", [False, True], ids=["root", "unprivileged"])
def test_overlay_staging_is_the_staging_modules_own_probe(world: Path, unprivileged: bool) -> None:
    # The doctor probed with `unshare` and said "does not stage writes yet... no undo
    # yet", while workers staged and undid writes. It now says what the staging module's
    # own probe (the one `status` and the worker use) finds, and what that means.
    probe = "from metnos_exec.undo.overlay import probe_staging; print(probe_staging())"
    expected = _as(unprivileged, probe)
    _, report = doctor(world, unprivileged=unprivileged, path="/usr/bin:/bin")
    staging = finding(report, "overlay_staging")
    assert staging["detail"].startswith(expected), (staging, expected)
    assert "yet" not in staging["detail"] + staging["meaning"]
    if expected.startswith("available"):
        assert staging["state"] == "ok", staging
        assert "undo" in staging["meaning"] and "disk" in staging["meaning"]
    else:
        assert staging["state"] == "weakened" and staging["fix"], staging
        assert "partial" in staging["meaning"]


def test_a_root_worker_is_told_what_its_jobs_really_run_as(world: Path) -> None:
    # Slot uids exist: a root worker's bubblewrap jobs are not host root. The doctor told
    # every root worker they were.
    from metnos_exec.identities import slot_uids_unavailable
    from metnos_exec.process import slots_available

    need_privileged(os.geteuid() == 0, "a root worker's finding")
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    need(slot_uids_unavailable() is None and slots_available(), "no slot uids here")
    _, report = doctor(world, path="/usr/bin:/bin")
    user = finding(report, "worker_user")
    assert user["state"] == "ok", user
    assert "slot" in user["detail"] and "host root for file permissions" not in user["meaning"]
    # What still is root's is named: the wasm engine, the direct arm.
    assert "wasm" in user["meaning"] and "direct" in user["meaning"]
    # Slot uids switched off: the jobs are root's for file permissions, and it says so.
    _, report = doctor(world, path="/usr/bin:/bin", METNOS_SLOT_UIDS="off")
    user = finding(report, "worker_user")
    assert user["state"] == "weakened", user
    assert "METNOS_SLOT_UIDS=off" in user["detail"] and "partial" in user["meaning"]
    assert "METNOS_SLOT_UIDS" in user["fix"] and "useradd" in user["fix"]


FAKE_OLD_BWRAP = """#!/bin/sh
# bubblewrap 0.7 as the probe sees it: the real one, without --bind-fd or --disable-userns.
case "$1" in
  --version) echo "bubblewrap 0.7.0"; exit 0 ;;
  --help) REAL --help | /bin/grep -v -e '--bind-fd' -e '--ro-bind-fd' -e '--disable-userns'
          exit 0 ;;
esac
exec REAL "$@"
"""


@pytest.mark.parametrize("unprivileged", [False, True], ids=["root", "unprivileged"])
def test_bubblewraps_bind_fd_and_disable_userns_are_checked(
    world: Path, unprivileged: bool
) -> None:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    assert probe.path is not None
    _, report = doctor(world, unprivileged=unprivileged, path="/usr/bin:/bin")
    bind_fd, userns = finding(report, "bwrap_bind_fd"), finding(report, "bwrap_disable_userns")
    assert (bind_fd["state"] == "ok") == probe.features.bind_fd, bind_fd
    assert (userns["state"] == "ok") == probe.features.disable_userns, userns
    # An older bubblewrap (the real one behind a script that hides both flags).
    fake = world / "bin" / "bwrap"
    fake.write_text(FAKE_OLD_BWRAP.replace("REAL", probe.path))
    fake.chmod(0o755)
    _, report = doctor(world, unprivileged=unprivileged, path=f"{world / 'bin'}:/usr/bin:/bin")
    assert finding(report, "bwrap")["state"] == "ok"  # it still builds the sandbox
    bind_fd, userns = finding(report, "bwrap_bind_fd"), finding(report, "bwrap_disable_userns")
    assert bind_fd["state"] == "weakened" and "files axis says partial" in bind_fd["meaning"]
    assert "symlink" in bind_fd["meaning"] and "--bind-fd" in bind_fd["fix"]
    assert userns["state"] == "weakened" and "user axis says partial" in userns["meaning"]
    assert "/dev/shm" in userns["meaning"] and "0.8" in userns["fix"]


def test_the_cgroup_advice_is_what_the_code_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    # The cgroup v2 advice was a delegated systemd scope, which the code never looks at
    # (it makes per-job cgroups under /sys/fs/cgroup/metnos only).
    from metnos_exec import doctor_host as doctor_mod
    from metnos_exec import process

    monkeypatch.setattr(process, "pids_cgroup_available", lambda: False)
    monkeypatch.setattr(process, "memory_cgroup_available", lambda: False)
    for v1 in (True, False):
        [cg] = doctor_mod._cgroup_findings(v1=v1)
        assert cg.state == "weakened"
        assert cg.fix is not None and "systemd-run" not in cg.fix and "Delegate" not in cg.fix
        assert "partial" in cg.meaning
        if v1:
            assert "/sys/fs/cgroup/pids/metnos" in cg.fix and "/sys/fs/cgroup/memory" in cg.fix
        else:
            assert "/sys/fs/cgroup/metnos" in cg.fix and "root" in cg.fix


def test_an_executors_folder_the_worker_cannot_use_is_reported(world: Path) -> None:
    """`doctor --executors DIR` said "healthy" for a folder that does not exist (the worker
    then refuses to start) and said nothing of manifests that fail to load (their jobs are
    refused): each is now a required finding, with the fix."""
    ex = world / "home" / "ex"
    code, report = doctor(world, "--executors", str(ex), METNOS_REQUIRE_SANDBOX="never")
    found = finding(report, "executors")
    assert found["state"] == "missing" and found["required"] is True, found
    assert "does not exist" in found["detail"] and found["fix"]
    assert code == 1
    for name, manifest in (("good", 'name = "good"'), ("bad", 'name = "bad')):
        (ex / name).mkdir(parents=True)
        (ex / name / "manifest.toml").write_text(
            f'{manifest}\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
        )
        (ex / name / "main.py").write_text("")
    code, report = doctor(world, "--executors", str(ex), METNOS_REQUIRE_SANDBOX="never")
    found = finding(report, "executors")
    assert found["state"] == "missing" and found["required"] is True, found
    assert "1 of 2" in found["detail"] and "bad" in found["detail"], found
    assert "not valid TOML" in found["detail"] and "E_BAD_MANIFEST" in found["meaning"]
    assert code == 1
    (ex / "bad").rename(world / "home" / "bad")
    code, report = doctor(world, "--executors", str(ex), METNOS_REQUIRE_SANDBOX="never")
    found = finding(report, "executors")
    assert found["state"] == "ok" and "good" in found["detail"], found
    assert code == 0


@pytest.mark.parametrize("unprivileged", [False, True], ids=["root", "unprivileged"])
def test_a_malformed_slot_uid_setting_is_a_required_finding(
    world: Path, unprivileged: bool
) -> None:
    # Issue 15: a worker refuses to start on it (E_CONFIG); doctor says so, with the fix.
    code, report = doctor(world, unprivileged=unprivileged, METNOS_SLOT_UIDS="abc")
    found = finding(report, "slot_uids")
    assert found["state"] == "missing" and found["required"] is True
    assert "METNOS_SLOT_UIDS='abc'" in found["detail"] and "E_CONFIG" in found["meaning"]
    assert code == 1 and report["healthy"] is False
    _, fine = doctor(world, unprivileged=unprivileged, METNOS_SLOT_UIDS="off")
    assert [f for f in fine["findings"] if f["check"] == "slot_uids"] == []


@pytest.mark.anyio
@pytest.mark.parametrize("url", ["sqlite:///q.db?busy_timeout_s=0", "redis://[bad"])
async def test_a_malformed_broker_url_is_a_missing_broker_with_the_url_to_fix(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SQLite one was "info: no queue file yet" (healthy); the Redis one said to start
    # a Redis server. The CLI refuses both before diagnosing (exit 2).
    from metnos_exec.doctor import _broker_findings

    monkeypatch.chdir(tmp_path)
    [found] = await _broker_findings(url)
    assert (found.check, found.state, found.required) == ("broker", "missing", True)
    assert "E_BAD_BROKER_URL" in found.detail and "correct the URL" in (found.fix or "")
    assert os.listdir(tmp_path) == []
