"""Overhead of the bwrap arm over the bare bubblewrap command (issue 2, issue 8 acceptance 5).

One native no-op Python job (`bench/_noop.py` under ``python -I -S``) is run two ways,
interleaved round by round so both see the same machine state:

* **arm**: ``BwrapSandbox().run(job)`` with every mechanism on — flag derivation, the hop
  to a pooled spawner thread (already in its pids cgroup), the pidfd wait, rlimits (set
  with prlimit(2) on the sandbox while bubblewrap holds it at ``--block-fd``, then
  released), the JSON status pipe, the seccomp filter (``--seccomp FD``, one pipe a job),
  landlock (the in-guest step before the script), bounded output, the slot's clean-up;
* **raw**: the plain bubblewrap invocation a user would write for the job
  (`derive_bwrap_argv` of the same job: its namespaces and mounts, no status fd, no
  seccomp filter, no landlock) run with ``subprocess.run``.

The ratio of medians is printed; target: arm <= 1.15 x raw (issue 8: every mechanism on;
issue 2's target for the arm without them was 1.10).

With ``--mechanisms`` four more variants join the interleaving, to show what each kernel
mechanism costs on its own: ``raw_seccomp`` (the raw argv plus the filter),
``raw_landlock`` (the raw argv behind the in-guest landlock step: its cost is
``raw_landlock - raw``), ``raw_hardened`` (both), and ``arm_bare`` (the arm with neither,
as it was before issue 8: ``arm - arm_bare`` is what the mechanisms add to the arm).

With ``--breakdown`` three more variants join the interleaving, to show where the arm's
time goes: ``raw_limits`` (the raw argv with the limits prefix the arm falls back to when
it cannot raise a hard limit -- ``sh -c 'ulimit ...; exec "$@"'`` or ``prlimit`` -- in
front of the guest, via ``subprocess.run``: what that fallback costs),
``raw_fork`` (the raw argv through ``subprocess.Popen`` with a no-op ``preexec_fn``, which
forces fork instead of vfork: what the arm paid before it stopped needing one) and
``run_process`` (that argv through `run_process` in a pooled slot with a pids
budget, no JSON status: the process layer's own cost).

Run it against this checkout (``PYTHONPATH=.``): an editable install elsewhere would
otherwise be measured.

With ``--cpu`` the CPU time of each job is measured too: this process's (every thread)
plus the job's whole tree (the benchmark is a subreaper, as the worker is, and reaps
bubblewrap's orphaned init after each run, outside the timed window): on a busy machine
it moves far less than wall time.

Usage: python bench/bwrap_noop.py [--rounds 30] [--warmup 3] [--backend asyncio|trio]
       [--json] [--breakdown] [--mechanisms] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgspec

from metnos_exec.process import ProcessSpec, become_subreaper, run_process
from metnos_exec.sandbox._types import Mount, SandboxJob, Success
from metnos_exec.sandbox.bwrap import BwrapSandbox, _host_facts, _limits_in_guest, bwrap_probe
from metnos_exec.sandbox.flags import derive_bwrap_argv, derive_rlimits, guest_python
from metnos_exec.sandbox.hardening import guest_job, host_hardening, seccomp_fd

#: Issue 8, acceptance 5: the arm with every mechanism on, against the bare command.
TARGET = 1.15

HERE = Path(__file__).resolve().parent
NOOP = HERE / "_noop.py"


def make_job() -> SandboxJob:
    """The job plan.py would build for a no-op ``python`` executor living in bench/."""
    return SandboxJob(
        argv=(guest_python(), "-I", "-S", str(NOOP)),
        stdin=b"{}",
        mounts=(Mount(str(HERE), str(HERE)),),
    )


def _noop() -> None:
    pass


def _cpu_s() -> float:
    """CPU seconds of this process (every thread) and of every child reaped so far."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _reap_all() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


