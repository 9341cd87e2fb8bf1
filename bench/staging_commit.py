"""Staging plus commit against writing directly (issue 10, acceptance 8).

One native job (``python -I -S`` under bubblewrap) creates N small files (100 bytes each)
in a fresh folder of a writable mount, for N = 1, 100 and 10,000. It runs two ways,
interleaved round by round (and the order alternated), so both see the same machine:

* **direct**: ``BwrapSandbox().run(job)`` with the folder bound read-write: the job writes
  straight into the host folder (what every bwrap job did before staging);
* **staged**: what the supervisor does for a job with a writable folder: `Staging.prepare`
  (the job's tmpfs and overlay in the staging namespace, the change stamp), the same arm
  run under ``nsenter``, then `commit` (read the upper folder, plan, check the host, the
  journal, apply, build the undo entry) and `settle` (journal removed, overlay released).
  Storing the entry in a broker (one small transaction) is not included.

The ratio of medians staged / direct is printed per N; target: <= 1.2 for N = 100. The
staged row also shows where its time goes (median per phase).

With ``--as-root`` (a root worker only) a third way joins the interleaving: **staged_root**,
the staged job with ``METNOS_SLOT_UIDS=off``, run as root as every staged job of a root
worker was before its slot's uid could be used (no idmapped clones, no ``--setuid``):
``staged / staged_root`` is what running the staged job as the slot's uid costs.

Run it against this checkout (``PYTHONPATH=.``). As root the staging helper needs no user
namespace; as another user it makes one (bubblewrap then runs one namespace deeper).

Usage: python bench/staging_commit.py [--rounds 15] [--big-rounds 5] [--sizes 1,100,10000]
       [--backend asyncio|trio] [--json] [--as-root]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from metnos_exec.identities import SLOT_UIDS_ENV
from metnos_exec.sandbox._types import Mount, SandboxJob, Success
from metnos_exec.sandbox.bwrap import BwrapSandbox, bwrap_probe
from metnos_exec.sandbox.flags import guest_python
from metnos_exec.undo.staging import OverlayRun, Staging

JOB = """\
import json, os, sys
a = json.load(sys.stdin)
d = a["dir"]
os.mkdir(d)
data = "x" * 100
for i in range(a["n"]):
    with open(f"{d}/f{i}", "w") as f:
        f.write(data)
