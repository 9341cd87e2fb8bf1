"""An in-process wasmtime engine: one engine, one epoch ticker, a module cache.

Private to the wasm arm, which no longer runs guests with it: each job's load and run
happen in a process of its own (`_wasm_child`; `_wasm_guest` defines the engine flags,
the cache key and the WASI p1 list this module shares). Kept for the benchmark (cold
compile and cache-hit figures) and the cache tests, and for the arm's helpers
(`default_cache_dir`, `load_wasmtime`, `wasmtime_version`, `_refuse_oversized`, and the
pin: `MIN_WASMTIME`, `fixed_release`, `WASMTIME_PIN_REASON`). Everything here imports
`wasmtime` lazily through `load_wasmtime()` so that `metnos_exec.sandbox.wasm` still
imports (and answers `E_TOOL_UNAVAILABLE`) on a machine without the engine.

Compiled modules are cached twice: in memory (a `Module` and its `InstancePre`, so a job
never recompiles nor re-links) and on disk (`Module.serialize()` output, so a restarted
worker does not pay the 4-8 s compile of python.wasm again). The disk key covers the module
bytes, the wasmtime version and the engine flags: a serialized module is native code, and
loading one produced by another engine configuration is undefined behaviour upstream
refuses only on a best-effort basis. We deserialize only files whose name carries that key
and that sit in a directory owned by us and closed to others, because
`Module.deserialize_file` trusts its input completely (it is machine code).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

from ..errors import HostFault, SandboxDenied
from ..private import private_dir
from ._wasm_guest import (
    ENGINE_FLAGS,
    EPOCH_TICK_S,
    MAX_MODULE_BYTES,
    WASI_P1,
    WASI_P1_FUNCS,
    Refused,
    cache_key,
    check_complexity,
    trusted_file,
    write_atomically,
)
from ._wasm_poll import install_poll_oneoff

if TYPE_CHECKING:
    import wasmtime

__all__ = (
    "ENGINE_FLAGS",
    "EPOCH_TICK_S",
    "MAX_MODULE_BYTES",
    "MIN_WASMTIME",
    "WASMTIME_PIN_REASON",
    "WasmEngine",
    "default_cache_dir",
    "fixed_release",
    "load_wasmtime",
    "wasmtime_version",
)


def _refuse_oversized(source: Path, size: int) -> None:
    if size > MAX_MODULE_BYTES:
        raise SandboxDenied(
            f"wasm module {source.name}: {size} bytes or more, over the {MAX_MODULE_BYTES} "
            "bytes a module may have (MAX_MODULE_BYTES)"
        )


def load_wasmtime() -> ModuleType | None:
    """The `wasmtime` module, or None when it is not installed."""
    try:
        import wasmtime
    except ImportError:
        return None
    return wasmtime


def wasmtime_version() -> str | None:
    """The installed wasmtime-py version, from its distribution metadata."""
    from importlib import metadata

    try:
        return metadata.version("wasmtime")
    except metadata.PackageNotFoundError:
        return None


#: Why `wasmtime>=50.0.1,<51`, and when to move it.
WASMTIME_PIN_REASON: Final[str] = (
    "Read-only preopens are a wall only on wasmtime releases that fixed two WASI "
    "permission bypasses: GHSA-2r75-cxrj-cmph / CVE-2026-47261 / RUSTSEC-2026-0149 "
    "(path_open with O_TRUNC on a read-only file skipped the FilePerms::WRITE check; fixed "
    "in 45.0.0, backported to 44.0.2, 36.0.10 and 24.x) and GHSA-4ch3-9j33-3pmj / "
    "RUSTSEC-2026-0188 (path_link and path_rename let a file cross from a read-only preopen "
    "into a writable one, ignoring FilePerms; fixed in 46.0.1, backported to 45.0.3, "
    "36.0.12 and 24.0.11). wasmtime-py 50.0.1 embeds a wasmtime 50 that contains both, and "
    "its C API takes one `fs_mutable` bit per preopen, the shape upstream moved to (a "
    "single-bit FsPerms, wasmtime PR #14010) to remove the DirPerms/FilePerms combinations "
    "both advisories lived in. tests/sandbox/test_wasm.py re-checks both bypasses against "
    "the installed engine. Move the pin when a wasmtime-py release fixes a new WASI "
    "advisory (take it at once), or when the 50 line leaves upstream support (non-LTS lines "
    "get about two months; the next LTS is 60); before crossing, check that "
    "`preopen_dir(..., fs_mutable=False)` still means read-only and re-run the bypass tests."
)

#: The oldest wasmtime-py release the arm runs on (the bottom of the pin).
MIN_WASMTIME: Final[tuple[int, int, int]] = (50, 0, 1)


def fixed_release(version: str | None) -> bool:
    """True when `version` is at least `MIN_WASMTIME` (an unparsable one is refused)."""
    if version is None:
        return False
    try:
        parts = tuple(int(p) for p in version.split(".")[:3])
    except ValueError:
        return False
    return parts >= MIN_WASMTIME


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$METNOS_CACHE_DIR/wasm`, else `~/.cache/metnos-exec/wasm` (`env`: default
    `os.environ`)."""
    root = (os.environ if env is None else env).get("METNOS_CACHE_DIR")
    if root:
        return Path(root) / "wasm"
    return Path.home() / ".cache" / "metnos-exec" / "wasm"