async def measure(
    rounds: int,
    warmup: int,
    breakdown: bool = False,
    mechanisms: bool = False,
    cpu_too: bool = False,
) -> dict[str, object]:
    probe = bwrap_probe()
    if not probe.working:
        raise SystemExit(f"bubblewrap not usable here: {probe.error}")
    if cpu_too:
        # As `metnos-exec worker` is: bubblewrap's orphaned inits come back to us, and
        # reaping them adds the guest's CPU time to ours (RUSAGE_CHILDREN).
        become_subreaper()
    hardening = host_hardening()
    arm = BwrapSandbox()
    bare = BwrapSandbox(
        hardening=msgspec.structs.replace(
            hardening, seccomp_arch=None, seccomp="off", landlock_abi=None, landlock="off"
        )
    )
    job = make_job()
    # The same masks as the arm (a root worker also masks /etc's private files).
    _host_facts.refresh()
    masked = _host_facts.masked
    raw_argv = derive_bwrap_argv(
        job, bwrap=probe.path or "bwrap", features=probe.features, masked_paths=masked
    )
    prefix = _limits_in_guest(derive_rlimits(job.limits))  # what the arm puts in front
    limits_argv = derive_bwrap_argv(
        msgspec.structs.replace(job, argv=prefix + job.argv),
        bwrap=probe.path or "bwrap",
        features=probe.features,
        masked_paths=masked,
    )

    landlocked = guest_job(
        job,
        hardening,
        interpreter_roots=_host_facts.roots,
        exists=_host_facts.exists,
        readlink=_host_facts.readlink,
        isdir=_host_facts.isdir,
    )

    def hardened_argv(seccomp: int | None, landlock: bool) -> list[str]:
        return derive_bwrap_argv(
            landlocked if landlock else job,
            bwrap=probe.path or "bwrap",
            features=probe.features,
            masked_paths=masked,
            seccomp_fd=seccomp,
        )

    def run_raw_with(*, seccomp: bool, landlock: bool) -> bytes:
        fd = seccomp_fd(hardening) if seccomp else None
        try:
            done = subprocess.run(
                hardened_argv(fd, landlock),
                input=b"{}",
                capture_output=True,
                check=False,
                pass_fds=() if fd is None else (fd,),
            )
        finally:
            if fd is not None:
                os.close(fd)
        return done.stdout

    async def run_raw_seccomp() -> bytes:
        return run_raw_with(seccomp=True, landlock=False)

    async def run_raw_landlock() -> bytes:
        return run_raw_with(seccomp=False, landlock=True)

    async def run_raw_hardened() -> bytes:
        return run_raw_with(seccomp=True, landlock=True)

    async def run_arm() -> bytes:
        outcome = await arm.run(job)
        if outcome.exit != Success():
            raise SystemExit(f"arm run failed: {outcome}")
        return outcome.stdout

    async def run_arm_bare() -> bytes:
        outcome = await bare.run(job)
        if outcome.exit != Success():
            raise SystemExit(f"bare arm run failed: {outcome}")
        return outcome.stdout

    async def run_raw() -> bytes:
        done = subprocess.run(raw_argv, input=b"{}", capture_output=True, check=False)  # noqa: ASYNC221 - measured on purpose, blocking like a plain script would
        return done.stdout

    async def run_raw_fork() -> bytes:
        with subprocess.Popen(  # noqa: ASYNC220 - as above
            raw_argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_noop,
        ) as proc:
            out, _ = proc.communicate(b"{}")
        return out

    async def run_raw_limits() -> bytes:
        done = subprocess.run(limits_argv, input=b"{}", capture_output=True, check=False)  # noqa: ASYNC221 - as above
        return done.stdout

    async def run_rp() -> bytes:
        spec = ProcessSpec(
            argv=tuple(limits_argv),
            env={},
            stdin=b"{}",
            reaper=False,
            pdeathsig=False,
            pids_max=64,
            cgroup_pool=True,
        )
        return (await run_process(spec, timeout=30)).stdout

    variants = {"arm": run_arm, "raw": run_raw}
    if mechanisms:
        variants |= {
            "raw_seccomp": run_raw_seccomp,
            "raw_landlock": run_raw_landlock,
            "raw_hardened": run_raw_hardened,
            "arm_bare": run_arm_bare,
        }
    if breakdown:
        variants |= {
            "raw_limits": run_raw_limits,
            "raw_fork": run_raw_fork,
            "run_process": run_rp,
        }
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(warmup + rounds):
        # Rotate the order, so no variant always runs on a warmer cache.
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            c0 = _cpu_s()
            t0 = time.perf_counter()
            out = await variants[name]()
            dt = time.perf_counter() - t0
            if out != b"{}\n":
                raise SystemExit(f"{name} run printed {out!r}")
            if cpu_too:
                _reap_all()  # bubblewrap's init, orphaned to us: its rusage holds the guest's
            if i >= warmup:
                times[name].append(dt)
                cpu[name].append(_cpu_s() - c0)
    med = {name: statistics.median(v) for name, v in times.items()}
    result: dict[str, object] = {"rounds": rounds}
    for name, v in times.items():
        result[f"{name}_median_ms"] = round(med[name] * 1000, 2)
        result[f"{name}_p90_ms"] = round(statistics.quantiles(v, n=10)[-1] * 1000, 2)
    result["ratio"] = round(med["arm"] / med["raw"], 3)
    if cpu_too:
        cmed = {name: statistics.median(v) for name, v in cpu.items()}
        for name in variants:
            result[f"{name}_cpu_ms"] = round(cmed[name] * 1000, 2)
        result["cpu_ratio"] = round(cmed["arm"] / cmed["raw"], 3)
    if mechanisms:
        for name in ("raw_seccomp", "raw_landlock", "raw_hardened"):
            result[f"{name}_cost_ms"] = round((med[name] - med["raw"]) * 1000, 2)
        result["arm_over_arm_bare_ms"] = round((med["arm"] - med["arm_bare"]) * 1000, 2)
        result["arm_bare_ratio"] = round(med["arm_bare"] / med["raw"], 3)
    result["seccomp"] = hardening.seccomp
    result["landlock"] = hardening.landlock
    result["bwrap"] = probe.path
    result["bwrap_version"] = ".".join(map(str, probe.version))
    result["loadavg"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0 when the ratio meets the `TARGET`, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--breakdown", action="store_true", help="add raw_limits, raw_fork, run_process"
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="also the CPU time of each job's whole tree (and of this process), as a "
        "subreaper: steadier than wall time on a busy machine",
    )
    parser.add_argument(
        "--mechanisms",
        action="store_true",
        help="add raw_seccomp, raw_landlock, raw_hardened (each mechanism's own cost)",
    )
    args = parser.parse_args(argv)
    result = anyio.run(
        measure,
        args.rounds,
        args.warmup,
        args.breakdown,
        args.mechanisms,
        args.cpu,
        backend=args.backend,
    )
    result["backend"] = args.backend
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"bwrap no-op job, {args.rounds} interleaved rounds ({args.backend}), "
            f"load average {result['loadavg']}:"
        )
        for key, value in result.items():
            if key.endswith("_median_ms"):
                name = key.removesuffix("_median_ms")
                cpu_ms = result.get(f"{name}_cpu_ms")
                extra = "" if cpu_ms is None else f", CPU {cpu_ms} ms"
                print(f"  {name:12s} median {value} ms, p90 {result[name + '_p90_ms']} ms{extra}")
        for key, value in result.items():
            if key.endswith("_cost_ms"):
                print(f"  {key.removesuffix('_cost_ms'):12s} costs {value} ms over raw")
        if args.mechanisms:
            print(
                f"  the mechanisms add {result['arm_over_arm_bare_ms']} ms to the arm "
                f"(arm without them / raw: {result['arm_bare_ratio']})"
            )
        print(f"  arm: {result['seccomp']}; {result['landlock']}")
        if "cpu_ratio" in result:
            print(f"  CPU ratio arm/raw: {result['cpu_ratio']}")
        print(f"  ratio arm/raw: {result['ratio']}  (target <= {TARGET})")
    ratio = result["ratio"]
    assert isinstance(ratio, float)
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
