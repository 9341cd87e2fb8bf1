"""The fallback ladder: each trigger degrades once, loudly, and honestly; or is refused.

"bwrap missing" is simulated with a PATH without it; "cannot create namespaces" with a fake
bubblewrap that answers like bubblewrap does when the kernel refuses (a test double for the
probe only — real jobs still run on the real direct arm).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from metnos_exec.errors import BadConfig, SandboxRequired, ToolUnavailable
from metnos_exec.sandbox import _bwrap_probe as bwrap_mod
from metnos_exec.sandbox._types import AXES, SandboxJob
from metnos_exec.sandbox.absent import AbsentSandbox
from metnos_exec.sandbox.bwrap import BwrapSandbox, bwrap_probe, forget_probes
from metnos_exec.sandbox.select import check_bwrap_setting, choose_arm, decide_arm
from tests.conftest import need

REAL_BWRAP = shutil.which("bwrap")

_NAMESPACE_ERROR = (
    "bwrap: No permissions to creating new namespace, likely because the kernel does not "
    "allow non-privileged user namespaces."
)


@pytest.fixture(autouse=True)
def _fresh_probe_cache() -> Iterator[None]:
    forget_probes()
    yield
    forget_probes()


@pytest.fixture
def no_bwrap_env(tmp_path: Path) -> dict[str, str]:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    return {"PATH": str(empty)}


def write_fake_bwrap(path: Path) -> Path:
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "bubblewrap 0.8.0"; exit 0; fi\n'
        f"echo '{_NAMESPACE_ERROR}' >&2\n"
        "exit 1\n"
    )
    path.chmod(0o755)
    return path


@pytest.fixture
def broken_bwrap_env(tmp_path: Path) -> dict[str, str]:
    fake = write_fake_bwrap(tmp_path / "bwrap")
    return {"METNOS_BWRAP": str(fake), "PATH": os.environ.get("PATH", os.defpath)}


def marker_job(marker: Path) -> SandboxJob:
    code = f"open({str(marker)!r}, 'w').write('ran'); print('{{}}')"
    return SandboxJob(argv=(os.path.realpath(sys.executable), "-I", "-S", "-c", code))


def degraded_records(logs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in logs if r["event"] == "sandbox.degraded"]


# --- each trigger -----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("trigger", ["bwrap_missing", "sandbox_off", "userns_unavailable"])
async def test_each_trigger_degrades_once_and_says_none(
    trigger: str,
    tmp_path: Path,
    no_bwrap_env: dict[str, str],
    broken_bwrap_env: dict[str, str],
) -> None:
    env = {
        "bwrap_missing": no_bwrap_env,
        "sandbox_off": {"METNOS_SANDBOX": "off", "PATH": os.environ.get("PATH", "")},
        "userns_unavailable": broken_bwrap_env,
    }[trigger]
    marker = tmp_path / "ran"
    with capture_logs() as logs:
        choice = choose_arm("python", require_sandbox=False, env=env)
        outcome = await choice.sandbox.run(marker_job(marker))
    records = degraded_records(logs)
    assert len(records) == 1, logs
    rec = records[0]
    assert rec["log_level"] == "warning"
    assert (rec["requested"], rec["used"], rec["reason"]) == ("bwrap", "none", trigger)
    assert rec["axes_lost"] == list(AXES)
    assert choice.degraded is not None and choice.degraded.reason == trigger
    # Degraded, yet it ran, and the result says so.
    assert marker.read_text() == "ran"
    assert outcome.containment.sandbox == "none"
    assert outcome.containment.lost() == list(AXES)


@pytest.mark.parametrize("value", ["off", "0", "false", "none", "OFF", " False "])
def test_sandbox_off_values(value: str) -> None:
    env = {"METNOS_SANDBOX": value, "PATH": os.environ.get("PATH", "")}
    assert decide_arm("python", env).arm == "none"
    assert decide_arm("python", env).degraded is not None


def test_userns_failure_detail_is_bubblewraps_words(broken_bwrap_env: dict[str, str]) -> None:
    deg = decide_arm("python", broken_bwrap_env).degraded
    assert deg is not None and deg.reason == "userns_unavailable"
    assert deg.detail is not None and "namespace" in deg.detail


@pytest.mark.anyio
@pytest.mark.parametrize("trigger", ["bwrap_missing", "sandbox_off", "userns_unavailable"])
async def test_required_sandbox_refuses_and_job_never_runs(
    trigger: str,
    tmp_path: Path,
    no_bwrap_env: dict[str, str],
    broken_bwrap_env: dict[str, str],
) -> None:
    env = {
        "bwrap_missing": no_bwrap_env,
        "sandbox_off": {"METNOS_SANDBOX": "0"},
        "userns_unavailable": broken_bwrap_env,
    }[trigger]
    marker = tmp_path / "ran"
    with capture_logs() as logs, pytest.raises(SandboxRequired) as info:
        choice = choose_arm("python", require_sandbox=True, env=env)
        await choice.sandbox.run(marker_job(marker))  # pragma: no cover - must not get here
    assert info.value.code == "E_SANDBOX_REQUIRED"
    assert trigger in info.value.message
    assert not marker.exists()
    # The refusal is the supervisor's job.rejected; no degradation happened.
    assert degraded_records(logs) == []


# --- the healthy path and the caches ------------------------------------------------------


def need_real_bwrap() -> None:
    need(REAL_BWRAP is not None and bwrap_probe().working, "bubblewrap missing or not working")


def test_working_bwrap_is_chosen_without_a_record() -> None:
    need_real_bwrap()
    with capture_logs() as logs:
        choice = choose_arm("python", require_sandbox=True)
    assert isinstance(choice.sandbox, BwrapSandbox) and choice.degraded is None
    assert degraded_records(logs) == []


def test_installing_bwrap_later_needs_no_restart(tmp_path: Path) -> None:
    need_real_bwrap()
    assert REAL_BWRAP is not None
    bindir = tmp_path / "bin"
    bindir.mkdir()
    env = {"PATH": str(bindir)}
    assert decide_arm("python", env).degraded is not None
    (bindir / "bwrap").symlink_to(REAL_BWRAP)  # "apt install bubblewrap"
    assert decide_arm("python", env).arm == "bwrap"


def test_negative_probe_is_retried_when_the_binary_changes(tmp_path: Path) -> None:
    need_real_bwrap()
    fake = write_fake_bwrap(tmp_path / "bwrap")
    env = {"METNOS_BWRAP": str(fake)}
    assert decide_arm("python", env).arm == "none"
    fake.unlink()
    fake.write_text(f'#!/bin/sh\nexec {REAL_BWRAP} "$@"\n')  # the host got fixed
    fake.chmod(0o755)
    assert decide_arm("python", env).arm == "bwrap"


def test_negative_probe_expires(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = write_fake_bwrap(tmp_path / "bwrap")
    env = {"METNOS_BWRAP": str(fake)}
    calls: list[str] = []
    real = bwrap_mod._probe_uncached

    def counting(path: str) -> bwrap_mod.BwrapProbe:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(bwrap_mod, "_probe_uncached", counting)
    bwrap_probe(env)
    bwrap_probe(env)
    assert len(calls) == 1  # cached for a while
    monkeypatch.setattr(bwrap_mod, "NEGATIVE_PROBE_TTL_S", 0.0)
    bwrap_probe(env)
    assert len(calls) == 2  # ...but not for good


def test_positive_probe_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    need_real_bwrap()
    forget_probes()
    calls: list[str] = []
    real = bwrap_mod._probe_uncached

    def counting(path: str) -> bwrap_mod.BwrapProbe:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(bwrap_mod, "_probe_uncached", counting)
    monkeypatch.setattr(bwrap_mod, "NEGATIVE_PROBE_TTL_S", 0.0)
    for _ in range(3):
        assert choose_arm("python", require_sandbox=False).degraded is None
    assert len(calls) == 1


# --- wasm runtimes -----------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["wasm", "wasm-python"])
def test_wasm_runtimes_use_the_wasm_arm(runtime: str) -> None:
    with capture_logs() as logs:
        choice = choose_arm(runtime, require_sandbox=True)
    assert choice.sandbox.name == "wasm" and choice.degraded is None
    assert degraded_records(logs) == []


@pytest.mark.anyio
@pytest.mark.parametrize(("runtime", "instead"), [("wasm", ()), ("wasm-python", ("bwrap",))])
async def test_missing_wasm_arm_is_absent_not_degraded(
    runtime: str, instead: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "metnos_exec.sandbox.wasm", None)  # import fails
    with capture_logs() as logs:
        choice = choose_arm(runtime, require_sandbox=True)
    assert isinstance(choice.sandbox, AbsentSandbox) and choice.degraded is None
    assert decide_arm(runtime).arm == "absent"
    with pytest.raises(ToolUnavailable) as info:
        await choice.sandbox.run(SandboxJob())
    assert info.value.code == "E_TOOL_UNAVAILABLE"
    assert "wasm" in info.value.message
    for arm in instead:
        assert arm in info.value.message
    assert degraded_records(logs) == []


def test_unknown_runtime_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose_arm("cobol", require_sandbox=False)


@pytest.mark.parametrize("kind", ["missing_path", "not_executable", "unknown_name"])
def test_an_explicit_bwrap_that_is_not_executable_is_a_config_error(
    tmp_path: Path, kind: str
) -> None:
    # Before: silently the direct arm as "bwrap_missing", even with /usr/bin/bwrap working.
    if kind == "missing_path":
        value = str(tmp_path / "no-such-bwrap")
    elif kind == "not_executable":
        plain = tmp_path / "bwrap"
        plain.write_text("not a program\n")
        plain.chmod(0o644)
        value = str(plain)
    else:
        value = "no-such-bwrap-name"
    env = {"METNOS_BWRAP": value, "PATH": os.environ.get("PATH", os.defpath)}
    with pytest.raises(BadConfig) as info:
        check_bwrap_setting(env)
    assert info.value.code == "E_CONFIG" and value in info.value.message
    with capture_logs() as logs, pytest.raises(BadConfig):
        choose_arm("python", require_sandbox=False, env=env)
    assert degraded_records(logs) == []
    with pytest.raises(BadConfig):
        decide_arm("python", env)


def test_bwrap_setting_unset_or_valid_is_fine(tmp_path: Path) -> None:
    check_bwrap_setting({"PATH": str(tmp_path)})  # unset: missing bwrap is a degradation
    check_bwrap_setting({"METNOS_BWRAP": "", "PATH": str(tmp_path)})
    fake = write_fake_bwrap(tmp_path / "bwrap")
    check_bwrap_setting({"METNOS_BWRAP": str(fake)})
