"""The wasm guest inside its process: the module's checks, load and link, its store and run.

Loaded by the guest's process (`_wasm_child`) from this folder, by name, and imported by
the arm and `_wasm_engine` as `metnos_exec.sandbox._wasm_guest` for what they share with
that process (engine flags, the WASI p1 function list, the complexity bound, the cache
key and file checks, the store limits): the standard library and wasmtime only, never
the `metnos_exec` package, and nothing imported from this folder at the top (the
process puts it on its path itself; `_wasm_poll` is imported where it is used).

`run_guest` is one job's run once its module is loaded and linked: the store with its
fuel and limits, the WASI context with the job's preopens, the epoch deadline and the
CPU backstop, then the usage it measured, as the verdict's fields.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import resource
import stat
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Final

#: Seconds between two epoch ticks. The timeout and cancellation latency is one tick.
EPOCH_TICK_S: Final = 0.01
#: The engine configuration, spelled out because it is part of the disk-cache key: a
#: module compiled with fuel metering is different machine code from one without.
ENGINE_FLAGS: Final = "consume_fuel=1;epoch_interruption=1;opt=speed"
#: The largest module file loaded (python.wasm is 26 MB). A bigger one is refused from
#: its size, before a byte is read: a 1 GB file cost the worker 2.1 GB and 7 s.
MAX_MODULE_BYTES: Final = 256 * 1024 * 1024
#: Locals a function may declare. Cranelift's register allocation is superlinear in the
#: values live across a loop: a 0.4 MB module of two functions with tens of thousands of
#: locals each compiled for 52-64 s (measured here: 2,000 locals 0.08 s, 8,000 1.0 s,
#: 20,000 15 s). python.wasm's largest function has 187. Over the bound, the module is
#: refused before it is compiled; under it, the compile counts against the job's wall
#: time and ends with the job.
MAX_FUNCTION_LOCALS: Final = 4096
#: The only import module a WASI preview 1 guest may link against.
WASI_P1: Final = "wasi_snapshot_preview1"
#: Store limits set for every job (see `metnos_exec.sandbox.wasm`).
MAX_TABLE_ELEMENTS: Final = 1 << 20
MAX_TABLES: Final = 4
MAX_ELEMENTS_PER_TABLE: Final = MAX_TABLE_ELEMENTS // MAX_TABLES
TABLE_STEP: Final = 65536
PAGE: Final = 65536
#: Fuel given to a job without a fuel budget; the counter still runs so usage is honest.
UNMETERED_FUEL: Final = 2**63 - 1

#: Every function wasmtime's WASI preview 1 implementation defines. Socket *creation*
#: (`sock_open`, `sock_connect`, `sock_bind`, `sock_listen`) is absent on purpose upstream,
#: so a guest importing one fails to link with `E_SANDBOX_DENIED`.
WASI_P1_FUNCS: Final = frozenset(
    [
        "args_get",
        "args_sizes_get",
        "environ_get",
        "environ_sizes_get",
        "clock_res_get",
        "clock_time_get",
        "fd_advise",
        "fd_allocate",
        "fd_close",
        "fd_datasync",
        "fd_fdstat_get",
        "fd_fdstat_set_flags",
        "fd_fdstat_set_rights",
        "fd_filestat_get",
        "fd_filestat_set_size",
        "fd_filestat_set_times",
        "fd_pread",
        "fd_prestat_get",
        "fd_prestat_dir_name",
        "fd_pwrite",
        "fd_read",
        "fd_readdir",
        "fd_renumber",
        "fd_seek",
        "fd_sync",
        "fd_tell",
        "fd_write",
        "path_create_directory",
        "path_filestat_get",
        "path_filestat_set_times",
        "path_link",
        "path_open",
        "path_readlink",
        "path_remove_directory",
        "path_rename",
        "path_symlink",
        "path_unlink_file",
        "poll_oneoff",
        "proc_exit",
        "proc_raise",
        "sched_yield",
        "random_get",
        "sock_accept",
        "sock_recv",
        "sock_send",
        "sock_shutdown",
    ]
)


class Refused(Exception):
    """The module is refused (the executor's fault: `E_SANDBOX_DENIED` in the arm)."""


# --- shared with the arm and `_wasm_engine` --------------------------------------------


def cache_key(data: bytes, version: str) -> str:
    """sha256(module bytes, wasmtime version, engine flags, machine), 40 hex digits."""
    import hashlib  # here: the guest's process needs it only on a compile
    import platform

    h = hashlib.sha256()
    h.update(data)
    h.update(b"\0" + version.encode())
    h.update(b"\0" + ENGINE_FLAGS.encode())
    h.update(b"\0" + platform.machine().encode())
    return h.hexdigest()[:40]


def trusted_file(path: Path) -> bool:
    """True when `path` and its folder are ours and nobody else can write them: a
    serialized module is machine code, and `Module.deserialize_file` trusts it."""
    try:
        dst = path.parent.stat()
        fst = path.stat()
    except OSError:
        return False
    uid = os.getuid()
    for st in (dst, fst):
        if st.st_uid != uid or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return False
    return stat.S_ISREG(fst.st_mode)


def write_atomically(target: Path, blob: bytes) -> None:
    """Write `blob` to `target` through a temporary file and a rename (raises OSError)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".cwasm")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _leb(data: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= len(data):
            raise Refused("truncated")
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, i
        if shift > 35:
            raise Refused("malformed LEB128")


def check_complexity(binary: bytes, name: str) -> None:
    """Refuse a module with a function over `MAX_FUNCTION_LOCALS` locals, from its code
    section alone (~10 ms for python.wasm), before anything is compiled.

    Raises:
        Refused: a function declares too many locals.
    """
    if binary[:4] != b"\0asm":
        return  # not a binary: the compiler says what is wrong with it
    try:
        i = 8
        while i < len(binary):
            section = binary[i]
            size, i = _leb(binary, i + 1)
            end = i + size
            if section == 10:  # the code section
                count, j = _leb(binary, i)
                for index in range(count):
                    body, j = _leb(binary, j)
                    body_end = j + body
                    groups, k = _leb(binary, j)
                    total = 0
                    for _ in range(groups):
                        n, k = _leb(binary, k)
                        k += 1  # the value type
                        total += n
                        if total > MAX_FUNCTION_LOCALS:
                            raise Refused(
                                f"wasm module {name}: function {index} declares more than "
                                f"{MAX_FUNCTION_LOCALS} locals (MAX_FUNCTION_LOCALS); such a "
                                "module can take minutes to compile"
                            )
                    j = body_end
                return
            i = end
    except Refused as exc:
        if str(exc) in ("truncated", "malformed LEB128"):
            return  # malformed: the compiler refuses it with its own message
        raise


# --- the guest ----------------------------------------------------------------------------


def _engine(wt: ModuleType) -> Any:
    config = wt.Config()
    config.consume_fuel = True
    config.epoch_interruption = True
    config.cranelift_opt_level = "speed"
    return wt.Engine(config)


def load(wt: ModuleType, engine: Any, req: dict[str, Any]) -> tuple[Any, str]:
    """The module, from the disk cache or compiled (and then cached)."""
    source = Path(req["source"])
    cache_dir = Path(req["cache_dir"])
    target = cache_dir / f"{req['key']}.cwasm"
    if trusted_file(target):
        try:
            return wt.Module.deserialize_file(engine, str(target)), "disk"
        except wt.WasmtimeError:
            pass  # a truncated or foreign file: recompile and overwrite it below
    try:
        with source.open("rb") as f:
            data = f.read(MAX_MODULE_BYTES + 1)
    except OSError as exc:
        raise OSError(f"wasm module {source}: cannot read: {exc.strerror}") from exc
    if len(data) > MAX_MODULE_BYTES:
        raise Refused(
            f"wasm module {source.name}: over the {MAX_MODULE_BYTES} bytes a module may have"
        )
    if cache_key(data, req["version"]) != req["key"]:
        raise OSError(f"wasm module {source}: changed while the job was starting")
    try:
        binary = wt.wat2wasm(data.decode("utf-8")) if source.suffix == ".wat" else data
    except (wt.WasmtimeError, UnicodeDecodeError) as exc:
        raise Refused(
            f"wasm module {source.name} is not valid WebAssembly (does not compile): {exc}"
        ) from None
    check_complexity(bytes(binary), source.name)
    try:
        module = wt.Module(engine, binary)
    except wt.WasmtimeError as exc:
        raise Refused(
            f"wasm module {source.name} is not valid WebAssembly (does not compile): {exc}"
        ) from None
    write_atomically(target, module.serialize())
    return module, "compiled"


def link(wt: ModuleType, linker: Any, module: Any, name: str) -> Any:
    """The linked module. Imports are checked first so the refusal names what was asked
    for, instead of relaying the linker's message."""
    for imp in module.imports:
        if imp.module != WASI_P1 or imp.name is None or imp.name not in WASI_P1_FUNCS:
            raise Refused(
                f"wasm module {name} imports `{imp.module}::{imp.name}`, which this "
                "sandbox does not provide (WASI preview 1 only; no sockets can be opened, "
                "connected or bound)"
            )
    if not any(e.name == "_start" and isinstance(e.type, wt.FuncType) for e in module.exports):
        raise Refused(f"wasm module {name} is not a WASI command: no `_start` export")
    try:
        return linker.instantiate_pre(module)
    except wt.WasmtimeError as exc:
        raise Refused(f"wasm module {name} does not link: {exc}") from None


class _Stop:
    """Why the guest must stop now (``timeout`` / ``cpu``), or None; sticky."""

    def __init__(self, deadline: float, cpu_s: float | None) -> None:
        self.deadline = deadline
        self.cpu_s = cpu_s
        self.cpu0 = time.thread_time()
        self.stopped_by: str | None = None

    def __call__(self) -> str | None:
        if self.stopped_by is None:
            if time.monotonic() >= self.deadline:
                self.stopped_by = "timeout"
            elif self.cpu_s is not None and time.thread_time() - self.cpu0 >= self.cpu_s:
                self.stopped_by = "cpu"
        return self.stopped_by


def _install_deadline(wt: ModuleType, store: Any, stop: _Stop) -> Any:
    """The store's epoch-deadline callback (wasmtime C API, via wasmtime-py's bindings;
    wasmtime-py has no public wrapper). It runs on the guest's own thread at each tick.
    Returned: the caller keeps it referenced while the store lives."""
    ffi = wt._bindings
    proto = ffi._wasmtime_store_epoch_deadline_callback.argtypes[1]

    def on_deadline(_ctx: Any, _data: Any, delta: Any, kind: Any) -> int:
        if stop() is None:
            delta[0] = 1
            kind[0] = 0  # WASMTIME_UPDATE_DEADLINE_CONTINUE
            return 0
        err = ffi.wasmtime_error_new(f"metnos: guest stopped ({stop.stopped_by})".encode())
        return int(ctypes.cast(err, ctypes.c_void_p).value or 0)

    callback = proto(on_deadline)
    finalizer = ffi._wasmtime_store_epoch_deadline_callback.argtypes[3]()
    ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), callback, None, finalizer)
    # With epoch interruption on, a store without a deadline stops at once.
    store.set_epoch_deadline(1)
    return callback


