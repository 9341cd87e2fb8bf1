"""The doctor's findings on this host's mechanisms: bubblewrap and the options it has,
user namespaces, seccomp, landlock, cgroups, the network wall, overlay staging and the wasm
engine and runtime, each with what it means for the containment report and its fix; and
`Finding`, what every check of the doctor returns.

Each is read through the module that uses the mechanism (`sandbox.status.status`;
`process` for cgroups; the network wall by a real bubblewrap job), never re-implemented
here; `doctor.diagnose` puts them in the report with the worker's own configuration.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from .errors import MetnosError

__all__ = ("Finding", "State")

State = Literal["ok", "weakened", "missing", "info"]


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One mechanism, as found on this machine.

    Attributes:
        check: the mechanism (``bwrap``, ``bwrap_bind_fd``, ``bwrap_disable_userns``,
            ``user_namespaces``, ``seccomp``, ``landlock``, ``cgroups``,
            ``network_wall``, ``overlay_staging``, ``wasm_engine``, ``wasm_runtime``,
            ``broker``, ``executors``, ``worker_user``, ``slot_uids``, ``trust``).
        state: ``ok``; ``weakened`` (works, with less containment); ``missing``; ``info``.
        detail: what was found.
        meaning: what it means for the containment report (or for the worker).
        fix: the exact command (or setting) that fixes it; ``None`` when nothing to do.
        required: the configuration needs it: not ``ok`` makes ``doctor`` exit non-zero.
    """

    check: str
    state: State
    detail: str
    meaning: str = ""
    fix: str | None = None
    required: bool = False


_APT_BWRAP = "apt-get install bubblewrap   # Fedora: dnf install bubblewrap"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _applied(status: Any, mechanism: str) -> tuple[bool, str]:
    """Whether the bwrap arm applies `mechanism` (``seccomp`` / ``landlock``) to every job,
    and what it is (or why not), from `status` (``bwrap_seccomp`` / ``bwrap_landlock``)."""
    field = getattr(status, f"bwrap_{mechanism}", None)
    if field is None:
        return False, "the sandbox does not report it"
    return bool(field.active), str(field.detail)


async def _network_finding(st: Any, env: Mapping[str, str]) -> Finding:
    """Which network a job with a network capability gets here: filtered by the network
    wall (probed: a real bubblewrap job with its listeners), the host network (the
    operator's setting), or none filtered (no bubblewrap: the direct arm)."""
    from .policy import Policy
    from .sandbox._types import SandboxJob, Success
    from .sandbox.bwrap import BwrapSandbox
    from .sandbox.egress import policy_for

    try:
        host_network = Policy.from_env(env).host_network
    except MetnosError:
        host_network = False
    if not st.bwrap.working or st.sandbox_off:
        return Finding(
            check="network_wall",
            state="missing",
            detail="no bubblewrap sandbox: a job's network is not filtered",
            meaning="jobs run on the direct arm, with the host network (network not_kept)",
            fix=_APT_BWRAP,
        )
    if host_network:
        return Finding(
            check="network_wall",
            state="weakened",
            detail="METNOS_HOST_NETWORK=1: jobs with a network capability get the host network",
            meaning="a network capability reaches anything the worker can (network not_kept)",
            fix="unset METNOS_HOST_NETWORK",
        )
    true = shutil.which("true", path="/usr/bin:/bin") or "/bin/true"
    job = SandboxJob(argv=(true,), network=True, egress=policy_for([("https", "probe.invalid")]))
    try:
        outcome = await BwrapSandbox().run(job)
        ok = outcome.exit == Success()
        why = "" if ok else f"the probe job ended {outcome.exit}"
    except Exception as exc:  # any failure of the probe is the finding
        ok, why = False, str(exc)
    if ok:
        return Finding(
            check="network_wall",
            state="ok",
            detail="filtered: a job's own network namespace, the worker's listeners in it",
            meaning="a network capability reaches only the hosts and ports its manifest names "
            "(network kept)",
        )
    return Finding(
        check="network_wall",
        state="missing",
        detail=f"the network wall could not be set up: {why}",
        meaning="jobs with a network capability fail (E_HOST_FAULT) until it works, or run "
        "with METNOS_HOST_NETWORK=1 on the host network (network not_kept)",
        fix="check that the worker may enter the user namespaces it creates (setns), or set "
        "METNOS_HOST_NETWORK=1",
    )


