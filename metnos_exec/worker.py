"""The worker process: open the broker, load the executors, serve until told to stop.

Signals (installed with `anyio.open_signal_receiver`, so both backends behave alike):

- the first SIGTERM or SIGINT drains: ``worker.draining`` is logged, no new job is leased,
  running jobs get ``grace_s`` seconds to finish; those still running are then cancelled
  (their sandboxes killed and reaped) and their leases *released* — handed back without
  using an attempt — and the worker logs ``worker.stopped`` and exits 0;
- a second signal while draining cuts the grace short (same release path);
- a signal that arrives while the worker is still starting (loading executors, opening
  the broker, waiting for a lock held elsewhere) is remembered and drains it as soon as it
  serves, or stops it before it serves: exit 0 either way, never death by the signal.

SIGKILL cannot be handled: the sandboxed children die with the worker (die-with-parent)
and the broker redelivers the jobs once their leases expire.

Configuration is checked once, before anything is served (`check_worker_config`): bad
numbers, ``METNOS_REQUIRE_SANDBOX``, ``METNOS_ARM_OVERRIDE``, ``METNOS_RETENTION_DAYS``,
``METNOS_SLOT_UIDS`` and an explicit ``METNOS_BWRAP`` that names no executable make the
worker refuse to start with `BadConfig` (``E_CONFIG``) — rather than start and fail every
job it leases, or, for ``METNOS_SLOT_UIDS``, run every job as host root. So does
a store it cannot write (``E_BROKER_READONLY``, from the broker itself).

The store failing while the worker serves never stops it (see `Supervisor`): results are
kept and stored again, ``broker.error`` is logged. Only a fatal store error does (the
queue file deleted or replaced, a corrupt file): `serve` raises it after the worker
stopped, and ``metnos-exec worker`` exits 4 with its message.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Final, Literal

import anyio

from .backoff import store_backoff
from .brokers import DEFAULT_RETENTION_S, Broker, open_broker
from .devices.signing import default_verified_dir
from .errors import BadConfig, BrokerBusy, BrokerFull, MetnosError
from .identities import slot_uid_range
from .logs import configure_logging, get_logger
from .manifest import ExecutorRegistry
from .observe import NULL_OBSERVER, Observer
from .policy import Policy
from .preflight import (
    check_caches,
    dry_run_executors,
    open_staging,
    preload_wasm,
    trust_store_for,
    verify_executors,
)
from .private import tighten
from .process import become_subreaper, start_keeper
from .sandbox._bwrap_warm import worker_warm_sandboxes
from .sandbox._wasm_engine import default_cache_dir
from .sandbox.select import check_bwrap_setting
from .supervisor import Supervisor
from .supervisor.config import split_settings
from .supervisor.outage import OutageLog
from .undo.staging import STATE_DIR_ENV, Staging, default_state_dir

__all__ = (
    "ARM_OVERRIDE_ENV",
    "RETENTION_ENV",
    "check_worker_config",
    "default_worker_id",
    "dry_run_executors",
    "preload_wasm",
    "run_worker",
    "serve",
    "trust_store_for",
    "verify_executors",
)

#: Test and bench hook: ``METNOS_ARM_OVERRIDE=echo`` runs every job in the echo double
#: (no executor process at all), to measure the queue alone. Never set it in production:
#: the results then say ``sandbox: "echo"``, which is honest but useless.
ARM_OVERRIDE_ENV: Final = "METNOS_ARM_OVERRIDE"

#: Days a finished job (its result, dead letter, idempotency key) is kept before a worker
#: purges it; ``never`` keeps everything (the file then only grows). Default 7.
RETENTION_ENV: Final = "METNOS_RETENTION_DAYS"

_NEVER = ("never", "off", "forever", "none")

_log = get_logger()


def parse_retention_days(text: str, *, what: str = RETENTION_ENV) -> float | None:
    """Days as text (``7``, ``0.5``, or ``never``) → seconds, or ``None`` for never.

    Raises:
        BadConfig: not a positive number nor ``never``.
    """
    value = text.strip().lower()
    if value in _NEVER:
        return None
    try:
        days = float(value)
    except ValueError:
        days = float("nan")
    if not (days > 0 and days != float("inf")):
        raise BadConfig(f"{what}={text!r}: expected a number of days above 0, or 'never'")
    return days * 86400.0


def retention_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """The retention (seconds; ``None``: never purge) from ``METNOS_RETENTION_DAYS``,
    else `DEFAULT_RETENTION_S`.

    Raises:
        BadConfig: a bad value.
    """
    env = os.environ if environ is None else environ
    text = env.get(RETENTION_ENV)
    return DEFAULT_RETENTION_S if text is None or not text.strip() else parse_retention_days(text)


def default_worker_id() -> str:
    """``<hostname>-<pid>``: unique per process on a machine, readable in logs."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _override_chooser(name: str, env: Mapping[str, str]) -> Callable[..., Any]:
    from .sandbox import doubles

    if name != "echo":
        raise BadConfig(f"{ARM_OVERRIDE_ENV}={name!r}: only 'echo' is supported (tests, bench)")
    from .sandbox.select import ArmChoice

    arm = doubles.echo_from_env(env)  # METNOS_ECHO_DELAY_S: its wait per job (bench/fleet)

    def choose(runtime: str, *, require_sandbox: bool = False, **_: Any) -> Any:
        return ArmChoice(sandbox=arm)

    return choose