def _set_stdin(wt: ModuleType, wasi: Any, data: bytes) -> None:
    """Feed `data` as the guest's stdin from memory (`wasi_config_set_stdin_bytes`)."""
    ffi = wt._bindings
    vec = ffi.wasm_byte_vec_t()
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    ffi.wasm_byte_vec_new(ctypes.byref(vec), len(data), buf)  # copies; the config owns it
    ffi.wasi_config_set_stdin_bytes(wasi.ptr(), ctypes.byref(vec))


def _exit_of(wt: ModuleType, exc: BaseException, stop: _Stop) -> dict[str, Any]:
    if isinstance(exc, wt.ExitTrap):
        return {"type": "success"} if exc.code == 0 else {"type": "failure", "code": exc.code}
    if stop.stopped_by == "cpu":
        return {"type": "cpu"}
    if isinstance(exc, wt.Trap):
        # Classify by trap code, never by message.
        if exc.trap_code == wt.TrapCode.OUT_OF_FUEL:
            return {"type": "fuel_exhausted"}
        if exc.trap_code == wt.TrapCode.INTERRUPT or stop.stopped_by is not None:
            return {"type": "timeout"}
        return {"type": "trap", "message": exc.message[:1000]}
    if stop.stopped_by is not None:
        return {"type": "timeout"}
    # wasmtime reports `proc_exit(n)` with n >= 126 as a plain error without the code.
    return {"type": "trap", "message": f"guest ended with an engine error: {exc}"[:1000]}


