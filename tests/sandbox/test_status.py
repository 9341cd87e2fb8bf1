"""`status()` is well-formed and matches what the host really offers."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import msgspec
import pytest

from metnos_exec.sandbox.bwrap import bwrap_probe, forget_probes
from metnos_exec.sandbox.status import RUNTIMES, SandboxStatus, status
from tests.conftest import need


def test_status_is_well_formed_and_round_trips() -> None:
    st = status()
    back = msgspec.json.decode(msgspec.json.encode(st), type=SandboxStatus)
    assert back == st
    assert set(st.arms) == set(RUNTIMES)
    assert st.overlay_staging.startswith(("available", "unavailable: "))


def test_status_matches_bwrap_reality() -> None:
    need(shutil.which("bwrap") is not None, "bubblewrap not installed")
    st = status()
    found = shutil.which("bwrap")
    assert st.bwrap.path is not None and found is not None
    assert os.path.samefile(st.bwrap.path, found)
    assert st.bwrap.working is bwrap_probe().working
    if st.bwrap.working and not st.sandbox_off:
        assert st.arms["python"] == "bwrap" and "python" not in st.degraded
    assert st.bwrap.version is not None and st.bwrap.version[0].isdigit()
    # What the files and user axes depend on: read from the same probe.
    features = bwrap_probe().features
    assert st.bwrap.bind_fd is features.bind_fd
    assert st.bwrap.disable_userns is features.disable_userns
    assert st.bwrap.tmpfs_size is features.tmpfs_size


def test_status_reports_degradation_without_bwrap(tmp_path: Path) -> None:
    forget_probes()
    st = status({"PATH": str(tmp_path)})
    assert st.bwrap.path is None and st.bwrap.working is False
    assert st.arms["python"] == "none"
    assert st.degraded == {"python": "bwrap_missing"}
    off = status({"METNOS_SANDBOX": "off", "PATH": os.environ.get("PATH", "")})
    assert off.sandbox_off and off.degraded == {"python": "sandbox_off"}


def test_status_kernel_features_match_the_kernel() -> None:
    actions = Path("/proc/sys/kernel/seccomp/actions_avail")
    st = status()
    if actions.exists():
        assert st.seccomp and st.seccomp_actions == tuple(actions.read_text().split())
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, ctypes.c_size_t(0), 1)
    assert st.landlock_abi == (abi if abi > 0 else None)
    max_ns = Path("/proc/sys/user/max_user_namespaces").read_text().strip()
    if os.geteuid() == 0:  # the unprivileged_userns_clone sysctl does not bind root
        assert st.user_namespaces is (int(max_ns) > 0)


def test_status_wasm_section_present() -> None:
    st = status()
    assert "engine" in st.wasm or "error" in st.wasm
    if "engine" in st.wasm:
        assert isinstance(st.wasm["engine"]["importable"], bool)
        assert st.arms["wasm"] == "wasm"


def test_status_warns_when_the_worker_runs_as_root(monkeypatch: pytest.MonkeyPatch) -> None:

    from metnos_exec.identities import SLOT_UIDS_ENV
    from metnos_exec.sandbox import _bwrap_report as bwrap_mod

    monkeypatch.setattr(bwrap_mod, "worker_is_root", lambda: True)
    monkeypatch.setenv(SLOT_UIDS_ENV, "off")
    warning = status().worker_as_root
    assert warning is not None and "as host root" in warning and "readable" in warning
    if os.geteuid() == 0:  # the reason names the setting (else: "not root" itself)
        assert f"{SLOT_UIDS_ENV}=off" in warning
    if os.geteuid() == 0 and bwrap_mod.slots_available():
        monkeypatch.delenv(SLOT_UIDS_ENV)
        note = status().worker_as_root
        assert note is not None and "dedicated host uid" in note, note
    monkeypatch.setattr(bwrap_mod, "worker_is_root", lambda: False)
    assert status().worker_as_root is None


def test_status_says_whether_the_bwrap_arm_filters_and_landlocks() -> None:
    from metnos_exec.sandbox.hardening import host_hardening
    from metnos_exec.sandbox.seccomp import native_arch

    st = status()
    hard = host_hardening()
    assert st.bwrap_seccomp is not None and st.bwrap_landlock is not None
    assert st.bwrap_seccomp.active is hard.seccomp_active
    assert st.bwrap_landlock.active is hard.landlock_active
    # What the kernel offers decides it: the filter where seccomp filters and our
    # architecture exist, landlock where the kernel has an ABI.
    if st.seccomp and "kill_process" in st.seccomp_actions and native_arch() is not None:
        assert st.bwrap_seccomp.active and native_arch() in st.bwrap_seccomp.detail
    if st.landlock_abi is not None:
        assert st.bwrap_landlock.active
        assert st.bwrap_landlock.detail == f"landlock ABI {st.landlock_abi}"


def test_status_says_why_a_mechanism_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from metnos_exec.sandbox import status as status_mod
    from metnos_exec.sandbox.hardening import Hardening

    off = Hardening(
        seccomp_arch=None,
        seccomp="no seccomp policy for this architecture (riscv64)",
        landlock_abi=None,
        landlock="landlock unavailable (landlock_create_ruleset: Operation not supported)",
    )
    monkeypatch.setattr(status_mod, "host_hardening", lambda: off)
    st = status()
    assert st.bwrap_seccomp == status_mod.MechanismStatus(False, off.seccomp)
    assert st.bwrap_landlock == status_mod.MechanismStatus(False, off.landlock)
