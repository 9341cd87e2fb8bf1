"""Latency of the wasm arm's `wasm-python` jobs next to a native CPython spawn (acceptance 7).

Measures, in one run on one machine:

* **cold compile** of python.wasm (empty cache: `Module(engine, bytes)` + serialize);
* **cache-hit load**: a fresh engine loading the serialized module from disk (what a
  restarted worker pays), and the in-memory hit every later job pays;
* **per-job latency** of a `print(1)` job through `WasmSandbox.run`, interleaved round by
  round with a native ``python -c 'print(1)'`` spawn (`anyio.run_process`, the base
  interpreter, not a pyenv shim) so both see the same machine state; medians;
* **throughput** of N jobs one at a time vs two at a time (the guest runs in a worker
  thread and wasmtime releases the GIL while it runs);
* **to main.py**: how long a no-op `wasm-python` executor (``python -u /job/main.py``, its
  folder preopened read-only) takes from the job's start to its main.py's first line
  (the guest's ``time.time()``, printed, against the host's at `WasmSandbox.run`), and
  from there to the result; and the same guest bare in this process (one `InstancePre`,
  a store per run): instantiate, instantiate -> main.py, the whole run. The part before
  main.py is what a pre-initialised python.wasm (a wizer snapshot) would have to beat;
* **profile** (unless ``--no-profile``): the same guest on engines built without fuel
  metering and without epoch interruption (each needs its own compile), the arm's
  overhead over a bare `InstancePre.instantiate` + `_start`, and the cost of `site`.

Targets: cached wasm-python job <= 1.25 x native spawn; 2 concurrent >= 1.5 x one.

With ``--spares N`` the jobs run inside `spare_processes(N)`: each is served by a guest
process started ahead (interpreter up, wasmtime imported, python.wasm deserialized); CPU
per job still counts each spare's start-up (reaped with its job).

Usage: python bench/wasm_latency.py [--rounds 25] [--jobs 20] [--no-profile]
       [--backend asyncio|trio] [--spares N] [--gap S] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from metnos_exec.errors import ToolUnavailable
from metnos_exec.sandbox._types import (
    PYTHON_WASM_MODULE,
    Mount,
    ResourceLimits,
    SandboxJob,
    Success,
    WasmProgram,
)
from metnos_exec.sandbox._wasm_engine import WasmEngine, load_wasmtime
from metnos_exec.sandbox._wasm_runtime import verified_python_wasm
from metnos_exec.sandbox.wasm import WasmSandbox

LIMITS = ResourceLimits(fuel=20_000_000_000, memory_bytes=64 * 1024 * 1024, wall_time_s=30)
NATIVE = os.path.realpath(sys.executable)


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 2)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _job(*args: str) -> SandboxJob:
    return SandboxJob(wasm=WasmProgram(PYTHON_WASM_MODULE, ("python", *args)), limits=LIMITS)


def _cpu_now() -> float:
    """CPU seconds of this process (all threads) plus its reaped children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


async def _native(*args: str) -> tuple[float, float]:
    c0, t0 = _cpu_now(), time.perf_counter()
    res = await anyio.run_process([NATIVE, *args], check=True)
    dt, dc = time.perf_counter() - t0, _cpu_now() - c0
    assert res.stdout == b"1\n"
    return dt, dc


async def _wasm(arm: WasmSandbox, job: SandboxJob) -> tuple[float, float]:
    c0, t0 = _cpu_now(), time.perf_counter()
    out = await arm.run(job)
    dt, dc = time.perf_counter() - t0, _cpu_now() - c0
    assert out.exit == Success() and out.stdout == b"1\n", (out.exit, out.stderr[-300:])
    return dt, dc


def _bare_run(wt: Any, engine: Any, pre: Any, argv: list[str], fuel: bool) -> tuple[float, int]:
    """Instantiate + `_start` with nothing of the arm around it; returns (s, fuel used)."""
    store = wt.Store(engine)
    if fuel:
        store.set_fuel(LIMITS.fuel)
    store.set_epoch_deadline(1 << 40)
    wasi = wt.WasiConfig()
    wasi.argv = argv
    sink: list[bytes] = []
    wasi.stdout_custom = sink.append
    store.set_wasi(wasi)
    t0 = time.perf_counter()
    inst = pre.instantiate(store)
    try:
        inst.exports(store)["_start"](store)
    except wt.ExitTrap as exc:
        assert exc.code == 0
    dt = time.perf_counter() - t0
    used = (LIMITS.fuel or 0) - store.get_fuel() if fuel else 0
    store.close()
    return dt, used


