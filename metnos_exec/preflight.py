"""What a worker does with its executors before its first lease: the trust store it
checks them with (`trust_store_for`: required on a device worker), one signature check
each (`verify_executors`, so the first jobs find the cache warm), a dry run of every
packable native executor in the sandbox (`dry_run_executors`: one whose imports the
sandbox cannot find is refused), and the wasm modules compiled ahead (`preload_wasm`).

None of it stops the worker but a missing trust key (`BadConfig`): a failure is logged
and left to the jobs that need the executor, which are answered with the same error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import anyio
import anyio.to_thread

from .devices.signing import TRUST_KEYS_ENV, TrustStore, default_verified_dir, load_trust_keys
from .errors import BadConfig, BadManifest, HostFault, MetnosError, SignatureError
from .logs import get_logger
from .manifest import ExecutorRegistry
from .messages import SERVER_DEVICE
from .private import check_folder
from .sandbox._wasm_engine import default_cache_dir
from .undo.staging import Staging

__all__ = (
    "check_caches",
    "dry_run_executors",
    "open_staging",
    "preload_wasm",
    "trust_store_for",
    "verify_executors",
)

_log = get_logger()


def trust_store_for(
    device: str,
    trust_keys: tuple[str, ...] | list[str] = (),
    environ: Mapping[str, str] | None = None,
) -> TrustStore | None:
    """The worker's `TrustStore` from ``--trust-key`` values and ``METNOS_TRUST_KEYS``.

    A device worker (any `device` but ``server``) must have one: it runs code sent to it,
    and unsigned or altered code must never run there (spec section 10). A server worker
    verifies only when given keys.

    Raises:
        BadConfig: a device worker without a key, or a key that cannot be loaded
            (cryptography missing, unreadable, not Ed25519).
    """
    keys = load_trust_keys(tuple(trust_keys), environ)
    if not keys:
        if device != SERVER_DEVICE:
            raise BadConfig(
                f"device worker {device!r} refuses to start without a trust key: it must "
                "verify the signature of every executor it runs; pass --trust-key PUB "
                f"(repeatable) or set {TRUST_KEYS_ENV}"
            )
        return None
    return TrustStore(keys)


async def verify_executors(registry: ExecutorRegistry, trust: TrustStore) -> int:
    """Verify every executor once at start (in a thread), so the first jobs find the
    cache warm and an operator learns at once which executors will be refused.

    Logs ``executor.verified`` or ``executor.signature_failed`` per executor; a failure
    does not stop the worker (its jobs are refused with the same error, and an executor
    re-signed later is accepted at its next job).

    Returns:
        How many failed.
    """
    failed = 0
    for name in sorted(registry):
        executor = registry[name]
        try:
            checked = await anyio.to_thread.run_sync(trust.verify, executor)
        except MetnosError as exc:
            failed += 1
            _log.warning(
                "executor.signature_failed", executor=name, code=exc.code, error=exc.message
            )
            continue
        _log.info("executor.verified", executor=name, copy=checked.path)
    for name, folder in sorted(registry.error_folders.items()):
        # Did not load: tampering, if that is why, is what the operator must hear.
        try:
            await anyio.to_thread.run_sync(trust.verify_folder, folder, name)
        except SignatureError as exc:
            failed += 1
            _log.warning(
                "executor.signature_failed", executor=name, code=exc.code, error=exc.message
            )
        except MetnosError:
            pass  # signed as it is: its load error stands (executor.load_failed)
    return failed


async def dry_run_executors(
    registry: ExecutorRegistry, *, python: str | None = None, trust: TrustStore | None = None
) -> None:
    """Dry-run every packable native executor in the sandbox (`packability.dry_run`); one
    that fails is refused from then on (``executor.not_packable``, ``E_BAD_MANIFEST``).

    Runs on the native arm this host has (bubblewrap, else the direct arm: ``-I -S`` keep
    site-packages out either way), without logging a degradation: no job runs here. With
    a `trust` store, the verified private copy is what is dry-run (an executor whose
    signature fails is left to its ``E_SIGNATURE``).
    """
    from .devices.packability import dry_run
    from .sandbox.bwrap import BwrapSandbox, bwrap_probe
    from .sandbox.direct import DirectSandbox

    targets = [
        registry[name]
        for name in sorted(registry)
        if registry[name].manifest.packable and registry[name].manifest.runtime == "python"
    ]
    if not targets:
        return
    try:
        working = bwrap_probe().working
    except MetnosError:
        working = False
    arm = BwrapSandbox() if working else DirectSandbox()
    for source in targets:
        executor = source
        if trust is not None:
            try:
                executor = await anyio.to_thread.run_sync(trust.check, source)
            except MetnosError:
                continue  # not verified: its jobs are refused with E_SIGNATURE anyway
        try:
            await dry_run(executor, arm, python=python)
        except BadManifest as exc:
            # Named by the folder the operator knows, not the private copy it ran in.
            exc = BadManifest(exc.message.replace(executor.path, source.path))
            registry.refuse(executor.name, exc)
            _log.warning(
                "executor.not_packable", executor=executor.name, code=exc.code, error=exc.message
            )
        except (MetnosError, HostFault) as exc:
            # The sandbox itself failed: say so, but do not refuse an executor for it.
            _log.warning("worker.error", error=f"dry run of {executor.name}: {exc}")


async def preload_wasm(registry: ExecutorRegistry) -> None:
    """Load, ahead of the first job, the wasm modules `registry`'s executors will need.

    python.wasm when any executor is ``wasm-python``, and each ``wasm`` executor's own
    module, one at a time. Each is logged as ``worker.preloaded`` (module, how it was
    obtained: compiled, disk or memory, seconds) or ``worker.preload_failed`` (module,
    code, error), which is otherwise ignored: the jobs that need that module are answered
    with the same error, in their own job context.
    """
    runtimes = {name: registry[name].manifest.runtime for name in registry}
    python = "wasm-python" in runtimes.values()
    if python:
        try:
            # Without the extra or METNOS_PYTHON_WASM: download it, if a URL is configured.
            from .devices.runtimes import obtain_python_wasm

            fetched = await obtain_python_wasm()
        except Exception as exc:
            code = exc.code if isinstance(exc, MetnosError) else HostFault.code
            _log.warning("worker.preload_failed", module="python", code=code, error=str(exc))
        else:
            if fetched is not None:
                _log.info("worker.preloaded", module=str(fetched), how="fetched", seconds=0.0)
    modules = tuple(
        registry[name].entry_path for name, runtime in sorted(runtimes.items()) if runtime == "wasm"
    )
    if not python and not modules:
        return
    try:
        from .sandbox.wasm import WasmSandbox

        arm = WasmSandbox()
    except Exception as exc:  # an import error, no home folder for the cache, ...
        for what in (("python",) if python else ()) + modules:
            _log.warning(
                "worker.preload_failed", module=what, code="E_TOOL_UNAVAILABLE", error=str(exc)
            )
        return
    # Apart: a runtime that fails verification must not keep the modules from loading.
    for what in (("python",) if python else ()) + modules:
        try:
            # Abandoned on cancel: a worker told to stop during a cold compile (4-8 s)
            # exits now; the compile's cache file is written atomically or not at all.
            loaded = await (
                arm.preload(python=True, abandon_on_cancel=True)
                if what == "python"
                else arm.preload(python=False, modules=(what,), abandon_on_cancel=True)
            )
        except Exception as exc:
            # A start-up nicety must never take the worker down: jobs that need the
            # module will say why, in their own context.
            code = exc.code if isinstance(exc, MetnosError) else HostFault.code
            error = exc.message if isinstance(exc, MetnosError) else f"{type(exc).__name__}: {exc}"
            _log.warning("worker.preload_failed", module=what, code=code, error=error)
            continue
        for path, how, seconds in loaded:
            _log.info("worker.preloaded", module=path, how=how, seconds=round(seconds, 3))


def check_caches(verifies: bool, registry: ExecutorRegistry) -> None:
    """Refuse a cache the worker will use (verified copies when it checks signatures,
    compiled modules when it has wasm executors) but could not: configuration, said
    with the fix, not a broker failure."""
    fix = "set METNOS_CACHE_DIR to a folder this user can write (default ~/.cache/metnos-exec)"
    wasm = any(registry[name].manifest.runtime != "python" for name in registry)
    for cache, used in ((default_verified_dir(), verifies), (default_cache_dir(), wasm)):
        if used:
            check_folder(cache, what="cache folder", fix=fix)


def open_staging(state_dir: str | os.PathLike[str]) -> Staging:
    """The worker's `Staging` in `state_dir`, or `BadConfig` saying which option moves it."""
    try:
        return Staging(state_dir)
    except OSError as exc:
        raise BadConfig(
            f"cannot use the state folder {state_dir}: {exc}; name another with --state-dir "
            "or METNOS_STATE_DIR"
        ) from None
