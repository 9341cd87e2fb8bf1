"""``metnos-exec doctor``: what this machine gives the worker, what is missing, how to fix it.

`status` says what the sandbox can do; the doctor says what that *means*: each finding
names a mechanism, what was found, what it means for the containment report a job will
carry, and the exact command that fixes it. A finding is ``required`` when the
configuration cannot work without it (``METNOS_REQUIRE_SANDBOX`` other than ``never``
needs the kernel wall; a device worker needs a trust key and the device extra; a worker
needs its broker; executors of a runtime need its engine): the command exits non-zero
when a required finding is not ``ok``.

Every probe is read from the host through the modules that use the mechanism
(`sandbox.status.status` for bubblewrap, user namespaces, seccomp, landlock and the wasm
runtime, and whether the bwrap arm applies its seccomp filter and landlock; `process` for
cgroups; the broker itself), never re-implemented here. Overlay staging is built by
parallel work not yet in this tree: `_staging_probe` is the one place it is decided, to
switch to the staging module's status once that lands.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from .errors import MetnosError

__all__ = ("DoctorReport", "Finding", "diagnose")

State = Literal["ok", "weakened", "missing", "info"]


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One mechanism, as found on this machine.

    Attributes:
        check: the mechanism (``bwrap``, ``user_namespaces``, ``seccomp``, ``landlock``,
            ``cgroups``, ``overlay_staging``, ``wasm_engine``, ``wasm_runtime``,
            ``broker``, ``worker_user``, ``trust``).
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


class DoctorReport(msgspec.Struct, frozen=True, kw_only=True):
    """All findings; `healthy` when every required one is ``ok``."""

    findings: tuple[Finding, ...]
    healthy: bool
    user: str
    uid: int


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


def _staging_probe() -> tuple[bool, str]:
    """Can an overlay be mounted in a user and mount namespace of our own (``userxattr``)?

    Probed with util-linux ``unshare`` on a throw-away tree. Switch to the staging
    module's own status when it lands.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return False, "util-linux `unshare` not found, so overlay staging could not be probed"
    with tempfile.TemporaryDirectory(prefix="metnos-doctor-") as tmp:
        for name in ("lower", "upper", "work", "merged"):
            os.mkdir(os.path.join(tmp, name))
        opts = f"lowerdir={tmp}/lower,upperdir={tmp}/upper,workdir={tmp}/work,userxattr"
        argv = [unshare, "--user", "--map-root-user", "--mount", "--"]
        argv += ["mount", "-t", "overlay", "overlay", "-o", opts, f"{tmp}/merged"]
        try:
            run = subprocess.run(
                argv,
                capture_output=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"probe failed: {exc}"
    if run.returncode != 0:
        return False, run.stderr.decode(errors="replace").strip()[-300:] or "mount failed"
    return True, "an overlay mounts in a user and mount namespace of our own (userxattr)"


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


def _cgroup_findings() -> list[Finding]:
    from .process import memory_cgroup_available, pids_cgroup_available

    v1 = Path("/sys/fs/cgroup/pids/cgroup.procs").exists()
    version = "v1" if v1 else "v2"
    pids, memory = pids_cgroup_available(), memory_cgroup_available()
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
        fix = (
            f"mkdir -p /sys/fs/cgroup/pids/metnos && chown -R {user} /sys/fs/cgroup/pids/metnos"
            "   # and the same for a metnos folder under the worker's memory cgroup; "
            "or run the worker as root"
        )
    else:
        fix = (
            "systemd-run --user --scope -p Delegate=yes metnos-exec worker ...   "
            "# a delegated cgroup v2 subtree"
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


async def _broker_finding(url: str) -> Finding:
    from .brokers import open_broker

    scheme = url.partition(":")[0]
    missing = _missing_sqlite_file(url) if scheme == "sqlite" else None
    if missing is not None:
        return Finding(
            check="broker",
            state="info",
            detail=f"{url}: no queue file yet ({missing})",
            meaning="the first `metnos-exec worker` or `submit` creates it",
            fix=f"metnos-exec worker --broker {url} --executors DIR   # creates it",
        )
    try:
        broker = open_broker(url, create=False)
        async with broker:
            stats = await broker.stats()
    except (MetnosError, OSError, ValueError) as exc:
        fix = (
            "redis-server --port PORT   # or check host, port and password in the URL"
            if scheme.startswith("redis")
            else "check the URL (an absolute SQLite path takes four slashes) and the file's "
            "permissions"
        )
        return Finding(
            check="broker",
            state="missing",
            detail=f"{url}: {exc}",
            meaning="a worker cannot lease jobs and a producer cannot submit",
            fix=fix,
            required=True,
        )
    return Finding(
        check="broker",
        state="ok",
        detail=f"{url}: reachable ({stats.queued} queued, {stats.running} running)",
        required=True,
    )


def _missing_sqlite_file(url: str) -> str | None:
    """The absolute path of a SQLite queue file that does not exist yet, else ``None``."""
    from urllib.parse import urlsplit

    path = urlsplit(url).path[1:]
    if path and not os.path.exists(path):
        return os.path.abspath(path)
    return None


def _user_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _user_finding() -> Finding:
    from .sandbox.bwrap import worker_is_root

    if worker_is_root():
        return Finding(
            check="worker_user",
            state="weakened",
            detail="the worker runs as root",
            meaning="bubblewrap jobs are host root for file permissions: the files and user "
            "axes say partial",
            fix="useradd --system --create-home metnos && runuser -u metnos -- "
            "metnos-exec worker ...",
        )
    return Finding(
        check="worker_user",
        state="ok",
        detail=f"the worker runs as {_user_name()} (uid {os.geteuid()})",
        meaning="jobs cannot use root's file permissions",
    )


def _trust_finding(device: str, trust_keys: Sequence[str], env: Mapping[str, str]) -> Finding:
    from .messages import SERVER_DEVICE
    from .signing import TRUST_KEYS_ENV, load_trust_keys

    device_worker = device != SERVER_DEVICE
    try:
        keys = load_trust_keys(tuple(trust_keys), env)
    except MetnosError as exc:
        return Finding(
            check="trust",
            state="missing",
            detail=exc.message,
            meaning="executor signatures cannot be verified",
            fix="pip install 'metnos-exec[device]'   # and check each --trust-key",
            required=device_worker or bool(trust_keys),
        )
    if keys:
        return Finding(
            check="trust",
            state="ok",
            detail=f"{len(keys)} trusted key(s): {', '.join(k.id for k in keys)}",
            meaning="unsigned or altered executors are refused (E_SIGNATURE)",
            required=device_worker,
        )
    if device_worker:
        return Finding(
            check="trust",
            state="missing",
            detail=f"device worker {device!r} without a trust key",
            meaning="the worker refuses to start: it must verify every executor it runs",
            fix="metnos-exec keygen --out server.key   # on the server; then here: "
            f"--trust-key server.key.pub (or {TRUST_KEYS_ENV})",
            required=True,
        )
    return Finding(
        check="trust",
        state="info",
        detail="no trust key: executors are not signature-checked (a server worker)",
        meaning="the executors folder is trusted as it is",
        fix="metnos-exec worker --trust-key KEY.pub ...   # to verify signatures here too",
    )


async def diagnose(
    env: Mapping[str, str] | None = None,
    *,
    broker_url: str | None = None,
    executors: str | os.PathLike[str] | None = None,
    device: str = "server",
    trust_keys: Sequence[str] = (),
) -> DoctorReport:
    """Check this machine for what a worker with this configuration needs.

    Args:
        env: where ``METNOS_*`` settings are read (default `os.environ`).
        broker_url: the broker to reach (``None``: not checked).
        executors: an executors folder: its runtimes decide which engines are required.
        device: the worker's device id (a device worker requires a trust key).
        trust_keys: the worker's ``--trust-key`` values.
    """
    from .manifest import ExecutorRegistry
    from .policy import Policy
    from .sandbox.status import status

    env = os.environ if env is None else env
    config_error: str | None = None
    try:
        st = status(env)
    except MetnosError as exc:  # METNOS_BWRAP naming no executable
        config_error = str(exc)
        st = status({**env, "METNOS_BWRAP": ""})
    try:
        required_wall = Policy.from_env(env).require_sandbox != "never"
    except MetnosError:
        required_wall = True
    runtimes: set[str] = set()
    if executors is not None:
        try:
            registry = ExecutorRegistry.load(executors)
            runtimes = {registry[n].manifest.runtime for n in registry}
        except MetnosError:
            runtimes = set()
    findings = [
        *_bwrap_findings(st, env, required_wall),
        *_filter_findings(st),
        *_cgroup_findings(),
    ]
    if config_error is not None:
        findings.insert(
            0,
            Finding(
                check="bwrap",
                state="missing",
                detail=config_error,
                meaning="a worker refuses to start (E_CONFIG)",
                fix="unset METNOS_BWRAP, or point it at the bubblewrap binary",
                required=True,
            ),
        )
    staging, why = _staging_probe()
    findings.append(
        Finding(
            check="overlay_staging",
            state="info" if staging else "weakened",
            detail=why
            + ("; this version of metnos-exec does not stage writes yet" if staging else ""),
            meaning="writes go straight to the user's files (no staged commit, no undo yet)",
            fix=None
            if staging
            else "run the worker as the owner of the writable folders, on a kernel with "
            "unprivileged overlayfs (5.11+)",
        )
    )
    findings.extend(_wasm_findings(st, runtimes))
    if broker_url is not None:
        findings.append(await _broker_finding(broker_url))
    findings.append(_user_finding())
    findings.append(_trust_finding(device, trust_keys, env))
    healthy = all(f.state == "ok" for f in findings if f.required)
    return DoctorReport(
        findings=tuple(findings), healthy=healthy, user=_user_name(), uid=os.geteuid()
    )