def _profile(wt: Any, runtime: Path, rounds: int) -> dict[str, Any]:
    """Bare guest runs on three engine configurations, interleaved round by round."""
    setups: dict[str, tuple[Any, Any, bool]] = {}
    compile_s: dict[str, float] = {}
    for name, fuel, epoch in (
        ("fuel+epoch (the arm's engine)", True, True),
        ("epoch only", False, True),
        ("neither", False, False),
    ):
        cfg = wt.Config()
        cfg.consume_fuel = fuel
        cfg.epoch_interruption = epoch
        cfg.cranelift_opt_level = "speed"
        engine = wt.Engine(cfg)
        t0 = time.perf_counter()
        module = wt.Module.from_file(engine, str(runtime))
        compile_s[name] = round(time.perf_counter() - t0, 2)
        linker = wt.Linker(engine)
        linker.define_wasi()
        setups[name] = (engine, linker.instantiate_pre(module), fuel)
    argvs = {
        "print(1)": ["python", "-u", "-c", "print(1)"],
        "-I -S print(1)": ["python", "-u", "-I", "-S", "-c", "print(1)"],
    }
    samples: dict[tuple[str, str], list[tuple[float, int]]] = {
        (n, a): [] for n in setups for a in argvs
    }
    for i in range(rounds + 1):
        for (name, label), bucket in samples.items():
            engine, pre, fuel = setups[name]
            r = _bare_run(wt, engine, pre, argvs[label], fuel)
            if i:  # the first round warms each instance-pre up
                bucket.append(r)
    out: dict[str, Any] = {}
    for name in setups:
        row: dict[str, Any] = {"compile_s": compile_s[name]}
        for label in argvs:
            runs = samples[(name, label)]
            row[label] = {"median_ms": _median_ms([r[0] for r in runs]), "fuel": runs[-1][1]}
        out[name] = row
    return out


#: The no-op executor of the to-main.py figures: its first line reads the clock.
MAIN_PY = "import time\nprint(repr(time.time()))\n"
TO_MAIN_ARGV = ["python", "-u", "/job/main.py"]


async def _to_main(arm: WasmSandbox, folder: Path, rounds: int, gap: float) -> dict[str, float]:
    """Job start -> main.py's first line -> result, through the arm (medians, ms), `gap`
    seconds apart (an agent's think time between tool calls: a spare pool refills)."""
    job = SandboxJob(
        wasm=WasmProgram(PYTHON_WASM_MODULE, tuple(TO_MAIN_ARGV)),
        mounts=(Mount(str(folder), "/job"),),
        limits=LIMITS,
    )
    before, after, guest = [], [], []
    for i in range(rounds + 1):
        await anyio.sleep(gap)
        t0 = time.time()
        out = await arm.run(job)
        t1 = time.time()
        assert out.exit == Success(), (out.exit, out.stderr[-300:])
        at_main = float(out.stdout)
        if i:  # the first one warms the path up
            before.append(at_main - t0)
            after.append(t1 - at_main)
            guest.append(out.usage.wall_s)  # instantiate -> exit, in the guest's process
    return {
        "start_to_main_ms": _median_ms(before),
        "main_to_result_ms": _median_ms(after),
        "guest_run_ms": _median_ms(guest),
    }