def _ticker(engine: Any) -> None:
    while True:
        time.sleep(EPOCH_TICK_S)
        engine.increment_epoch()


def prepare(wt: ModuleType) -> tuple[Any, Any]:
    """The engine and a linker with WASI p1 (and the arm's `poll_oneoff`) defined."""
    from _wasm_poll import install_poll_oneoff  # type: ignore[import-not-found]

    engine = _engine(wt)
    linker = wt.Linker(engine)
    linker.define_wasi()
    install_poll_oneoff(wt, linker, WASI_P1)
    return engine, linker


class Ahead:
    """What a spare process made ready before its job: the engine, the linker and, for
    the module named at its start (the worker's python.wasm), the module deserialized
    from the disk cache and linked. Only guest-independent state: no store, no instance,
    no WASI context exists before the job (randomness is the guest's own `random_get`,
    from the host's getrandom, at its start)."""

    def __init__(self, wt: ModuleType, key: str | None, cache_dir: str | None) -> None:
        self.engine, self.linker = prepare(wt)
        self.key: str | None = None
        self.module: Any = None
        self.pre: Any = None
        if key is not None and cache_dir is not None:
            target = Path(cache_dir) / f"{key}.cwasm"
            if trusted_file(target):  # the same check a job's load makes
                try:
                    self.module = wt.Module.deserialize_file(self.engine, str(target))
                    self.pre = link(wt, self.linker, self.module, target.name)
                    self.key = key
                except (wt.WasmtimeError, Refused):
                    self.module = self.pre = None  # the job loads it as a fresh process does
                else:
                    _prefault(target)
                    # A scratch instance in a scratch store without fuel (not one guest
                    # instruction can run in it), dropped at once: wasmtime
                    # builds the module's memory image at the first instantiation, which the
                    # job's own store then maps. No guest code runs; nothing of it is seen.
                    scratch = wt.Store(self.engine)
                    scratch.set_epoch_deadline(1 << 40)
                    with contextlib.suppress(wt.WasmtimeError, wt.Trap):
                        self.pre.instantiate(scratch)
                    del scratch