def _staging_finding(st: Any) -> Finding:
    """Overlay staging, as the staging module's own probe found it (`status`)."""
    found = str(st.overlay_staging)
    if found.startswith("available"):
        owned = (
            "; writes to folders the worker's uid does not own are not staged (backed up "
            "instead, disk unbounded: resources partial)"
            if "user namespace" in found
            else ""
        )
        return Finding(
            check="overlay_staging",
            state="ok",
            detail=found,
            meaning="a bubblewrap job's writes are staged on a tmpfs of its disk budget "
            "(disk writes bounded), committed only on success, and undoable" + owned,
        )
    fix = "run the worker on a kernel with unprivileged overlayfs (5.11+), or as root"
    if "nsenter" in found:
        fix = "apt-get install util-linux   # provides nsenter"
    return Finding(
        check="overlay_staging",
        state="weakened",
        detail=found,
        meaning="writing jobs write straight into the host folders: only their declared "
        "targets are backed up for undo, a failed job's other writes stay, and disk writes "
        "are unbounded (the resources axis says partial)",
        fix=fix,
    )


def _bwrap_feature_findings(st: Any) -> list[Finding]:
    """What the installed bubblewrap's options mean for the report (when it works)."""
    bw = st.bwrap
    if bw.path is None or not bw.working or st.sandbox_off:
        return []
    out: list[Finding] = []
    if bw.bind_fd:
        out.append(
            Finding(
                check="bwrap_bind_fd",
                state="ok",
                detail=f"bubblewrap {bw.version} binds mount sources from an fd (--bind-fd)",
                meaning="a job's folders are mounted from the fd opened without following "
                "a symlink: a folder swapped for a link is refused, never mounted",
            )
        )
    else:
        out.append(
            Finding(
                check="bwrap_bind_fd",
                state="weakened",
                detail=f"bubblewrap {bw.version} has no --bind-fd",
                meaning="folders are bound by path after the check: one swapped for a "
                "symlink in between would be mounted, so the files axis says partial",
                fix="install bubblewrap 0.10+ (or a distribution build with the --bind-fd "
                "backport, e.g. Debian 12's 0.8.0-2+deb12u1)",
            )
        )
    if bw.disable_userns:
        out.append(
            Finding(
                check="bwrap_disable_userns",
                state="ok",
                detail=f"bubblewrap {bw.version} disables nested user namespaces "
                "(--disable-userns) and sizes /tmp and /dev/shm (--size)",
                meaning="a job cannot create a user namespace of its own; its private "
                "tmpfs mounts are sized at its memory budget",
            )
        )
    else:
        out.append(
            Finding(
                check="bwrap_disable_userns",
                state="weakened",
                detail=f"bubblewrap {bw.version} has no --disable-userns and no --size (both 0.8+)",
                meaning="nested user namespaces are allowed (seccomp still refuses "
                "unshare and clone of namespaces): the user axis says partial; /tmp and "
                "/dev/shm are not sized, so without a memory cgroup they may take half "
                "the host's RAM each",
                fix="install bubblewrap 0.8+ (0.10+ for --bind-fd too)",
            )
        )
    return out