print("{}")
"""


def make_job(script: Path, root: Path, folder: str, n: int) -> SandboxJob:
    return SandboxJob(
        argv=(guest_python(), "-I", "-S", str(script)),
        stdin=json.dumps({"dir": f"{root}/{folder}", "n": n}).encode(),
        mounts=(Mount(str(script.parent), str(script.parent)), Mount(str(root), str(root), True)),
    )


async def run_direct(arm: BwrapSandbox, job: SandboxJob) -> dict[str, float]:
    t0 = time.perf_counter()
    out = await arm.run(job)
    total = time.perf_counter() - t0
    assert isinstance(out.exit, Success), out
    return {"total": total}


async def run_staged(
    arm: BwrapSandbox, staging: Staging, job: SandboxJob, root: Path, tag: str
) -> dict[str, float]:
    t0 = time.perf_counter()
    run = await staging.prepare(
        job_id=tag,
        executor="bench",
        device="server",
        job=job,
        write_roots=(str(root),),
        write_targets=(),
        arm_stages=True,
    )
    assert isinstance(run, OverlayRun), "overlay staging is not available here"
    t1 = time.perf_counter()
    out = await arm.run(run.job)
    assert isinstance(out.exit, Success), out
    t2 = time.perf_counter()
    committed = await run.commit()
    t3 = time.perf_counter()
    await run.settle(stored=True)
    t4 = time.perf_counter()
    assert committed.entry is not None
    return {
        "total": t4 - t0,
        "prepare": t1 - t0,
        "run": t2 - t1,
        "commit": t3 - t2,
        "settle": t4 - t3,
    }


async def measure(
    sizes: list[int], rounds: int, big_rounds: int, as_root: bool = False
) -> dict[str, Any]:
    probe = bwrap_probe()
    if not probe.working:
        raise SystemExit(f"bubblewrap not usable here: {probe.error}")
    arm = BwrapSandbox()
    work = Path(tempfile.mkdtemp(prefix="metnos-bench-staging-"))
    script = work / "job" / "main.py"
    script.parent.mkdir()
    script.write_text(JOB)
    root = work / "root"
    root.mkdir()
    staging = Staging(work / "state")
    reason = await staging.start()
    if reason is not None:
        raise SystemExit(f"overlay staging is unavailable here: {reason}")
    samples: dict[tuple[int, str], list[dict[str, float]]] = {}
    modes = ("direct", "staged", "staged_root") if as_root else ("direct", "staged")
    try:
        for n in sizes:
            count = rounds if n < 10_000 else big_rounds
            # One warm-up of each (page cache, the spawner thread, the helper).
            for mode in modes:
                await _one(arm, staging, script, root, n, mode, "warm")
            for r in range(count):
                order = modes if r % 2 == 0 else modes[::-1]
                for mode in order:
                    got = await _one(arm, staging, script, root, n, mode, str(r))
                    samples.setdefault((n, mode), []).append(got)
    finally:
        await staging.aclose()
        shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"sizes": {}}
    for n in sizes:
        direct = statistics.median(s["total"] for s in samples[(n, "direct")])
        staged = samples[(n, "staged")]
        med = {k: statistics.median(s[k] for s in staged) for k in staged[0]}
        out["sizes"][n] = {
            "rounds": len(staged),
            "direct_ms": direct * 1e3,
            "staged_ms": med["total"] * 1e3,
            "ratio": med["total"] / direct,
            "phases_ms": {k: v * 1e3 for k, v in med.items() if k != "total"},
        }
        if as_root:
            as_root_s = [s["total"] for s in samples[(n, "staged_root")]]
            out["sizes"][n]["staged_root_ms"] = statistics.median(as_root_s) * 1e3
            out["sizes"][n]["slot_over_root"] = med["total"] / statistics.median(as_root_s)
            out["sizes"][n]["run_slot_over_root"] = med["run"] / statistics.median(
                s["run"] for s in samples[(n, "staged_root")]
            )
    return out


async def _one(
    arm: BwrapSandbox, staging: Staging, script: Path, root: Path, n: int, mode: str, r: str
) -> dict[str, float]:
    folder = f"{mode}-{n}-{r}"
    job = make_job(script, root, folder, n)
    try:
        if mode == "direct":
            return await run_direct(arm, job)
        if mode == "staged_root":
            # Read per job by the arm: this run as root, as before slot uids (see above).
            os.environ[SLOT_UIDS_ENV] = "off"
        return await run_staged(arm, staging, job, root, f"bench{n}{r}{os.getpid()}{mode}")
    finally:
        os.environ.pop(SLOT_UIDS_ENV, None)
        shutil.rmtree(root / folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--big-rounds", type=int, default=5, help="rounds for N >= 10,000")
    p.add_argument("--sizes", default="1,100,10000")
    p.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--as-root", action="store_true", help="also the staged job as root (a root worker)"
    )
    args = p.parse_args(argv)
    if args.as_root and os.geteuid() != 0:
        p.error("--as-root compares a root worker's two ways: run as root")
    sizes = [int(x) for x in args.sizes.split(",")]
    load = os.getloadavg()[0]
    result = anyio.run(
        measure, sizes, args.rounds, args.big_rounds, args.as_root, backend=args.backend
    )
    result["backend"] = args.backend
    result["load_1min_before"] = round(load, 2)
    result["uid"] = os.geteuid()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"backend {args.backend}, uid {os.geteuid()}, load before {load:.2f}")
    print("| files | rounds | direct | staged + commit | ratio | prepare | run | commit | settle |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, row in result["sizes"].items():
        ph = row["phases_ms"]
        print(
            f"| {n:,} | {row['rounds']} | {row['direct_ms']:.1f} ms | {row['staged_ms']:.1f} ms "
            f"| **{row['ratio']:.2f}** | {ph['prepare']:.2f} | {ph['run']:.1f} | "
            f"{ph['commit']:.2f} | {ph['settle']:.2f} |"
        )
    if args.as_root:
        print()
        print("| files | staged as the slot uid | as root | slot / root | run: slot / root |")
        print("|---|---|---|---|---|")
        for n, row in result["sizes"].items():
            print(
                f"| {n:,} | {row['staged_ms']:.1f} ms | {row['staged_root_ms']:.1f} ms | "
                f"**{row['slot_over_root']:.3f}** | {row['run_slot_over_root']:.3f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