def _prefault(target: Path) -> None:
    """Map in now the pages of `target` (the serialized module) this process maps: a
    fresh process faulted 30 MB of python.wasm's code in during the guest's start-up.
    ``MADV_POPULATE_READ`` (Linux 5.14); where it is refused, nothing is lost."""
    # A prototype of its own (this script cannot import `metnos_exec._libc`, whose
    # reason it shares): int madvise(void *addr, size_t length, int advice).
    madvise = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, use_errno=True
    )(("madvise", ctypes.CDLL(None, use_errno=True)))
    name = str(target)
    try:
        with open("/proc/self/maps") as f:
            lines = [ln for ln in f if ln.rstrip().endswith(name)]
    except OSError:
        return
    for ln in lines:
        lo, _, hi = ln.split(" ", 1)[0].partition("-")
        madvise(int(lo, 16), int(hi, 16) - int(lo, 16), 22)  # MADV_POPULATE_READ


def run_guest(
    wt: ModuleType,
    engine: Any,
    module: Any,
    pre: Any,
    req: dict[str, Any],
    stdin: bytes,
    deadline: float,
    loaded: dict[str, Any],
) -> dict[str, Any]:
    """Run the loaded and linked module (`pre`) to its end: the verdict's fields (its
    exit and usage, `loaded` saying how the module was loaded)."""
    from _wasm_poll import bind_stop_check

    memory_bytes: int | None = req["memory_bytes"]
    if _over_the_limit_at_start(wt, module, memory_bytes):
        return {"exit": {"type": "memory_exceeded"}, "wall_s": 0.0, "cpu_s": 0.0, "fuel": 0}

    store = wt.Store(engine)
    fuel = req["fuel"] if req["fuel"] is not None else UNMETERED_FUEL
    store.set_fuel(fuel)
    store.set_limits(
        memory_size=-1 if memory_bytes is None else memory_bytes,
        table_elements=MAX_ELEMENTS_PER_TABLE,
        instances=1,
        tables=MAX_TABLES,
        memories=1,
    )
    store.set_wasi(_wasi_config(wt, req, stdin))
    for fd, _guest, _writable in req["preopens"]:
        os.close(fd)  # wasmtime holds its own descriptor of each folder now
    cpu_s: float | None = req["cpu_time_s"]
    if cpu_s is not None:
        _limit_cpu(cpu_s)
    stop = _Stop(deadline, cpu_s)
    callback = _install_deadline(wt, store, stop)
    bind_stop_check(stop)
    threading.Thread(target=_ticker, args=(engine,), daemon=True).start()

    instance = None
    t0 = time.monotonic()
    cpu0 = time.thread_time()
    try:
        instance = pre.instantiate(store)
        start = instance.exports(store)["_start"]
        start(store)
        exit_: dict[str, Any] = {"type": "success"}
    except (wt.ExitTrap, wt.Trap, wt.WasmtimeError) as exc:
        exit_ = _exit_of(wt, exc, stop)
    wall = time.monotonic() - t0
    cpu = time.thread_time() - cpu0

    remaining = store.get_fuel()
    # When the deadline callback stops a guest, compiled code has not written its fuel
    # counter back (a tight loop reads as 0 consumed): only a lower bound, so unknown.
    consumed = None if exit_["type"] in ("timeout", "cpu") else fuel - remaining
    peak, tables = _sizes(wt, store, instance)
    del callback
    return {
        "exit": exit_,
        "wall_s": wall,
        "cpu_s": cpu,
        "peak": peak,
        "tables": tables,
        "fuel": consumed,
        "loaded": loaded,
    }