def _bwrap_findings(st: Any, env: Mapping[str, str], required: bool) -> list[Finding]:
    out: list[Finding] = []
    lost = "every axis is not_kept and results say sandbox: none"
    fix_required = (
        "" if required else " (METNOS_REQUIRE_SANDBOX=never: jobs degrade instead of refusing)"
    )
    if st.sandbox_off:
        out.append(
            Finding(
                check="bwrap",
                state="weakened",
                detail=f"METNOS_SANDBOX={env.get('METNOS_SANDBOX')} switches the kernel wall off",
                meaning=f"native jobs run on the direct arm: {lost}{fix_required}",
                fix="unset METNOS_SANDBOX",
                required=required,
            )
        )
    elif st.bwrap.path is None:
        out.append(
            Finding(
                check="bwrap",
                state="missing",
                detail="bubblewrap is not installed (not on PATH, METNOS_BWRAP unset)",
                meaning=f"native jobs run on the direct arm: {lost}{fix_required}",
                fix=_APT_BWRAP,
                required=required,
            )
        )
    elif not st.bwrap.working:
        out.append(
            Finding(
                check="bwrap",
                state="missing",
                detail=f"bubblewrap {st.bwrap.version} at {st.bwrap.path} cannot build the "
                f"sandbox here: {st.bwrap.error}",
                meaning=f"native jobs run on the direct arm: {lost}{fix_required}",
                fix="enable user namespaces (see user_namespaces), or run in a container "
                "that allows them",
                required=required,
            )
        )
    else:
        out.append(
            Finding(
                check="bwrap",
                state="ok",
                detail=f"bubblewrap {st.bwrap.version} at {st.bwrap.path} builds the sandbox",
                meaning="native jobs run in their own namespaces (files, network, process "
                "tree walls)",
                required=required,
            )
        )
    if st.user_namespaces:
        out.append(Finding(check="user_namespaces", state="ok", detail="unprivileged allowed"))
    else:
        fix = "sysctl -w user.max_user_namespaces=15000"
        if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
            fix = "sysctl -w kernel.unprivileged_userns_clone=1"
        out.append(
            Finding(
                check="user_namespaces",
                state="missing",
                detail="the kernel refuses new user namespaces to this user",
                meaning=f"bubblewrap cannot build the sandbox: {lost}",
                fix=fix,
                required=required,
            )
        )
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1" and os.geteuid():
        out.append(
            Finding(
                check="user_namespaces",
                state="weakened",
                detail="AppArmor restricts unprivileged user namespaces",
                meaning="bubblewrap may be refused capabilities inside its namespace",
                fix="sysctl -w kernel.apparmor_restrict_unprivileged_userns=0   # or an "
                "AppArmor profile for bwrap",
            )
        )
    return out


def _filter_findings(st: Any) -> list[Finding]:
    out: list[Finding] = []
    applied, what = _applied(st, "seccomp")
    if not st.seccomp:
        out.append(
            Finding(
                check="seccomp",
                state="missing",
                detail="the kernel has no seccomp filters",
                meaning="a job may use every system call its namespaces allow (a Unix socket "
                "in a mounted folder is reachable, the worker's keyrings are shared): the "
                "network and user axes say partial",
                fix="boot a kernel built with CONFIG_SECCOMP_FILTER=y",
            )
        )
    else:
        out.append(
            Finding(
                check="seccomp",
                state="ok" if applied else "weakened",
                detail=what,
                meaning="system calls are filtered (no Unix sockets, keyrings, setuid bits, "
                "new namespaces, mounts, io_uring, ...)"
                if applied
                else "a job may use every system call its namespaces allow (a Unix socket "
                "in a mounted folder is reachable, the worker's keyrings are shared): the "
                "network and user axes say partial",
                fix=None
                if applied
                else "run workers on x86_64 or aarch64 with a kernel offering the seccomp "
                "actions kill_process and errno (Linux >= 4.14)",
            )
        )
    abi = st.landlock_abi
    applied, what = _applied(st, "landlock")
    if abi is None:
        out.append(
            Finding(
                check="landlock",
                state="missing",
                detail=f"landlock is not available: {st.landlock_error}",
                meaning="no second file wall inside the sandbox (the mounts remain the wall)",
                fix="add landlock to the kernel's lsm= boot parameter (e.g. "
                "lsm=landlock,lockdown,yama,integrity,apparmor,bpf) and reboot",
            )
        )
    else:
        out.append(
            Finding(
                check="landlock",
                state="ok" if applied else "weakened",
                detail=what,
                meaning="file access is limited inside the sandbox too"
                if applied
                else "no second file wall inside the sandbox (the mounts remain the wall)",
                fix=None
                if applied
                else "install a Python the sandbox can run at /usr/bin/python3, or run the "
                "worker with an interpreter outside a private home",
            )
        )
    return out