class _Ticker:
    """One thread that advances the engine epoch every `EPOCH_TICK_S` while jobs run.

    Reference-counted: it starts with the first running job and stops (and is joined) with
    the last, so an idle worker holds no thread. Stores never rely on the tick count for
    their deadline (see `WasmEngine.watchdog`); the tick only makes compiled code call back
    into the host.
    """

    def __init__(self, engine: wasmtime.Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._users = 0
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def _loop(self, stop: threading.Event) -> None:
        while not stop.wait(EPOCH_TICK_S):
            self._engine.increment_epoch()

    def acquire(self) -> None:
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._loop, args=(self._stop,), name="metnos-wasm-epoch", daemon=True
                )
                self._thread.start()

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._stop is not None and self._thread is not None:
                self._stop.set()
                # The loop wakes from `wait` at once; joining keeps "no thread outlives
                # the last job" true rather than hoped for.
                self._thread.join()
                self._stop = None
                self._thread = None

    def stop(self) -> None:
        """Stop the thread whoever still uses it (the engine is being closed)."""
        with self._lock:
            self._users = 0
            stop, thread = self._stop, self._thread
            self._stop = self._thread = None
        if stop is not None and thread is not None:
            stop.set()
            thread.join()

    @property
    def running(self) -> bool:
        with self._lock:
            return self._thread is not None


@dataclass(frozen=True)
class Loaded:
    """A module ready to instantiate, with how it was obtained (for the bench and logs)."""

    key: str
    module: wasmtime.Module
    pre: wasmtime.InstancePre
    source: str  # "memory" | "disk" | "compiled"
    seconds: float