def _bare_to_main(
    wt: Any, engine: Any, linked: tuple[Any, Any, Any], folder: Path, rounds: int
) -> dict[str, float]:
    """The same guest in this process, a fresh store per run through one `InstancePre`
    (`linked`: the linker, the module and its `InstancePre`): instantiate, instantiate ->
    main.py's first line, the whole run; and, alternating with it, the instantiation
    through `Linker.instantiate` (the imports resolved again each time) (medians, ms)."""
    linker, module, pre = linked
    inst_s, to_main, whole, relinked = [], [], [], []
    for i in range(2 * rounds + 2):
        by_linker = i % 2 == 1
        store = wt.Store(engine)
        store.set_fuel(LIMITS.fuel)
        store.set_epoch_deadline(1 << 40)
        wasi = wt.WasiConfig()
        wasi.argv = TO_MAIN_ARGV
        sink: list[bytes] = []
        wasi.stdout_custom = sink.append
        wasi.preopen_dir(str(folder), "/job", False)
        store.set_wasi(wasi)
        t0, p0 = time.time(), time.perf_counter()
        inst = linker.instantiate(store, module) if by_linker else pre.instantiate(store)
        p1 = time.perf_counter()
        try:
            inst.exports(store)["_start"](store)
        except wt.ExitTrap as exc:
            assert exc.code == 0
        p2 = time.perf_counter()
        store.close()
        if i < 2:  # the first of each warms it up
            continue
        if by_linker:
            relinked.append(p1 - p0)
        else:
            inst_s.append(p1 - p0)
            to_main.append(float(b"".join(sink)) - t0)
            whole.append(p2 - p0)
    return {
        "instantiate_ms": _median_ms(inst_s),
        "linker_instantiate_ms": _median_ms(relinked),
        "instantiate_to_main_ms": _median_ms(to_main),
        "whole_run_ms": _median_ms(whole),
    }


async def _throughput(arm: WasmSandbox, jobs: int) -> dict[str, float]:
    job = _job("-c", "print(1)")
    t0 = time.perf_counter()
    for _ in range(jobs):
        await _wasm(arm, job)
    one = jobs / (time.perf_counter() - t0)
    limiter = anyio.CapacityLimiter(2)

    async def worker() -> None:
        async with limiter:
            await _wasm(arm, job)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(jobs):
            tg.start_soon(worker)
    two = jobs / (time.perf_counter() - t0)
    return {
        "jobs": jobs,
        "one_at_a_time_per_s": round(one, 1),
        "two_at_a_time_per_s": round(two, 1),
        "ratio": round(two / one, 2),
    }


