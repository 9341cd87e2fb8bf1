"""One pre-instantiated module (`InstancePre`) serving several jobs shares nothing between them.

A spare guest process deserializes python.wasm and links it ahead (`_wasm_guest.Ahead`:
`Linker.instantiate_pre`, then a fuel-less scratch instance so that wasmtime builds the
module's memory image); its job's store instantiates that same `InstancePre`. Here the
guest process's own code (`_wasm_guest`, imported by name without ``site`` as
`_wasm_child` does, on real wasmtime) runs several jobs through one `Ahead`: each job's
memory, globals, data segments, fuel counter, memory limit and preopens are its own
store's, whatever an earlier job through the same `InstancePre` did. The arm's own suite
(tests/sandbox/test_wasm.py) checks each budget end to end, with and without spares.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from metnos_exec.sandbox import _wasm_guest
from metnos_exec.sandbox._wasm_engine import wasmtime_version
from metnos_exec.sandbox._wasm_launch import module_key
from metnos_exec.sandbox._wasm_runtime import verified_python_wasm
from tests.conftest import need
from tests.sandbox.test_wasm import (
    HAVE_ENGINE,
    HAVE_RUNTIME,
    NO_ENGINE,
    NO_RUNTIME,
    PY_FUEL,
    WAT,
    WT,
    wasm_cache,
)

__all__ = ("wasm_cache",)

SANDBOX = Path(_wasm_guest.__file__).resolve().parent

# Runs in ``python -I -S``, like a guest's process: the standard library, wasmtime and
# this folder's `_wasm_guest` only. argv: the sandbox folder, wasmtime's folder, then a
# JSON list of {"source", "key", "jobs": [request, ...]}; prints one JSON line of
# verdicts per module.
_SERVE = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.append(sys.argv[2])
import wasmtime as wt
import _wasm_guest as guest

version, cache_dir, modules = sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
for m in modules:
    base = {"source": m["source"], "key": m["key"], "version": version, "cache_dir": cache_dir}
    engine, linker = guest.prepare(wt)
    guest.load(wt, engine, base)  # compiled into the cache if it is not there yet
    ahead = guest.Ahead(wt, m["key"], cache_dir)
    assert ahead.key == m["key"] and ahead.pre is not None, "not loaded ahead"
    verdicts = []
    for job in m["jobs"]:
        preopens = [
            [os.open(host, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), g, False]
            for host, g in job.pop("mounts", [])
        ]
        req = {**base, "argv": ["x"], "env": [], "cpu_time_s": None, **job,
               "preopens": preopens}
        out = guest.run_guest(wt, ahead.engine, ahead.module, ahead.pre, req, b"",
                              time.monotonic() + 30, {"how": "disk"})
        sys.stdout.flush()
        verdicts.append({k: out[k] for k in ("exit", "peak", "fuel")})
    print("VERDICTS " + json.dumps(verdicts), flush=True)
"""

_MARK = (
    "import builtins, os, sys\n"
    "print('seen', getattr(builtins, 'metnos_mark', None), "
    "'metnos_mod' in sys.modules, sorted(os.listdir('/data')), flush=True)\n"
    "builtins.metnos_mark = 1\n"
    "sys.modules['metnos_mod'] = sys\n"
)


def _serve(cache: Path, modules: list[dict[str, Any]]) -> tuple[list[list[Any]], list[str]]:
    assert WT is not None and WT.__file__ is not None
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            _SERVE,
            str(SANDBOX),
            str(Path(WT.__file__).resolve().parent.parent),
            wasmtime_version() or "unknown",
            str(cache),
            json.dumps(modules),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    verdicts = [json.loads(ln.split(" ", 1)[1]) for ln in lines if ln.startswith("VERDICTS ")]
    return verdicts, [ln for ln in lines if not ln.startswith("VERDICTS ")]


def test_jobs_through_one_instance_pre_share_no_memory_or_state(wasm_cache: Path) -> None:
    need(HAVE_ENGINE, NO_ENGINE)
    source = WAT / "state.wat"
    key = module_key(source, wasmtime_version() or "unknown")
    page = _wasm_guest.PAGE
    jobs = [
        {"fuel": 10_000, "memory_bytes": 4 * page},
        {"fuel": 10_000, "memory_bytes": 4 * page},
        # This job's own limit: its memory may not grow (one page), whatever others did.
        {"fuel": 10_000, "memory_bytes": page},
        # This job's own fuel: not enough to finish.
        {"fuel": 5, "memory_bytes": 4 * page},
        {"fuel": 10_000, "memory_bytes": 4 * page},
    ]
    [verdicts], _ = _serve(wasm_cache, [{"source": str(source), "key": key, "jobs": jobs}])
    fresh = {"exit": {"type": "success"}, "peak": 2 * page}
    # exit 0: nothing left behind by an earlier job (see state.wat for the bits).
    assert verdicts[0] == {**fresh, "fuel": verdicts[0]["fuel"]}
    assert verdicts[0]["fuel"] > 0
    assert verdicts[1] == verdicts[0]
    assert verdicts[2]["exit"] == {"type": "success"} and verdicts[2]["peak"] == page
    assert verdicts[3]["exit"] == {"type": "fuel_exhausted"}
    assert verdicts[4] == verdicts[0]  # neither the fuel nor the limit carried over


def test_python_jobs_through_one_instance_pre_share_no_interpreter_state(
    wasm_cache: Path, tmp_path: Path
) -> None:
    need(HAVE_RUNTIME, NO_RUNTIME)
    source = verified_python_wasm()
    key = module_key(source, wasmtime_version() or "unknown")
    folders = []
    for name in ("first", "second"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / f"{name}.txt").write_text(name)
        folders.append(folder)
    jobs = [
        {
            "argv": ["python", "-u", "-c", _MARK],
            "fuel": PY_FUEL,
            "memory_bytes": 64 * 1024 * 1024,
            "mounts": [[str(folder), "/data"]],
        }
        for folder in folders
    ]
    [verdicts], printed = _serve(wasm_cache, [{"source": str(source), "key": key, "jobs": jobs}])
    assert [v["exit"] for v in verdicts] == [{"type": "success"}] * 2, verdicts
    # Each job sees a fresh interpreter and only its own preopen.
    assert printed == [
        "seen None False ['first.txt']",
        "seen None False ['second.txt']",
    ], printed
