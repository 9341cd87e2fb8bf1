"""Process lifecycle: spawn one job's process, feed it, drain it, time it out, reap it.

`run_process` is the single way metnos-exec starts a native process. It holds these
promises on both anyio backends (asyncio and trio):

* **Spawned from one long-lived thread.** PR_SET_PDEATHSIG fires when the *thread* that
  forked the child exits, not the process. trio spawns from cached worker threads that exit
  after 10 s idle, which SIGKILLed long jobs. Every fork here happens on a single daemon
  "spawner" thread that lives as long as the worker; the async side hands it a request and
  waits (on an eventfd, shielded: a spawned child is never abandoned) for the pid.
* **Waited on with a pidfd** (``os.pidfd_open`` + ``anyio.wait_readable``), reaped with
  ``os.wait4`` for its rusage. No SIGCHLD handler, no child watcher, no polling.
* **Bounded output.** stdout and stderr are read as they come into buffers that keep the
  first ``output_bytes`` and discard the rest while still draining, so a flood neither
  blocks the child on a full pipe nor grows the worker.
* **Whole-tree kill on timeout and cancellation:** SIGTERM, ``grace``, SIGKILL, reap. On
  the caller's cancellation the same sequence runs in a shielded scope and the
  cancellation is re-raised, never swallowed.
* **Die-with-parent.** A SIGKILLed worker leaves no job process alive.
* **Nothing outlives a job.** Once the child has exited, what is left of its session's
  group and of its cgroup is SIGKILLed before it is reaped; under the shim, descendants
  that left the group are killed by the shim. In a worker that started its keeper
  (`start_keeper`, at the worker's start), a child not yet reaped when the worker dies,
  however it dies, has its process group SIGKILLed by the keeper.

The kill sequence (`metnos_exec.process.kill`): the tree's usage is read, then SIGTERM to
the tree, ``grace`` seconds (more for the shim, which runs its own), SIGKILL, a bounded
wait for the child's exit, the leftovers SIGKILLed, the child reaped with ``wait4``. The
same sequence runs, shielded, when the caller stops the run; what it measured is then in
`Stopped`.

Who may start children: a job's processes are started only by `run_process`, the one
entry the sandbox arms call, and every one of them is forked on a spawner thread (the
shared one or a slot's). Each is registered as ours from the fork until it is reaped, so
`reap_orphans` (a subreaper worker's sweep) never takes it. Helpers the worker runs for
itself (probes, the staging namespace helper, the egress bridge) are plain ``subprocess``
children in the worker's own session, which the sweep leaves alone; the keeper is started
once, in a session of its own, by `start_keeper`.

Errors: `HostFault` only when the harness breaks (pipes, the spawner, the shim's
interpreter or set-up, ``wait4``). A user-level command that cannot be executed is an
ordinary result: exit 127 when not found, 126 otherwise (as a shell does), with the
reason in ``exec_error`` (stderr stays the job's own), in both modes.

Usage caveat: Linux counts the resident set of the image a child leaves at exec in its
``ru_maxrss``, so ``peak_rss_bytes`` never reads below the image that forked it: ~9 MB under
the shim; with ``reaper=False`` the worker's own *high-water* RSS, vforked or not (a
vforked child execs out of the worker's memory: measured, a worker that once held 300 MiB
saw 311 MiB for ``/bin/true``). Callers that need a job's peak there take it from
elsewhere (the bwrap arm: the memory cgroup, or the rusage of bubblewrap's init).

The modules, from the bottom up: `spec` (what a run is asked and answers), `reap` (the
children we own, orphans, the subreaper, the keeper), `cgroups` (per-run and slot cgroups,
the probes), `spawn` (the spawner threads, preexec, the fork), `slots` (the pool of slot
threads), `kill` (the kill sequence, reaping a run's child), `run` (`run_process`: feeding,
pumping, the deadline), `teardown` (what a run leaves to tear down after its result:
`after_result`). The stdlib-only scripts `_reaper.py` (the shim) and `_keeper.py`
are run by path, never imported by what they run.
"""

from __future__ import annotations

# The private names re-exported below (``_x as _x``) are those the tests reach here; a
# monkeypatch must still target the module that reads a name (e.g. `cgroups`).
from metnos_exec.process.cgroups import _Cgroup as _Cgroup
from metnos_exec.process.cgroups import _cgroup_parent as _cgroup_parent
from metnos_exec.process.cgroups import (
    memory_cgroup_available,
    pids_cgroup_available,
    slots_available,
)
from metnos_exec.process.reap import (
    KEEPER_ENV,
    become_subreaper,
    reap_orphan,
    reap_orphans,
    start_keeper,
)
from metnos_exec.process.reap import _disown as _disown
from metnos_exec.process.reap import _is_subreaper as _is_subreaper
from metnos_exec.process.reap import _nobodys as _nobodys
from metnos_exec.process.reap import _owned as _owned
from metnos_exec.process.reap import _spawn_lock as _spawn_lock
from metnos_exec.process.run import run_process
from metnos_exec.process.slots import Slot, pooled_slot
from metnos_exec.process.slots import _slots as _slots
from metnos_exec.process.spawn import _Child as _Child
from metnos_exec.process.spawn import _spawn as _spawn
from metnos_exec.process.spec import ProcessResult, ProcessSpec, Stopped

__all__ = (
    "KEEPER_ENV",
    "ProcessResult",
    "ProcessSpec",
    "Slot",
    "Stopped",
    "become_subreaper",
    "memory_cgroup_available",
    "pids_cgroup_available",
    "pooled_slot",
    "slots_available",
    "reap_orphan",
    "reap_orphans",
    "run_process",
    "start_keeper",
)