def _over_the_limit_at_start(wt: ModuleType, module: Any, memory_bytes: int | None) -> bool:
    """True when the module's initial memory (or table) is over the limit."""
    for exp in module.exports:
        ty = exp.type
        # A module whose initial memory (or table) is over the limit can not even be
        # instantiated: that is the limit speaking, decided from the module's own type.
        if (
            isinstance(ty, wt.MemoryType)
            and memory_bytes is not None
            and ty.limits.min * PAGE > memory_bytes
        ) or (isinstance(ty, wt.TableType) and ty.limits.min > MAX_ELEMENTS_PER_TABLE):
            return True
    return False


def _wasi_config(wt: ModuleType, req: dict[str, Any], stdin: bytes) -> Any:
    """The job's WASI context: its argv and environment, `stdin` from memory, this
    process's stdout and stderr, and its preopens."""
    wasi = wt.WasiConfig()
    wasi.argv = req["argv"]
    wasi.env = [tuple(kv) for kv in req["env"]]
    _set_stdin(wt, wasi, stdin)
    wasi.inherit_stdout()
    wasi.inherit_stderr()
    for fd, guest, writable in req["preopens"]:
        # The folder the arm opened (no symlink on its way), through the magic link: the
        # inode `fd` holds, whatever now stands at its path.
        wasi.preopen_dir(f"/proc/self/fd/{fd}", guest, writable)
    return wasi


def _limit_cpu(cpu_s: float) -> None:
    """The backstop for CPU burnt where no epoch check runs (host calls): the kernel's
    SIGXCPU, one second past the budget, counted from here (the load is not the
    guest's); the epoch callback stops a guest in wasm code at the budget itself."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(used.ru_utime + used.ru_stime + cpu_s) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(
        resource.RLIMIT_CPU,
        (soft, soft + 1 if hard == resource.RLIM_INFINITY else min(soft + 1, hard)),
    )


def _sizes(wt: ModuleType, store: Any, instance: Any) -> tuple[int | None, list[int]]:
    """The guest's peak linear memory (it never shrinks) and its exported tables' sizes."""
    peak: int | None = None
    tables: list[int] = []
    if instance is not None:
        exports = instance.exports(store)
        memory = exports.get("memory")
        if isinstance(memory, wt.Memory):
            peak = memory.data_len(store)  # linear memory never shrinks: its peak
        tables = [t.size(store) for t in exports.values() if isinstance(t, wt.Table)]
    return peak, tables
