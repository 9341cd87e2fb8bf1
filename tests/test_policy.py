"""The autonomy table and the degradation policy."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from metnos_exec.capabilities import effective_capabilities
from metnos_exec.errors import AutonomyDenied, BadConfig, MetnosError
from metnos_exec.manifest import Manifest
from metnos_exec.policy import DEFAULT_AUTONOMY, PROFILES, Policy, profile_for, require_sandbox


def mk(caps: list[dict[str, Any]]) -> Manifest:
    return msgspec.convert(
        {
            "name": "t",
            "version": "1",
            "runtime": "python",
            "entry": "main.py",
            "args": {"mode": {"enum": ["a", "b"], "default": "a"}},
            "capabilities": caps,
        },
        Manifest,
    )


def test_autonomy_table() -> None:
    assert DEFAULT_AUTONOMY == "supervised"
    ro, sup, full = (profile_for(x) for x in ("read_only", "supervised", "full"))
    assert (ro.force_read_only_mounts, ro.refuse_mutating, ro.allow_network_override) == (
        True,
        True,
        False,
    )
    assert (sup.force_read_only_mounts, sup.refuse_mutating, sup.allow_network_override) == (
        False,
        False,
        False,
    )
    assert (full.force_read_only_mounts, full.refuse_mutating, full.allow_network_override) == (
        False,
        False,
        True,
    )
    assert set(PROFILES) == {"read_only", "supervised", "full"}


@pytest.mark.parametrize("level", ["", "FULL", "admin", "readonly"])
def test_unknown_level_is_refused_not_defaulted(level: str) -> None:
    with pytest.raises(AutonomyDenied, match="unknown autonomy level") as ei:
        profile_for(level)
    assert ei.value.code == "E_AUTONOMY"


def test_policy_from_env() -> None:
    assert Policy.from_env({}).require_sandbox == "fs_write"
    assert Policy.from_env({"METNOS_REQUIRE_SANDBOX": ""}).require_sandbox == "fs_write"
    assert Policy.from_env({"METNOS_REQUIRE_SANDBOX": " Always "}).require_sandbox == "always"
    assert Policy.from_env({"METNOS_REQUIRE_SANDBOX": "never"}).require_sandbox == "never"
    with pytest.raises(BadConfig, match="METNOS_REQUIRE_SANDBOX='sometimes'"):
        Policy.from_env({"METNOS_REQUIRE_SANDBOX": "sometimes"})


def test_bad_require_sandbox_is_a_config_error() -> None:
    # A MetnosError with its own code, so a worker can refuse to start with the message.
    with pytest.raises(BadConfig) as ei:
        Policy.from_env({"METNOS_REQUIRE_SANDBOX": "sometimes"})
    assert isinstance(ei.value, MetnosError)
    assert ei.value.code == "E_CONFIG"
    assert "fs_write, always, never" in ei.value.message


WRITE = {"name": "fs:write", "hints": ["~/notes/**"]}
WRITE_WHEN_B = {**WRITE, "when": {"arg": "mode", "values": ["b"]}}
READ = {"name": "fs:read", "hints": ["~/notes/**"]}


@pytest.mark.parametrize(
    ("setting", "caps", "mode", "required"),
    [
        ("fs_write", [WRITE], "a", True),
        ("fs_write", [READ], "a", False),
        ("fs_write", [WRITE_WHEN_B], "a", False),  # only *active* fs:write counts
        ("fs_write", [WRITE_WHEN_B], "b", True),
        ("always", [READ], "a", True),
        ("always", [], "a", True),
        ("never", [WRITE], "a", False),
    ],
)
def test_sandbox_required(
    setting: str, caps: list[dict[str, Any]], mode: str, required: bool
) -> None:
    m = mk(caps)
    eff = effective_capabilities(m, {"mode": mode})
    policy = Policy.from_env({"METNOS_REQUIRE_SANDBOX": setting})
    assert policy.sandbox_required(m, eff) is required


def test_require_sandbox_reads_env_when_no_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    m = mk([READ])
    eff = effective_capabilities(m, {"mode": "a"})
    monkeypatch.setenv("METNOS_REQUIRE_SANDBOX", "always")
    assert require_sandbox(m, eff) is True
    assert require_sandbox(m, eff, Policy()) is False