async def _latency(arm: WasmSandbox, rounds: int, warmup: int) -> dict[str, Any]:
    plain = _job("-c", "print(1)")
    lean = _job("-I", "-S", "-c", "print(1)")
    names = (
        "wasm-python print(1)",
        "wasm-python -I -S print(1)",
        "native python -c print(1)",
        "native python -I -S -c print(1)",
    )
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for i in range(warmup + rounds):
        # Interleaved: each round measures every variant once, back to back.
        r = (
            await _wasm(arm, plain),
            await _wasm(arm, lean),
            await _native("-c", "print(1)"),
            await _native("-I", "-S", "-c", "print(1)"),
        )
        if i >= warmup:
            for key, (w, c) in zip(names, r, strict=True):
                wall[key].append(w)
                cpu[key].append(c)
    med = {k: _median_ms(v) for k, v in wall.items()}
    cmed = {k: _median_ms(v) for k, v in cpu.items()}
    return {
        "rounds": rounds,
        "median_ms": med,
        "median_cpu_ms": cmed,
        "ratio_plain": round(med[names[0]] / med[names[2]], 2),
        "ratio_lean": round(med[names[1]] / med[names[3]], 2),
        "cpu_ratio_plain": round(cmed[names[0]] / cmed[names[2]], 2),
        "cpu_ratio_lean": round(cmed[names[1]] / cmed[names[3]], 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wasm_latency", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--jobs", type=int, default=20, help="jobs per throughput measurement")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    p.add_argument("--spares", type=int, default=0, help="spare guest processes kept ready")
    p.add_argument("--gap", type=float, default=0.0, help="seconds between the to-main.py jobs")
    p.add_argument("--json", action="store_true")
    opts = p.parse_args(argv)

    wt = load_wasmtime()
    if wt is None:
        print("wasm_latency: wasmtime is not installed (install metnos-exec[wasm])")
        return 2
    try:
        runtime = verified_python_wasm()
    except ToolUnavailable as exc:
        print(f"wasm_latency: {exc}")
        return 2

    report: dict[str, Any] = {
        "spares": opts.spares,
        "gap": opts.gap,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
        "native": NATIVE,
    }
    with tempfile.TemporaryDirectory(prefix="metnos-wasm-bench-") as tmp:
        cache = Path(tmp) / "cache"
        rss0 = _rss_mb()
        engine = WasmEngine(wt)
        cold = engine.load(runtime, cache)
        assert cold.source == "compiled"
        report["cold_compile"] = {
            "seconds": round(cold.seconds, 2),
            "max_rss_growth_mb": round(_rss_mb() - rss0, 1),
            "serialized_mb": round(sum(f.stat().st_size for f in cache.iterdir()) / 2**20, 1),
        }
        disk, mem = [], []
        hit = None
        for _ in range(5):
            fresh = WasmEngine(wt)  # a restarted worker: new engine, same config
            hit = fresh.load(runtime, cache)
            assert hit.source == "disk"
            disk.append(hit.seconds)
            again = fresh.load(runtime, cache)
            assert again.source == "memory"
            mem.append(again.seconds)
        report["cache_hit_load_ms"] = {"disk": _median_ms(disk), "memory": _median_ms(mem)}
        folder = Path(tmp) / "job"
        folder.mkdir()
        (folder / "main.py").write_text(MAIN_PY)
        assert hit is not None
        report["bare_to_main"] = _bare_to_main(
            wt, fresh.engine, (fresh.linker, hit.module, hit.pre), folder, opts.rounds
        )

        arm = WasmSandbox(cache_dir=cache)

        async def measure() -> None:
            async with contextlib.AsyncExitStack() as stack:
                if opts.spares:
                    from metnos_exec.sandbox.wasm import spare_processes

                    await stack.enter_async_context(spare_processes(opts.spares, cache_dir=cache))
                report["latency"] = await _latency(arm, opts.rounds, opts.warmup)
                report["throughput"] = await _throughput(arm, opts.jobs)
                report["to_main"] = await _to_main(arm, folder, opts.rounds, opts.gap)

        anyio.run(measure, backend=opts.backend)
        if not opts.no_profile:
            report["profile"] = _profile(wt, runtime, opts.rounds)
    report["machine"]["loadavg_after"] = os.getloadavg()
    lat, thr = report["latency"], report["throughput"]
    report["targets"] = {
        "cached_job_vs_native<=1.25": lat["ratio_plain"] <= 1.25,
        "two_concurrent>=1.5x": thr["ratio"] >= 1.5,
    }
    if opts.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0


def _print(r: dict[str, Any]) -> None:
    print(f"machine: {r['machine']}; spares: {r['spares']}")
    c = r["cold_compile"]
    print(
        f"cold compile of python.wasm: {c['seconds']} s, max RSS +{c['max_rss_growth_mb']} MB, "
        f"serialized {c['serialized_mb']} MB"
    )
    h = r["cache_hit_load_ms"]
    print(f"cache-hit load: disk {h['disk']} ms, memory {h['memory']} ms")
    lat = r["latency"]
    print(f"per-job latency (median of {lat['rounds']}, interleaved):")
    for k, v in lat["median_ms"].items():
        print(f"  {k:34s} {v:8.2f} ms wall {lat['median_cpu_ms'][k]:8.2f} ms cpu")
    print(
        f"  ratio wasm/native: wall {lat['ratio_plain']} (plain), {lat['ratio_lean']} (-I -S); "
        f"cpu {lat['cpu_ratio_plain']} (plain), {lat['cpu_ratio_lean']} (-I -S)"
    )
    t = r["throughput"]
    print(
        f"throughput ({t['jobs']} jobs): 1 at a time {t['one_at_a_time_per_s']}/s, "
        f"2 at a time {t['two_at_a_time_per_s']}/s, ratio {t['ratio']}"
    )
    b, m = r["bare_to_main"], r["to_main"]
    print(
        f"no-op main.py through the arm ({r['gap']} s apart): job start -> main.py "
        f"{m['start_to_main_ms']} ms, main.py -> result {m['main_to_result_ms']} ms "
        f"(the guest's run in its process, instantiate -> exit: {m['guest_run_ms']} ms)"
    )
    print(
        f"the same guest bare (one InstancePre, a store per run): instantiate "
        f"{b['instantiate_ms']} ms (Linker.instantiate: {b['linker_instantiate_ms']} ms), "
        f"instantiate -> main.py {b['instantiate_to_main_ms']} ms, "
        f"whole run {b['whole_run_ms']} ms"
    )
    if "profile" in r:
        print("profile (bare instantiate + _start, no arm):")
        for name, row in r["profile"].items():
            print(
                f"  {name}: compile {row['compile_s']} s; "
                + "; ".join(
                    f"{k} {v['median_ms']} ms ({v['fuel']} fuel)"
                    for k, v in row.items()
                    if isinstance(v, dict)
                )
            )
    print(f"targets: {r['targets']}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
