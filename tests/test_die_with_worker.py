"""A worker SIGKILLed while jobs start leaves no bubblewrap and no guest behind.

bubblewrap arms its parent-death signal late: its monitor after it has cloned the
sandbox, the sandbox's init only once its set-up is done (and, with the limit gate, after
the worker released it). A worker killed in between left the sandbox running with nobody
to stop it: the guest ran to its end (a sleeping one for its whole sleep), and
unprivileged runs saw teardown errors from the surviving bubblewrap. A real worker
process, running short jobs four at a time, is killed with SIGKILL at a random moment,
again and again; after each kill nothing started for it may remain.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from metnos_exec.messages import Job
from tests.helpers.worker_cli import wait_for_event, worker_argv
from tests.test_worker_process import with_broker
from tests.undo.helpers import bwrap_works

MANIFEST = """\
name = "nap"
version = "1"
runtime = "python"
entry = "main.py"
[args.s]
type = "number"
default = 0.05
[limits]
timeout_s = 60
"""

NAP = """\
import json, sys, time
a = json.load(sys.stdin)
time.sleep(a["s"])
print(json.dumps({"ok": True}))
"""

ROUNDS = int(os.environ.get("METNOS_KILL_ROUNDS", "10"))


def _ours(marker: str) -> dict[int, str]:
    """Processes whose command line names `marker` (this test's folder): every bubblewrap
    of its jobs (the executor folder is bound by path) and every guest (its main.py)."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != b"Z":
            wchan, st, stack = "?", {}, ""
            with contextlib.suppress(OSError), open(f"/proc/{entry}/wchan") as f:
                wchan = f.read()
            with contextlib.suppress(OSError), open(f"/proc/{entry}/status") as f:
                st = {k: v.strip() for k, _, v in (ln.partition(":") for ln in f)}
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stack") as f:  # root only
                stack = f.read().replace("\n", " | ")[:300]
            found[int(entry)] = (
                f"{cmd[:40]} ppid={st.get('PPid')} nspid={st.get('NSpid')} "
                f"state={state!r} wchan={wchan} sig={st.get('SigCgt')} stack={stack}"
            )
    return found


def test_nothing_survives_a_worker_killed_while_jobs_start(tmp_path: Path) -> None:
    bwrap_works()
    seed = int(os.environ.get("METNOS_CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    executors = tmp_path / "executors"
    (executors / "nap").mkdir(parents=True)
    (executors / "nap" / "manifest.toml").write_text(MANIFEST)
    (executors / "nap" / "main.py").write_text(NAP)
    url = f"sqlite:///{tmp_path / 'q.db'}"
    marker = str(executors / "nap")

    async def submit(broker: object) -> None:
        for i in range(40):
            # Mostly short jobs (many starts); some long ones (a guest that would outlive
            # the worker by far if nothing stopped it).
            s = 30.0 if i % 8 == 0 else 0.02
            await broker.submit(Job(executor="nap", args={"s": s}))  # type: ignore[attr-defined]

    survivors: dict[int, str] = {}
    for round_ in range(ROUNDS):
        with_broker(url, submit)
        log = tmp_path / f"w{round_}.jsonl"
        proc = subprocess.Popen(
            worker_argv(url, executors, log, "--concurrency", "4", "--grace", "1"),
            env={**os.environ, "HOME": str(tmp_path)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_event(log, "job.started", proc, timeout=30)
            # A random instant while jobs keep starting.
            time.sleep(rng.uniform(0.0, 0.25))  # the moment of the kill, not a synchronisation
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 10
        left = _ours(marker)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)  # polling with a deadline: the kernel tears the trees down
            left = _ours(marker)
        survivors.update(left)
        for pid in left:  # leave the machine clean whatever the verdict
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if survivors:
            break
    assert not survivors, f"seed {seed}: survived the worker: {survivors}"