class WasmEngine:
    """One wasmtime `Engine` + WASI `Linker` + module cache, shared by every job.

    Thread-safe: jobs run in worker threads; `Engine`, `Module`, `Linker` and
    `InstancePre` are `Send + Sync` upstream, and the caches are guarded by locks.
    """

    def __init__(self, wt: ModuleType) -> None:
        self.wt = wt
        config = wt.Config()
        config.consume_fuel = True
        config.epoch_interruption = True
        config.cranelift_opt_level = "speed"
        self.engine: wasmtime.Engine = wt.Engine(config)
        self.linker: wasmtime.Linker = wt.Linker(self.engine)
        self.linker.define_wasi()
        install_poll_oneoff(wt, self.linker, WASI_P1)
        self.ticker = _Ticker(self.engine)
        self.version = wasmtime_version() or "unknown"
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._memory: dict[str, Loaded] = {}
        self._denied: dict[str, str] = {}
        self._source_keys: dict[tuple[str, int, int, int], str] = {}
        # Compiles and links under way: `close` must not free what they are using.
        self._busy = 0
        _live_engines.add(self)

    # --- keys ---------------------------------------------------------------------------

    def cache_key(self, source: Path) -> tuple[str, bytes]:
        """Key = sha256(module bytes, wasmtime version, engine flags, machine)."""
        with source.open("rb") as f:
            data = f.read(MAX_MODULE_BYTES + 1)
        _refuse_oversized(source, len(data))
        return cache_key(data, self.version), data

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    # --- loading ------------------------------------------------------------------------

    def load(self, source: Path, cache_dir: Path | None) -> Loaded:
        """The compiled module for `source` (`.wasm` or `.wat`), from the cheapest cache.

        Raises:
            SandboxDenied: the module imports something the sandbox does not provide, does
                not compile, or its file is over `MAX_MODULE_BYTES`.
            HostFault: the module cannot be read, or the cache cannot be written.
        """
        t0 = time.perf_counter()
        try:
            st = source.stat()
        except OSError as exc:
            raise HostFault(f"wasm module {source}: cannot stat: {exc.strerror}") from exc
        _refuse_oversized(source, st.st_size)
        # Hashing python.wasm (26 MB) costs ~15 ms; remember the key per file identity.
        ident = (str(source), st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            key = self._source_keys.get(ident)
            hit = self._memory.get(key) if key else None
        if hit is not None:
            return Loaded(hit.key, hit.module, hit.pre, "memory", time.perf_counter() - t0)
        try:
            key, data = self.cache_key(source)
        except OSError as exc:
            raise HostFault(f"wasm module {source}: cannot read: {exc.strerror}") from exc
        with self._key_lock(key):
            with self._lock:
                self._source_keys[ident] = key
                hit = self._memory.get(key)
            if hit is not None:
                return Loaded(key, hit.module, hit.pre, "memory", time.perf_counter() - t0)
            with self._lock:
                denied = self._denied.get(key)
            if denied is not None:
                raise SandboxDenied(denied)
            with self._lock:
                self._busy += 1
            try:
                module, how = self._from_disk_or_compile(key, data, source, cache_dir)
                pre, refusal = self._link(module, source)
            finally:
                with self._lock:
                    self._busy -= 1
            if pre is None:
                # Remember the verdict, and drop the module before raising: a traceback
                # kept by the caller would otherwise pin it (and its mapped file) alive.
                del module
                with self._lock:
                    self._denied[key] = refusal
                raise SandboxDenied(refusal)
            loaded = Loaded(key, module, pre, how, time.perf_counter() - t0)
            with self._lock:
                self._memory[key] = loaded
            return loaded

    def _from_disk_or_compile(
        self, key: str, data: bytes, source: Path, cache_dir: Path | None
    ) -> tuple[wasmtime.Module, str]:
        wt = self.wt
        target = cache_dir / f"{key}.cwasm" if cache_dir is not None else None
        if target is not None and trusted_file(target):
            try:
                return wt.Module.deserialize_file(self.engine, str(target)), "disk"
            except wt.WasmtimeError:
                # A truncated or foreign-version file: recompile and overwrite it below.
                pass
        try:
            binary = wt.wat2wasm(data.decode("utf-8")) if source.suffix == ".wat" else data
            check_complexity(bytes(binary), source.name)
            module = wt.Module(self.engine, binary)
        except Refused as exc:
            raise SandboxDenied(str(exc)) from None
        except (wt.WasmtimeError, UnicodeDecodeError) as exc:
            # The executor's module, the same on every worker: a refusal, not a fault of
            # this host to be retried elsewhere.
            raise SandboxDenied(
                f"wasm module {source.name} is not valid WebAssembly (does not compile): {exc}"
            ) from None
        if target is not None:
            _write_atomically(target, module.serialize())
        return module, "compiled"

    def _link(
        self, module: wasmtime.Module, source: Path
    ) -> tuple[wasmtime.InstancePre | None, str]:
        """The linked module, or None and the refusal. Imports are checked first so the
        refusal names what was asked for, instead of relaying the linker's message."""
        wt = self.wt
        for imp in module.imports:
            if imp.module != WASI_P1 or imp.name is None or imp.name not in WASI_P1_FUNCS:
                return None, (
                    f"wasm module {source.name} imports `{imp.module}::{imp.name}`, which "
                    "this sandbox does not provide (WASI preview 1 only; no sockets can "
                    "be opened, connected or bound)"
                )
        if not any(e.name == "_start" and isinstance(e.type, wt.FuncType) for e in module.exports):
            return None, f"wasm module {source.name} is not a WASI command: no `_start` export"
        try:
            return self.linker.instantiate_pre(module), ""
        except wt.WasmtimeError as exc:
            # Every name was a WASI p1 function, so this is a signature mismatch.
            return None, f"wasm module {source.name} does not link: {exc}"

    def cached_keys(self) -> list[str]:
        with self._lock:
            return sorted(self._memory)

    def forget(self) -> None:
        """Drop the in-memory cache (the bench measures disk hits with it)."""
        with self._lock:
            self._memory.clear()
            self._denied.clear()
            self._source_keys.clear()

    def close(self) -> None:
        """Free the linked modules, the modules, the linker and the engine now (idempotent;
        the engine is unusable afterwards). Run for every live engine at interpreter exit
        (`close_engines`): left to their finalizers, wasmtime's objects were freed while
        the interpreter was tearing wasmtime's own modules down, and each printed
        "Exception ignored in: <function Managed.__del__ ...> TypeError".

        An engine with a compile under way is left open (and alive: the compiling thread
        holds it): a worker stopped during a cold compile abandons it on a daemon thread,
        and freeing the engine under it crashed the process in wasmtime at exit."""
        self.ticker.stop()
        with self._lock:
            if self._busy:
                return
            loaded, self._memory = list(self._memory.values()), {}
            self._denied.clear()
            self._source_keys.clear()
        for item in loaded:
            item.pre.close()
            item.module.close()
        self.linker.close()
        self.engine.close()
        _live_engines.discard(self)


#: Every engine not yet closed (weakly: a dropped engine is freed the usual way).
_live_engines: weakref.WeakSet[WasmEngine] = weakref.WeakSet()


def close_engines() -> None:
    """Close every live `WasmEngine` (see `WasmEngine.close`); registered with `atexit`,
    which runs before the interpreter starts clearing modules."""
    for engine in list(_live_engines):
        # Exiting: one engine's failure must not keep the others open.
        with contextlib.suppress(Exception):
            engine.close()


atexit.register(close_engines)


def _write_atomically(target: Path, blob: bytes) -> None:
    try:
        private_dir(target.parent)
        write_atomically(target, blob)  # the guest's process writes the cache the same way
    except OSError as exc:
        raise HostFault(f"wasm cache {target.parent}: cannot write: {exc.strerror}") from exc


def engine_info(engine: WasmEngine) -> dict[str, Any]:
    return {"version": engine.version, "flags": ENGINE_FLAGS, "cached": engine.cached_keys()}
