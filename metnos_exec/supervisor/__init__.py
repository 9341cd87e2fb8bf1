"""The supervisor: lease jobs, vet them, run them in their sandbox, store one result.

One `Supervisor` per worker process. It owns a task group with a fixed number of slots
(``concurrency``); each leased job runs in its own task, inside that group, so nothing
outlives `run` and there is no fire-and-forget task anywhere.

Per job, in order:

1. bind ``job_id``, ``executor``, ``worker``, ``device`` and ``sandbox`` into the
   structlog contextvars, so every record of the job carries them (spec §9): look the
   executor up, and bind the arm its runtime will use here (`predict_arm`, no side
   effects) — ``sandbox=None`` while no executor is known; log ``job.received``;
2. an unknown executor or a bad manifest → ``rejected`` with the code; with a `TrustStore`
   (``trust``), its signature is checked (cached) and the job is planned and run from the
   verified private copy (``E_SIGNATURE`` → ``rejected``; see `signing`);
3. `plan_invocation` (argument vetting, autonomy policy: ``E_CAPABILITY_DENIED``,
   ``E_BAD_ARGS``, ``E_AUTONOMY`` → ``rejected``; nothing runs);
4. choose the arm (``E_SANDBOX_REQUIRED`` → ``rejected``); wait for a slot (a job leased
   ahead, see ``prefetch``, is fully prepared while the slots are busy); log
   ``job.started``;
5. run the arm while heart-beating every ``heartbeat_s`` (default ``visibility_s / 3``);
   a heartbeat that finds the lease gone → ``lease.lost``, the run is cancelled and
   nothing is acked (the broker redelivers it). Cancel requests are polled apart, every
   ``cancel_poll_s`` (one `Broker.cancel_requested` call for all running jobs), so a
   cancel lands within about a second rather than at the next heartbeat; a job found
   cancelled is stopped and a ``cancelled`` result is acked;
6. map the outcome to a result and ack it (``job.finished``), or schedule a retry. A
   staged success is committed first; its lease is heart-beaten through the commit until
   its result is stored, however long that takes (a lease lapsing mid-commit handed the
   job to another worker while its folders were half changed).

Store failures (spec §7: a worker survives its store failing). Every broker call that
fails is logged as ``broker.error`` (op, code, error). A settlement (ack, retry, release)
that fails is kept in memory and tried again with backoff (`store_backoff`) while its
job's lease is heart-beaten, until it is stored or the lease is found lost; meanwhile no
new job is leased (results that cannot be stored must not pile up), and the lease loop
probes the store with backoff when it was the lease that failed. ``broker.recovered``
says when the store works again. A fatal store error (`BrokerError.fatal`: the queue file
deleted or replaced, a corrupt file) stops the worker: `run` returns and
`fatal_error` holds it. On drain, results still waiting for the store get
``settle_grace_s`` more after the grace; what is still not stored then is given up
(``broker.error`` with ``gave_up``; its lease lapses and the job runs again) and counted
in ``worker.stopped`` as ``unsettled``.

Attempts. Jobs leased for free run slots start at once (`Broker.lease`'s ``started``):
they are launched in the same scheduling round. A job leased ahead (``prefetch``) is
recorded as started (`Broker.mark_started`, batched across jobs) just before its launch:
only from then on does it count against ``max_attempts``, so one that never launched
(drain, a lost worker) has used nothing. When the mark finds the lease lost, nothing is
launched; when the store fails, nothing is launched either and the lease is handed back
once the store works.

Retry rule. Retried (with `retry_delay(attempt)`, until ``max_attempts``, then dead-
lettered with the last error): a `HostFault` from the arm (the harness broke; no verdict
exists, another try may find it healthy), and an executor that exits with code 75
(``EX_TEMPFAIL`` from sysexits.h: "try again later", the executor's own way of saying its
failure is transient). A lost lease is redelivered by the broker itself (the delivery
counts as an attempt there). Every other failure is final: an executor that fails, times
out, traps or runs out of fuel has given a verdict about these arguments, and running it
again would only give the same verdict later.

Where each part lives: `config` (the settings, one frozen `SupervisorConfig`), `state`
(what every part shares), `settle` (ack, retry, release with store backoff, the batcher),
`leasing` (the lease loop, heartbeats, cancel polls, run slots), `commits` (the staging,
commits, recovering dead workers' journals), `undo_jobs`, `checkpoint_jobs`, `pipeline`
(one job: vet, plan, stage, run, result), `outcome` (the outcome → result table) and `core` (the
`Supervisor` facade, re-exported here).
"""

from __future__ import annotations

from ..errors import ServerPinned
from .config import SupervisorConfig
from .core import Supervisor
from .outcome import EX_TEMPFAIL, MAX_OUTPUT_DEPTH, RAW_OUTPUT_CAP_BYTES
from .state import ArmChooser

__all__ = (
    "EX_TEMPFAIL",
    "MAX_OUTPUT_DEPTH",
    "RAW_OUTPUT_CAP_BYTES",
    "ArmChooser",
    "ServerPinned",
    "Supervisor",
    "SupervisorConfig",
)
