"""``metnos-exec doctor``: what this machine gives the worker, what is missing, how to fix it.

`status` says what the sandbox can do; the doctor says what that *means*: each finding
names a mechanism, what was found, what it means for the containment report a job will
carry, and the exact command that fixes it. A finding is ``required`` when the
configuration cannot work without it (``METNOS_REQUIRE_SANDBOX`` other than ``never``
needs the kernel wall; a device worker needs a trust key and the device extra; a worker
needs its broker; executors of a runtime need its engine): the command exits non-zero
when a required finding is not ``ok``.

Every probe is read from the host through the modules that use the mechanism
(`sandbox.status.status` for bubblewrap and its ``--bind-fd`` and ``--disable-userns``,
user namespaces, seccomp, landlock, overlay staging (`sandbox.staging_probe.probe_staging`) and
the wasm runtime, whether the bwrap arm applies its seccomp filter and landlock, and what
a root worker's jobs run as; `process` for cgroups; the broker itself), never
re-implemented here.

The findings on the host's mechanisms (bubblewrap to the wasm runtime) are made in
`doctor_host`; this module adds the worker's own configuration (its broker, executors,
user, slot uids and trust keys) and makes the report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from .doctor_host import (
    Finding,
    _bwrap_feature_findings,
    _bwrap_findings,
    _cgroup_findings,
    _filter_findings,
    _network_finding,
    _staging_finding,
    _user_name,
    _wasm_findings,
)
from .errors import MetnosError

if TYPE_CHECKING:
    from .manifest import ExecutorRegistry

__all__ = ("DoctorReport", "Finding", "diagnose")


class DoctorReport(msgspec.Struct, frozen=True, kw_only=True):
    """All findings; `healthy` when every required one is ``ok``."""

    findings: tuple[Finding, ...]
    healthy: bool
    user: str
    uid: int


_APPENDONLY = (
    "redis-cli CONFIG SET appendonly yes, and in its configuration: appendonly yes, "
    "appendfsync everysec (queue/redis.conf has both)"
)


async def _broker_findings(given: str) -> list[Finding]:
    """The broker: reachable (required), durable, its data lost lately, open to all."""
    from .brokers import BadBrokerURL, open_broker, redact_url

    url = redact_url(given)  # what is shown: never the password
    scheme = url.partition(":")[0]
    try:
        open_broker(given, create=False)  # the URL read; the store is judged below
    except BadBrokerURL as exc:
        return [_unusable_broker_finding(url, exc)]
    except (MetnosError, OSError):
        pass
    missing = _missing_sqlite_file(url) if scheme == "sqlite" else None
    if missing is not None:
        return [
            Finding(
                check="broker",
                state="info",
                detail=f"{url}: no queue file yet ({missing})",
                meaning="the first `metnos-exec worker` or `submit` creates it",
                fix=f"metnos-exec worker --broker {url} --executors DIR   # creates it",
            )
        ]
    try:
        broker = open_broker(given, create=False)
        async with broker:
            stats = await broker.stats()
            weak = await broker.durability()
            losses = await broker.data_lost()
            open_to_all = await broker.open_access()
    except (MetnosError, OSError, ValueError) as exc:
        return [_unusable_broker_finding(url, exc)]
    reach = f"{url}: reachable ({stats.queued} queued, {stats.running} running)"
    found = [
        Finding(
            check="broker",
            state="weakened",
            detail=f"{reach}; {weak}",
            meaning="a job a producer was told is queued, or its result, may be lost",
            fix=_APPENDONLY,
        )
        if weak is not None
        else Finding(check="broker", state="ok", detail=reach, required=True)
    ]
    if losses:
        latest = losses[0]
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(latest.at))
        found.append(
            Finding(
                check="broker_data",
                state="weakened",
                detail=f"{url}: its data were lost {len(losses)} time(s) this week; the "
                f"last, found at {when}: {latest.detail}",
                meaning="jobs producers were told are queued, and results workers stored, "
                "are gone: their results will never come (submit them again)",
                fix=f"{_APPENDONLY}; the record goes after a week (or: redis-cli DEL "
                "'{PREFIX}:lost')",
            )
        )
    if open_to_all is not None:
        found.append(_open_broker_finding(open_to_all))
    return found


def _unusable_broker_finding(url: str, exc: Exception) -> Finding:
    from .errors import BrokerAuth

    scheme = url.partition(":")[0]
    if isinstance(exc, MetnosError) and exc.code == "E_BAD_BROKER_URL":
        fix = "correct the URL (metnos-exec worker --help shows its forms)"
    elif isinstance(exc, BrokerAuth):
        fix = (
            "check the user and password in the URL (redis://USER:PASSWORD@host:port/db) "
            "and the server's ACL (README: Redis)"
        )
    elif scheme.startswith("redis"):
        fix = "redis-server --port PORT   # or check host, port and password in the URL"
    else:
        fix = (
            "check the URL (an absolute SQLite path takes four slashes) and the file's permissions"
        )
    return Finding(
        check="broker",
        state="missing",
        detail=f"{url}: {exc}",
        meaning="a worker cannot lease jobs and a producer cannot submit",
        fix=fix,
        required=True,
    )


def _open_broker_finding(detail: str) -> Finding:
    return Finding(
        check="broker_auth",
        state="weakened",
        detail=detail,
        meaning="anyone who reaches its port (another user of this machine, a job outside "
        "the network wall) may read every job's arguments and results, submit jobs for any "
        "executor and forge results (SECURITY.md)",
        fix="requirepass PASSWORD, or an ACL user for the queue and `user default off` "
        "(README: Redis; queue/redis.conf), then --broker redis://USER:PASSWORD@host:port/db",
    )


def _missing_sqlite_file(url: str) -> str | None:
    """The absolute path of a SQLite queue file that does not exist yet, else ``None``."""
    from urllib.parse import urlsplit

    path = urlsplit(url).path[1:]
    if path and not os.path.exists(path):
        return os.path.abspath(path)
    return None


_USERADD = "useradd --system --create-home metnos && runuser -u metnos -- metnos-exec worker ..."


def _user_finding(st: Any) -> Finding:
    """Who the worker is, and so what its jobs run as (`status`'s ``worker_as_root``)."""
    from .identities import SLOT_UIDS_ENV
    from .sandbox.bwrap import ROOT_WORKER_REASON, worker_is_root

    if not worker_is_root():
        return Finding(
            check="worker_user",
            state="ok",
            detail=f"the worker runs as {_user_name()} (uid {os.geteuid()})",
            meaning="jobs cannot use root's file permissions; on the host they are this uid "
            "(anything it may do within their folders is theirs) and share its per-user "
            "kernel quotas with the worker and each other (the resources axis says partial)",
        )
    note = str(st.worker_as_root or "")
    bwrap_runs = st.bwrap.working and not st.sandbox_off
    still_root = (
        "still root's: wasm guests (the engine runs inside the worker: their user axis is "
        "not_kept), direct-arm jobs (full root: set METNOS_REQUIRE_SANDBOX=always), and a "
        "job whose folders cannot be idmapped (it runs as root and says partial)"
    )
    if bwrap_runs and not note.startswith(ROOT_WORKER_REASON):
        return Finding(
            check="worker_user",
            state="ok",
            detail="the worker runs as root; each job slot runs its bubblewrap jobs as a "
            f"dedicated unprivileged host uid of its own ({SLOT_UIDS_ENV})",
            meaning="bubblewrap jobs cannot use root's file permissions nor its per-user "
            "kernel quotas; " + still_root,
        )
    if not bwrap_runs:
        return Finding(
            check="worker_user",
            state="weakened",
            detail="the worker runs as root and bubblewrap does not run here",
            meaning="native jobs degrade to the direct arm and run as full root: the user "
            "axis says not_kept",
            fix=_USERADD,
        )
    return Finding(
        check="worker_user",
        state="weakened",
        detail=note or "the worker runs as root and its jobs run as root",
        meaning="bubblewrap jobs run as host root for file permissions and share root's "
        "per-user kernel quotas: the files, user and resources axes say partial",
        fix=f"unset {SLOT_UIDS_ENV} on a cgroup v1 host (slot uids need a writable pids "
        f"hierarchy), or run the worker as an unprivileged user: {_USERADD}",
    )


def _slot_uids_finding(env: Mapping[str, str]) -> Finding | None:
    """A ``METNOS_SLOT_UIDS`` a worker refuses to start on (``None``: it reads it)."""
    from .identities import SLOT_UIDS_ENV, slot_uid_range

    try:
        slot_uid_range(env)
    except MetnosError as exc:
        return Finding(
            check="slot_uids",
            state="missing",
            detail=exc.message,
            meaning="a worker refuses to start (E_CONFIG): with it, a root worker's jobs "
            "would run as host root",
            fix=f"unset {SLOT_UIDS_ENV} (the default range), set it to BASE:COUNT, or to "
            "off on purpose",
            required=True,
        )
    return None


def _executors_finding(
    folder: str | os.PathLike[str], registry: ExecutorRegistry | None, error: str
) -> Finding:
    fix = (
        "metnos-exec worker --executors DIR, DIR holding one folder per executor (its "
        "manifest.toml and code), such as examples/executors"
    )
    if registry is None:
        return Finding(
            check="executors",
            state="missing",
            detail=error,
            meaning="the worker refuses to start (E_BAD_MANIFEST)",
            fix=fix,
            required=True,
        )
    if registry.errors:
        total = len(registry) + len(registry.errors)
        broken = "; ".join(exc.message for _, exc in sorted(registry.errors.items()))
        return Finding(
            check="executors",
            state="missing",
            detail=f"{len(registry.errors)} of {total} executor(s) fail to load: {broken}",
            meaning="the worker starts without them; their jobs are rejected (E_BAD_MANIFEST)",
            fix="correct each manifest named above (the field and the problem are given)",
            required=True,
        )
    if not len(registry):
        return Finding(
            check="executors",
            state="missing",
            detail=f"{folder}: no executor folder (no */manifest.toml) in it",
            meaning="a worker started on it serves no executor: it runs only undo jobs",
            fix=fix,
            required=True,
        )
    names = ", ".join(sorted(registry))
    return Finding(
        check="executors",
        state="ok",
        detail=f"{len(registry)} executor(s) load: {names}",
        meaning="",
    )


def _trust_finding(device: str, trust_keys: Sequence[str], env: Mapping[str, str]) -> Finding:
    from .devices.signing import TRUST_KEYS_ENV, load_trust_keys
    from .messages import SERVER_DEVICE

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
    executors_finding: Finding | None = None
    if executors is not None:
        try:
            registry = ExecutorRegistry.load(executors)
        except MetnosError as exc:
            executors_finding = _executors_finding(executors, None, exc.message)
        else:
            runtimes = {registry[n].manifest.runtime for n in registry}
            executors_finding = _executors_finding(executors, registry, "")
    findings = [
        *_bwrap_findings(st, env, required_wall),
        *_bwrap_feature_findings(st),
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
    findings.append(await _network_finding(st, env))
    findings.append(_staging_finding(st))
    findings.extend(_wasm_findings(st, runtimes))
    if broker_url is not None:
        findings.extend(await _broker_findings(broker_url))
    if executors_finding is not None:
        findings.append(executors_finding)
    findings.append(_user_finding(st))
    slot_uids = _slot_uids_finding(env)
    if slot_uids is not None:
        findings.append(slot_uids)
    findings.append(_trust_finding(device, trust_keys, env))
    healthy = all(f.state == "ok" for f in findings if f.required)
    return DoctorReport(
        findings=tuple(findings), healthy=healthy, user=_user_name(), uid=os.geteuid()
    )