def _policy_from_env(env: Mapping[str, str]) -> Policy:
    try:
        return Policy.from_env(env)
    except BadConfig:
        raise
    except (MetnosError, ValueError) as exc:  # `from_env` raised ValueError before E_CONFIG
        raise BadConfig(getattr(exc, "message", str(exc))) from None


def check_worker_config(
    *,
    concurrency: int = 4,
    visibility_s: float = 30.0,
    grace_s: float = 30.0,
    environ: Mapping[str, str] | None = None,
) -> Policy:
    """Check a worker's settings before it serves; return the sandbox policy to use.

    The policy is resolved here, once: read per job, a bad ``METNOS_REQUIRE_SANDBOX``
    would fail every job as a host fault and dead-letter it.

    Raises:
        BadConfig: a number out of range, or a bad ``METNOS_REQUIRE_SANDBOX``,
            ``METNOS_ARM_OVERRIDE``, ``METNOS_SLOT_UIDS`` or ``METNOS_BWRAP``.
    """
    env = os.environ if environ is None else environ
    if concurrency < 1:
        raise BadConfig(f"concurrency must be at least 1, got {concurrency}")
    if not visibility_s > 0:
        raise BadConfig(f"the visibility window must be positive, got {visibility_s} s")
    if not grace_s >= 0:
        raise BadConfig(f"the drain grace must be zero or more, got {grace_s} s")
    policy = _policy_from_env(env)
    if ARM_OVERRIDE_ENV in env:
        _override_chooser(env[ARM_OVERRIDE_ENV], env)
    check_bwrap_setting(env)
    # Checked whoever runs the worker: a typo is one, and for root it would weaken a wall.
    slot_uid_range(env)
    retention_from_env(env)
    from .devices.runtimes import device_python_source

    device_python_source(env)  # a URL without its pinned hash is refused here
    return policy


#: How many wasm guest processes a worker keeps started ahead (`serve`'s `wasm_spares`).
WASM_SPARES_ENV: Final = "METNOS_WASM_SPARES"


