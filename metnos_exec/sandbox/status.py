"""`status()`: what the sandbox can do on this host, without running a job.

Every field is read from the host (files under ``/proc``, a syscall, the cached bubblewrap
probe, the wasm arm's own report); a component that cannot be read says ``None`` /
``"unknown"`` with the reason, it is never reported as present by default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from ._bwrap_probe import bwrap_probe
from ._bwrap_report import root_worker_note
from .hardening import host_hardening
from .landlock import landlock_abi
from .select import SANDBOX_OFF_VALUES, Decision, decide_arm
from .staging_probe import probe_staging

__all__ = (
    "RUNTIMES",
    "BwrapStatus",
    "MechanismStatus",
    "SandboxStatus",
    "landlock_abi",
    "status",
)

#: Runtimes whose arm `status` reports.
RUNTIMES: tuple[str, ...] = ("python", "wasm", "wasm-python")


class BwrapStatus(msgspec.Struct, frozen=True):
    """The bubblewrap the bwrap arm would run.

    Attributes:
        path, version, working, error: from the probe (`bwrap.BwrapProbe`).
        bind_fd: it binds mount sources from an fd (``--bind-fd``): without it a folder
            swapped for a symlink between the check and the mount would be mounted, and
            the files axis says ``partial``.
        disable_userns: it refuses nested user namespaces (``--disable-userns``, 0.8+):
            without it the user axis says ``partial``.
        tmpfs_size: it sizes /tmp and /dev/shm at the memory budget (``--size``, 0.8+).
    """

    path: str | None
    version: str | None
    working: bool
    error: str | None = None
    bind_fd: bool = False
    disable_userns: bool = False
    tmpfs_size: bool = False


class MechanismStatus(msgspec.Struct, frozen=True):
    """A kernel mechanism the bwrap arm adds to every job.

    Attributes:
        active: the arm applies it to every job on this host.
        detail: what it is (the filter's architecture and size, the landlock ABI), or why
            it is not applied.
    """

    active: bool
    detail: str


class SandboxStatus(msgspec.Struct, frozen=True):
    """The sandbox's view of this host.

    Attributes:
        bwrap: bubblewrap found, its version, and whether our namespaces can be built.
        user_namespaces: the kernel lets new user namespaces be created
            (``user.max_user_namespaces > 0`` and, where the sysctl exists,
            ``kernel.unprivileged_userns_clone`` for non-root).
        wasm: the wasm arm's own report (engine importable + version, CPython-WASI
            runtime present and hash-verified), or ``{"error": ...}``.
        landlock_abi: the kernel's landlock ABI version, ``None`` when unsupported.
        landlock_error: why it is ``None``.
        seccomp: seccomp filters are available.
        seccomp_actions: the filter actions the kernel supports.
        overlay_staging: copy-on-write staging of jobs' writes: ``available`` (a probe
            overlay was mounted and written through), with the unprivileged caveat, or
            ``unavailable: <reason>`` (writing jobs then back up their declared targets).
        sandbox_off: ``METNOS_SANDBOX`` switches the kernel wall off.
        arms: runtime → arm it would use now (``bwrap``, ``none``, ``wasm``, ``absent``).
        degraded: runtime → degradation reason, for the runtimes that would degrade.
        worker_as_root: for a root worker, what its bwrap jobs run as: dedicated slot
            uids, or root (host root for file permissions: the files and user axes are
            ``partial``) and why; ``None`` otherwise.
        bwrap_seccomp: whether the bwrap arm loads its seccomp filter into every job
            (``seccomp`` above only says the kernel has seccomp).
        bwrap_landlock: whether the bwrap arm landlocks every job, and the ABI.
    """

    bwrap: BwrapStatus
    user_namespaces: bool
    wasm: dict[str, Any]
    landlock_abi: int | None
    seccomp: bool
    seccomp_actions: tuple[str, ...]
    overlay_staging: str
    sandbox_off: bool
    arms: dict[str, str]
    degraded: dict[str, str]
    landlock_error: str | None = None
    worker_as_root: str | None = None
    bwrap_seccomp: MechanismStatus | None = None
    bwrap_landlock: MechanismStatus | None = None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _user_namespaces() -> bool:
    max_ns = _read("/proc/sys/user/max_user_namespaces")
    if max_ns is None or not max_ns.isdigit() or int(max_ns) == 0:
        return False
    clone = _read("/proc/sys/kernel/unprivileged_userns_clone")  # Debian/Ubuntu only
    return not (clone == "0" and os.geteuid() != 0)


def _seccomp() -> tuple[bool, tuple[str, ...]]:
    actions = _read("/proc/sys/kernel/seccomp/actions_avail")
    if actions is not None:
        return True, tuple(actions.split())
    # Older kernels: the Seccomp line exists in /proc/self/status when it is built in.
    st = _read("/proc/self/status") or ""
    return any(line.startswith("Seccomp:") for line in st.splitlines()), ()


def _wasm_report(env: Mapping[str, str]) -> dict[str, Any]:
    try:
        from .wasm import wasm_status
    except (ImportError, AttributeError) as exc:
        return {"error": f"wasm arm not importable: {exc}"}
    try:
        report = wasm_status(env)
    except Exception as exc:
        return {"error": f"wasm_status failed: {exc!r}"}
    return report if isinstance(report, dict) else msgspec.to_builtins(report)


def _overlay_staging() -> str:
    try:
        return probe_staging()
    except Exception as exc:  # a probe must never break `status`
        return f"unavailable: probe failed: {type(exc).__name__}: {exc}"


def status(env: Mapping[str, str] | None = None) -> SandboxStatus:
    """Report what each arm can do here; runs no job (only the cached bubblewrap probe).

    Args:
        env: where ``METNOS_*`` and ``PATH`` are read; default `os.environ`.
    """
    env = os.environ if env is None else env
    probe = bwrap_probe(env)
    abi, abi_error = landlock_abi()
    seccomp, actions = _seccomp()
    decisions: dict[str, Decision] = {rt: decide_arm(rt, env) for rt in RUNTIMES}
    hardening = host_hardening()
    return SandboxStatus(
        bwrap=BwrapStatus(
            path=probe.path,
            version=".".join(map(str, probe.version)) or None,
            working=probe.working,
            error=probe.error,
            bind_fd=probe.features.bind_fd,
            disable_userns=probe.features.disable_userns,
            tmpfs_size=probe.features.tmpfs_size,
        ),
        user_namespaces=_user_namespaces(),
        wasm=_wasm_report(env),
        landlock_abi=abi,
        landlock_error=abi_error,
        seccomp=seccomp,
        seccomp_actions=actions,
        overlay_staging=_overlay_staging(),
        sandbox_off=env.get("METNOS_SANDBOX", "").strip().lower() in SANDBOX_OFF_VALUES,
        arms={rt: d.arm for rt, d in decisions.items()},
        degraded={rt: d.degraded.reason for rt, d in decisions.items() if d.degraded},
        worker_as_root=root_worker_note(),
        bwrap_seccomp=MechanismStatus(hardening.seccomp_active, hardening.seccomp),
        bwrap_landlock=MechanismStatus(hardening.landlock_active, hardening.landlock),
    )