def _own_memory_cgroup() -> str:
    """This process's cgroup v1 memory cgroup (``/`` when unknown): where a worker
    started from here makes its ``metnos`` memory cgroup (`process.cgroups._memory_parent`)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and "memory" in parts[1].split(","):
                return parts[2].strip() or "/"
    except OSError:
        pass
    return "/"


def _cgroup_findings(*, v1: bool | None = None) -> list[Finding]:
    """Per-job pids and memory cgroups, with the setup the code really uses.

    Args:
        v1: the cgroup version to advise for (default: this host's).
    """
    from . import process

    if v1 is None:
        v1 = Path("/sys/fs/cgroup/pids/cgroup.procs").exists()
    version = "v1" if v1 else "v2"
    pids, memory = process.pids_cgroup_available(), process.memory_cgroup_available()
    if pids and (memory or not v1):
        return [
            Finding(
                check="cgroups",
                state="ok",
                detail=f"cgroup {version}: per-job pids"
                + (" and memory" if memory else "")
                + " cgroups can be created",
                meaning="each job's process and memory budgets hold for its whole tree",
            )
        ]
    user = _user_name()
    if v1:
        # Where `process` looks: the pids hierarchy's top-level `metnos`, and a `metnos`
        # under the worker's own memory cgroup (this shell's, if the worker starts here).
        mem = "/sys/fs/cgroup/memory" + _own_memory_cgroup().rstrip("/") + "/metnos"
        fix = (
            f"mkdir -p /sys/fs/cgroup/pids/metnos {mem} && chown -R {user} "
            f"/sys/fs/cgroup/pids/metnos {mem}   # as root (the memory one under the "
            "worker's own memory cgroup); or run the worker as root"
        )
    else:
        # The code makes per-job cgroups under /sys/fs/cgroup/metnos and moves each job
        # there, which needs write access to the root cgroup's cgroup.procs: a delegated
        # systemd scope is not used by this version.
        fix = (
            "run the worker as root (per-job cgroups under /sys/fs/cgroup/metnos need the "
            "root cgroup; a delegated systemd scope is not used)"
        )
    missing = [n for n, ok in (("pids", pids), ("memory", memory)) if not ok]
    return [
        Finding(
            check="cgroups",
            state="weakened",
            detail=f"cgroup {version}: this user cannot create {' and '.join(missing)} "
            "cgroups (not delegated)",
            meaning="the process limit falls back to RLIMIT_NPROC (per user) and memory to "
            "RLIMIT_AS (per process, not per job): the resources axis says partial",
            fix=fix,
        )
    ]


def _wasm_findings(st: Any, runtimes: set[str]) -> list[Finding]:
    wasm = st.wasm
    out: list[Finding] = []
    if "error" in wasm:
        engine_ok, version = False, None
    else:
        engine_ok, version = wasm["engine"]["importable"], wasm["engine"]["version"]
    needs_engine = bool(runtimes & {"wasm", "wasm-python"})
    out.append(
        Finding(
            check="wasm_engine",
            state="ok" if engine_ok else "missing",
            detail=f"wasmtime {version}" if engine_ok else "wasmtime is not installed",
            meaning="wasm executors run under fuel and a store memory limit"
            if engine_ok
            else "wasm and wasm-python executors are refused with E_TOOL_UNAVAILABLE",
            fix=None if engine_ok else "pip install 'metnos-exec[wasm]'",
            required=needs_engine,
        )
    )
    rt = wasm.get("python_runtime", {}) if engine_ok else {}
    verified = bool(rt.get("verified"))
    if verified:
        detail = f"python.wasm at {rt.get('path')} ({rt.get('source')}), SHA-256 matches the pin"
    elif rt.get("present"):
        detail = f"python.wasm at {rt.get('path')} does NOT match the pinned SHA-256"
    else:
        detail = f"no CPython-WASI runtime: {rt.get('error') or 'wasm engine missing'}"
    out.append(
        Finding(
            check="wasm_runtime",
            state="ok" if verified else "missing",
            detail=detail,
            meaning="wasm-python executors can run"
            if verified
            else "wasm-python executors are refused (E_TOOL_UNAVAILABLE or E_RUNTIME_MISMATCH)",
            fix=None
            if verified
            else "pip install 'metnos-exec[wasm-python]'   # or export "
            "METNOS_PYTHON_WASM_URL=<a mirror of python-3.12.0.wasm> (fetched at worker start)",
            required="wasm-python" in runtimes,
        )
    )
    return out


def _user_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())