async def serve(
    broker: Broker,
    registry: ExecutorRegistry,
    *,
    grace_s: float = 30.0,
    burst: bool = False,
    handle_signals: bool = True,
    preload: bool = False,
    early_signals: Sequence[int] = (),
    dry_run: bool = False,
    wasm_spares: int | None = None,
    task_status: anyio.abc.TaskStatus[Supervisor] = anyio.TASK_STATUS_IGNORED,
    **supervisor_kw: Any,
) -> None:
    """Run a `Supervisor` until drained by a signal (or, in burst mode, the queue empties).

    Args:
        grace_s: how long running jobs may finish after SIGTERM/SIGINT.
        handle_signals: install the SIGTERM/SIGINT drain (main thread only).
        early_signals: signals that arrived before this call (see `run_worker`): the
            first drains at once, as if it had come now.
        dry_run: before leasing, dry-run every packable native executor in the sandbox
            (`dry_run_executors`); one whose imports the sandbox cannot find is refused.
        preload: compile the wasm modules the executors need (python.wasm for
            ``wasm-python``) in the background from the start (`preload_wasm`), so the
            first such job does not wait for a cold compile (4-8 s); the worker process
            does. Skipped with a custom ``arm_chooser``. A compile cannot be interrupted:
            when serving ends during one, it is left to finish in its (daemon) thread.
        wasm_spares: with `preload` and an executor of runtime ``wasm`` or
            ``wasm-python``, keep this many wasm guest processes started ahead
            (`metnos_exec.sandbox.wasm.spare_processes`, one job each, killed and reaped
            when serving ends); 0: each wasm job starts its own. Default:
            ``METNOS_WASM_SPARES``, else 1.
        task_status: receives the supervisor once it is ready to lease.
        **supervisor_kw: passed to `Supervisor`: its settings (the fields of
            `SupervisorConfig`: worker_id, device, concurrency, ...) and its
            collaborators (arm_chooser, staging, trust, ...), mixed (`split_settings`);
            without a ``policy``, `Policy.from_env` is read once, here.

    Raises:
        BadConfig: a bad ``METNOS_REQUIRE_SANDBOX``, ``METNOS_ARM_OVERRIDE``,
            ``METNOS_SLOT_UIDS`` or ``METNOS_WASM_SPARES``.
        BrokerError: a fatal store error stopped the worker (``Supervisor.fatal_error``,
            e.g. the queue file was deleted under it), raised once it has stopped.
    """
    if ARM_OVERRIDE_ENV in os.environ and "arm_chooser" not in supervisor_kw:
        supervisor_kw["arm_chooser"] = _override_chooser(os.environ[ARM_OVERRIDE_ENV], os.environ)
        # Every record of the job says "echo", from job.received on.
        supervisor_kw.setdefault("predict_arm", lambda runtime: "echo")
    if supervisor_kw.get("policy") is None:
        # Once, here: read per job, a bad variable would fail every job instead.
        supervisor_kw["policy"] = _policy_from_env(os.environ)
    # Read per job after this (``off`` takes effect at once), but a malformed value must
    # stop the worker here, not leave each job as host root with the error in its report.
    slot_uid_range(os.environ)
    config, collaborators = split_settings(supervisor_kw)
    sup = Supervisor(broker, registry, config, **collaborators)

    async def on_signals(
        *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async with anyio.create_task_group() as drains:
                first = True
                if early_signals:
                    _log.info("worker.signal", signal=signal.Signals(early_signals[0]).name)
                    drains.start_soon(sup.drain, grace_s)
                    first = False
                async for signum in signals:
                    _log.info("worker.signal", signal=signal.Signals(signum).name)
                    # The second signal cuts the grace short: drain() again with 0.
                    drains.start_soon(sup.drain, grace_s if first else 0.0)
                    first = False

    wasm_spares = _wasm_spares(wasm_spares)
    async with contextlib.AsyncExitStack() as owned:
        # Before any task group: a metrics port in use is said as E_CONFIG, not grouped.
        await owned.enter_async_context(sup.observer.bound())
        if (
            preload
            and wasm_spares > 0
            and "arm_chooser" not in supervisor_kw
            and any(registry[n].manifest.runtime in ("wasm", "wasm-python") for n in registry)
        ):
            try:
                from .sandbox.wasm import spare_processes
            except ImportError:
                pass  # no wasm arm here: its jobs say so themselves
            else:
                # Outside the task group: the jobs end before the spares are reaped.
                await owned.enter_async_context(spare_processes(wasm_spares))
        if "arm_chooser" not in supervisor_kw:  # reaped after the jobs, as the spares
            await owned.enter_async_context(worker_warm_sandboxes(registry, config.concurrency))
        await _serve_in(
            sup,
            registry,
            handle_signals,
            on_signals,
            dry_run,
            burst,
            preload,
            task_status,
            supervisor_kw,
        )
    if sup.fatal_error is not None:
        raise sup.fatal_error


def _wasm_spares(given: int | None) -> int:
    """`serve`'s ``wasm_spares``: as given, else ``METNOS_WASM_SPARES``, else 1."""
    if given is not None:
        return given
    raw = os.environ.get(WASM_SPARES_ENV, "1")
    if not raw.isdigit():
        raise BadConfig(
            f"{WASM_SPARES_ENV} must be a number of spare processes (0 turns them off), got {raw!r}"
        )
    return int(raw)


async def _serve_in(
    sup: Supervisor,
    registry: ExecutorRegistry,
    handle_signals: bool,
    on_signals: Callable[..., Coroutine[Any, Any, None]],
    dry_run: bool,
    burst: bool,
    preload: bool,
    task_status: anyio.abc.TaskStatus[Supervisor],
    supervisor_kw: dict[str, Any],
) -> None:
    async with anyio.create_task_group() as tg:
        if handle_signals:
            await tg.start(on_signals)
        if sup.trust is not None:
            # Before the first lease: its jobs then find the cache warm.
            await verify_executors(registry, sup.trust)
        if dry_run:
            await dry_run_executors(registry, python=supervisor_kw.get("python"), trust=sup.trust)
        await tg.start(functools.partial(sup.run, burst=burst))
        if preload and "arm_chooser" not in supervisor_kw:
            tg.start_soon(preload_wasm, registry)
        task_status.started(sup)
        await sup.wait_stopped()
        tg.cancel_scope.cancel()


async def open_when_free(url: str, *, stop: Callable[[], bool] = lambda: False) -> Broker | None:
    """Open the broker for a worker; while another process holds the store's lock
    (`BrokerBusy`) or its writes fail for want of room (`BrokerFull`: a full disk, a file
    size limit), wait and try again (``broker.error`` each time) rather than exit.

    A worker started (or restarted by its supervisor) in the moment a long transaction
    runs elsewhere, or while the disk is full, must come up once that ends, as a running
    worker rides both out. Every other failure to open (a missing folder, a read-only or
    damaged file, a bad URL) is said at once: waiting would not mend it.
    ``None`` when `stop` says so while waiting (a signal arrived).

    Raises:
        BadBrokerURL: the URL is malformed or names no broker here.
        BrokerError: any store failure but a held lock (missing folder, read-only, ...).
    """
    failures = 0
    outage = OutageLog()  # the first failure said, then a reminder every 30 s
    while not stop():
        try:
            broker = open_broker(url)
        except (BrokerBusy, BrokerFull) as exc:
            failures += 1
            delay = store_backoff(failures)
            outage.failed(
                op="open",
                code=exc.code,
                error=exc.message,
                failures=failures,
                fatal=False,
                retry_in_s=round(delay, 3),
            )
            await anyio.sleep(delay)
        else:
            outage.recovered(op="open")
            return broker
    return None


#: Allocations between two young-generation collections in a worker (CPython: 700).
_GC_YOUNG_THRESHOLD: Final = 10_000


def _tune_gc() -> None:
    """Make the cyclic garbage collector cheap for a long-running worker.

    Each job allocates and frees a few hundred short-lived objects (tasks, scopes, log
    records, messages); at CPython's default a young collection runs every few jobs, and
    the older generations (every module, the Redis client, the executors) are rescanned
    again and again. Measured on the echo arm, collection took 12-25 % of a worker's CPU.
    Objects alive after start-up are frozen (never scanned again), and young collections
    come every `_GC_YOUNG_THRESHOLD` allocations. Reference counting still frees almost
    everything at once; only reference cycles wait a little longer.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, 10, 10)


def run_worker(
    broker_url: str,
    executors_dir: str | os.PathLike[str],
    *,
    concurrency: int = 4,
    worker_id: str | None = None,
    device: str = "server",
    log_file: str | os.PathLike[str] | None = None,
    log_level: str = "info",
    grace_s: float = 30.0,
    burst: bool = False,
    visibility_s: float = 30.0,
    backend: str = "asyncio",
    home: str | os.PathLike[str] | None = None,
    configure_logs: bool = True,
    prefetch: int = 1,
    retention_s: float | Literal["env"] | None = "env",
    state_dir: str | os.PathLike[str] | None = None,
    trust_keys: tuple[str, ...] | list[str] = (),
    observer: Observer = NULL_OBSERVER,
) -> int:
    """The worker process's main: configure logs, serve, return the exit code (0).

    ``prefetch``: jobs leased ahead while every slot is busy (see `Supervisor`).
    ``retention_s``: finished jobs older than this are purged (``None``: never); the
    default reads ``METNOS_RETENTION_DAYS`` (else 7 days).
    ``state_dir``: blobs, commit journals and staging mount points (default
    `metnos_exec.undo.staging.default_state_dir` of the queue: its own folder).
    ``trust_keys``: public keys (paths or inline ``ed25519:...``) whose signatures this
    worker accepts, besides ``METNOS_TRUST_KEYS``; required on a device worker.
    ``observer``: metrics and traces (`metnos_exec.observe.make_observer`).

    Raises:
        BadConfig: a setting is invalid (see `check_worker_config`); nothing was served.
        MetnosError: the broker URL or the executors folder is unusable (before serving).
        BrokerError: a fatal store error stopped the worker (see `serve`).
    """
    # A SIGTERM while starting must not kill the worker (exit by the signal): it is
    # remembered from here on and honoured once serving (see the module docstring).
    early: list[int] = []
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda n, _frame: early.append(n))
    try:
        return _start(
            early,
            broker_url,
            executors_dir,
            concurrency=concurrency,
            worker_id=worker_id,
            device=device,
            log_file=log_file,
            log_level=log_level,
            grace_s=grace_s,
            burst=burst,
            visibility_s=visibility_s,
            backend=backend,
            home=home,
            configure_logs=configure_logs,
            prefetch=prefetch,
            retention_s=retention_s,
            trust_keys=trust_keys,
            state_dir=state_dir,
            observer=observer,
        )
    finally:
        for num, handler in previous.items():
            signal.signal(num, handler)


def _start(
    early: list[int],
    broker_url: str,
    executors_dir: str | os.PathLike[str],
    *,
    concurrency: int,
    worker_id: str | None,
    device: str,
    log_file: str | os.PathLike[str] | None,
    log_level: str,
    grace_s: float,
    burst: bool,
    visibility_s: float,
    backend: str,
    home: str | os.PathLike[str] | None,
    configure_logs: bool,
    prefetch: int,
    retention_s: float | Literal["env"] | None,
    trust_keys: tuple[str, ...] | list[str],
    state_dir: str | os.PathLike[str] | None,
    observer: Observer,
) -> int:
    """`run_worker` once its early signal handler is in place."""
    policy = check_worker_config(
        concurrency=concurrency, visibility_s=visibility_s, grace_s=grace_s
    )
    if prefetch < 0:
        raise BadConfig(f"prefetch must be zero or more, got {prefetch}")
    retention_s = _resolved_retention(retention_s)
    trust = trust_store_for(device, trust_keys)
    if configure_logs:
        try:
            configure_logging(file=log_file, level=log_level)
        except ValueError as exc:
            raise BadConfig(str(exc)) from None
        except OSError as exc:
            raise BadConfig(f"cannot open the log file {log_file}: {exc}") from None
    registry = ExecutorRegistry.load(executors_dir)
    check_caches(trust is not None, registry)  # before the broker: no queue made for it
    wid = worker_id or default_worker_id()
    _prepare_process()
    # A folder named (else the queue's own, known once the broker is open): checked
    # before anything is served.
    staging: Staging | None = None
    if state_dir is not None or os.environ.get(STATE_DIR_ENV):
        staging = open_staging(state_dir if state_dir is not None else default_state_dir())

    async def serve_on(broker: Broker, staging: Staging, python: str | None) -> None:
        await serve(
            broker,
            registry,
            grace_s=grace_s,
            burst=burst,
            worker_id=wid,
            device=device,
            concurrency=concurrency,
            visibility_s=visibility_s,
            home=home,
            policy=policy,
            prefetch=prefetch,
            preload=True,
            retention_s=retention_s,
            early_signals=early,
            staging=staging,
            dry_run=True,
            trust=trust,
            python=python,
            observer=observer,
        )

    anyio.run(_serve_queue, broker_url, early, staging, serve_on, backend=backend)
    return 0


def _resolved_retention(retention_s: float | Literal["env"] | None) -> float | None:
    """`run_worker`'s ``retention_s`` resolved (``"env"``: ``METNOS_RETENTION_DAYS``).

    Raises:
        BadConfig: a retention that is not a positive number of seconds.
    """
    if retention_s == "env":
        retention_s = retention_from_env()
    elif retention_s is not None and not retention_s > 0:
        raise BadConfig(f"retention must be a positive number of seconds, got {retention_s!r}")
    return retention_s


def _prepare_process() -> None:
    """Make this process a worker: the subreaper, the keeper, the collector's tuning, the
    caches private."""
    # bubblewrap's orphaned inits come back to us and are reaped as each job ends, so a
    # job's process budget is exact whatever the host's init (see `become_subreaper`).
    become_subreaper()
    # Whatever ends this process (SIGKILL included), what its jobs started dies with it.
    if start_keeper() is None:
        _log.warning(
            "worker.no_keeper",
            detail="could not start the keeper: a worker killed while a job starts may "
            "leave that job's sandbox running",
        )
    _tune_gc()

    # Caches made by earlier runs, maybe under another umask: private from here on.
    for cache in (default_verified_dir(), default_cache_dir()):
        tighten(cache)


async def _serve_queue(
    broker_url: str,
    early: list[int],
    staging: Staging | None,
    serve_on: Callable[[Broker, Staging, str | None], Awaitable[None]],
) -> None:
    """`_start`'s async half: the device's Python, the broker (waited for while another
    process holds it), the queue's own staging when none was named, then `serve_on`."""
    from .devices.runtimes import obtain_device_python

    # A standalone CPython for native executors, when configured (downloaded once,
    # verified by its pinned hash); before the broker, so a failure leaves nothing open.
    exe = await obtain_device_python()
    python = str(exe) if exe is not None else None
    broker = await open_when_free(broker_url, stop=lambda: bool(early))
    if broker is None:  # told to stop while waiting to open: nothing was served
        if staging is not None:
            with anyio.CancelScope(shield=True):
                await staging.aclose()
        return
    try:
        # Entered, not just closed at the end: a broker may hold resources that live
        # in the task that opens it (the Redis client's connection tasks).
        async with broker:
            if staging is None:
                # The queue's own folder: another queue's worker never settles (or
                # collects) what this one keeps there.
                staging = open_staging(default_state_dir(queue=broker.queue_id))
            await serve_on(broker, staging, python)
    finally:
        if staging is not None:
            with anyio.CancelScope(shield=True):
                await staging.aclose()
