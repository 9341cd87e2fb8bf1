"""What a root worker pays to run each job as its slot's own uid (issue 8, defect 1).

One native no-op job (`bench/_noop.py`, as `bwrap_noop.py` runs it) three ways, interleaved
round by round (the order rotated) so all see the same machine state:

* **slot**: ``BwrapSandbox().run(job)`` as a root worker runs it now: the slot's thread
  switches to the slot's uid for the fork, the job's folders are idmapped clones attached
  and detached around the run, the limits are set at the block fd from that uid;
* **root**: the same with ``METNOS_SLOT_UIDS=off`` (the job runs as root, as before);
* **raw**: the arm's bubblewrap argv run with ``subprocess.run``.

With ``--staged`` two more ways join: the same job with a writable folder (an empty one),
so its writes are staged as the supervisor stages them (`Staging.prepare`, the arm's run,
`discard`; nothing to commit):

* **staged_slot**: as its slot's uid (the overlays on idmapped lower layers, the job's
  other folders idmapped by the staging helper, bubblewrap dropped to the slot's uid by
  ``nsenter`` inside the staging namespace);
* **staged_root**: with ``METNOS_SLOT_UIDS=off``, as root (as every staged job of a root
  worker ran before).

Prints the medians and the ratios slot/root and slot/raw (and staged_slot/staged_root,
staged_slot/raw). Needs root (a slot uid is a root worker's); run it against this
checkout (``PYTHONPATH=.``).

Usage: python bench/slot_uids.py [--rounds 60] [--warmup 3] [--backend asyncio|trio]
       [--staged]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import msgspec

from metnos_exec.identities import SLOT_UIDS_ENV
from metnos_exec.sandbox._types import Mount, Success
from metnos_exec.sandbox.bwrap import BwrapSandbox, _host_facts, bwrap_probe
from metnos_exec.sandbox.flags import derive_bwrap_argv
from metnos_exec.undo.staging import OverlayRun, Staging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwrap_noop import make_job


async def measure(rounds: int, warmup: int, staged: bool = False) -> dict[str, float]:
    if os.geteuid() != 0:
        raise SystemExit("slot uids are a root worker's: run this as root")
    probe = bwrap_probe()
    if not probe.working:
        raise SystemExit(f"bubblewrap not usable here: {probe.error}")
    arm = BwrapSandbox()
    job = make_job()
    _host_facts.refresh()
    raw = derive_bwrap_argv(
        job, bwrap=probe.path or "bwrap", features=probe.features, masked_paths=_host_facts.masked
    )

    work = Path(tempfile.mkdtemp(prefix="metnos-bench-slot-"))
    folder = work / "out"
    folder.mkdir()
    staged_job = msgspec.structs.replace(
        job, mounts=(*job.mounts, Mount(str(folder), str(folder), writable=True))
    )
    staging = Staging(work / "state")
    runs = 0

    async def run(mode: str) -> None:
        nonlocal runs
        if mode == "raw":
            subprocess.run(raw, input=job.stdin, capture_output=True, check=True)  # noqa: ASYNC221 - measured on purpose
            return
        if mode in ("root", "staged_root"):
            os.environ[SLOT_UIDS_ENV] = "off"
        else:
            os.environ.pop(SLOT_UIDS_ENV, None)
        if mode.startswith("staged"):
            runs += 1
            reversible = await staging.prepare(
                job_id=f"bench{runs}",
                executor="noop",
                device="server",
                job=staged_job,
                write_roots=(str(folder),),
                write_targets=(),
                arm_stages=True,
            )
            if not isinstance(reversible, OverlayRun):
                raise SystemExit(f"not staged: {staging.unavailable}")
            try:
                outcome = await arm.run(reversible.job)
            finally:
                await reversible.discard()
        else:
            outcome = await arm.run(job)
        if outcome.exit != Success():
            raise SystemExit(f"{mode} run failed: {outcome}")
        if mode.startswith("staged") and ("host uid" in outcome.containment.user.reason) != (
            mode == "staged_slot"
        ):
            raise SystemExit(f"{mode} ran as the wrong uid: {outcome.containment.user}")

    names = ["slot", "root", "raw", *(("staged_slot", "staged_root") if staged else ())]
    times: dict[str, list[float]] = {name: [] for name in names}
    saved = os.environ.get(SLOT_UIDS_ENV)
    try:
        for i in range(warmup + rounds):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                await run(name)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    finally:
        if saved is None:
            os.environ.pop(SLOT_UIDS_ENV, None)
        else:
            os.environ[SLOT_UIDS_ENV] = saved
        await staging.aclose()
        shutil.rmtree(work, ignore_errors=True)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--staged", action="store_true", help="also a staged job, both ways")
    ns = parser.parse_args(argv)
    medians = anyio.run(measure, ns.rounds, ns.warmup, ns.staged, backend=ns.backend)
    print(
        f"bwrap no-op job, {ns.rounds} interleaved rounds ({ns.backend}), "
        f"load average {os.getloadavg()}:"
    )
    for name, value in medians.items():
        print(f"  {name:11} median {value * 1000:.2f} ms")
    print(
        f"  slot/root {medians['slot'] / medians['root']:.3f}  "
        f"slot/raw {medians['slot'] / medians['raw']:.3f}"
    )
    if ns.staged:
        print(
            f"  staged_slot/staged_root {medians['staged_slot'] / medians['staged_root']:.3f}  "
            f"staged_slot/raw {medians['staged_slot'] / medians['raw']:.3f}  "
            f"staged_slot/slot {medians['staged_slot'] / medians['slot']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
