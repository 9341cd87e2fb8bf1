"""The supervisor's settings: one frozen `SupervisorConfig`.

What a worker is (its id, its device), how many jobs it runs at once, its timings, limits
and retention, and the paths and policy its jobs are planned with. A config that breaks a
rule (no slot, a window of no time) cannot be built: `SupervisorConfig` raises
``ValueError``. The supervisor's collaborators (the broker, the registry, the arm chooser,
the staging, the trust store, the clocks and other callables) are not settings:
`Supervisor` takes them as keyword arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from ..brokers.base import DEFAULT_RETENTION_S
from ..policy import Policy

__all__ = ("SupervisorConfig", "split_settings")

#: Extra wall time the supervisor's own backstop gives an arm past the job's budget: the
#: arms enforce ``wall_time_s`` themselves (TERM, grace, KILL, reap); this scope only
#: catches an arm that failed to.
BACKSTOP_MARGIN_S: Final = 10.0

#: How often running jobs are checked for a cancel request: a user pressing "cancel"
#: expects it to bite within a second; one cheap query per poll for all jobs.
CANCEL_POLL_S: Final = 0.5

#: How long results still waiting for the store may keep a drained worker (after its
#: grace) before they are given up to the lease's expiry.
SETTLE_GRACE_S: Final = 5.0

#: How often the latest progress a running job reported is stored (at most one write a
#: job per period, and none while it reports nothing new).
PROGRESS_EVERY_S: Final = 1.0

#: How often a worker purges finished jobs past their retention (and once at start).
PURGE_EVERY_S: Final = 3600.0
#: How long an approval gate waits for an answer (`metnos_exec.undo.gates`): one day.
APPROVAL_TTL_S: Final = 24 * 3600.0
#: How often a worker looks for gates past their expiry.
APPROVAL_CHECK_S: Final = 60.0
#: How often a server worker publishes its executors again (`Supervisor._catalog_loop`).
CATALOG_EVERY_S: Final = 300.0


class SupervisorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A `Supervisor`'s settings.

    Attributes:
        worker_id: this worker's id (leases, results, logs).
        device: the device this worker runs on (``"server"`` or a device id).
        concurrency: jobs run at once.
        visibility_s: lease window; a worker silent this long loses the job.
        heartbeat_s: heartbeat period while a job runs (default ``visibility_s / 3``).
        cancel_poll_s: how often running jobs are checked for a cancel request.
        prefetch: jobs leased ahead of a free slot while every slot is busy; each is
            planned and its arm chosen at once, then launched the moment a slot frees,
            so leasing and planning leave the path between one job and the next. The
            cost: with other workers idle, such a job waits for this worker's next free
            slot (at most one job's run). ``0`` leases only for free slots.
        policy: passed to `plan_invocation` (``None``: its default policy).
        home: the user's home for ``~`` in hints and arguments (default ``$HOME``).
        skills_root: where provider skills keep their homes.
        idle_poll_s: longest wait for new work before polling the broker again.
        backstop_margin_s: how long past its wall-time budget an arm may run before the
            supervisor cancels it itself (the arms enforce the budget; this is a net).
        python: the interpreter of native executors (default: the worker's own; see
            `runtimes.obtain_device_python`).
        retention_s: finished jobs older than this are purged (at start, then every
            ``purge_every_s``); ``None`` never purges.
        purge_every_s: how often to purge.
        catalog_every_s: how often a server worker publishes its executors again (see
            `_catalog_loop`).
        settle_grace_s: after a drain's grace, how long results still waiting for the
            store may keep the worker before they are given up.
        progress_every_s: how often the latest progress each running job reported
            (`metnos_exec.sandbox.progress`) is stored, when it changed.
        approval_ttl_s: how long a job's approval gate waits for ``approve`` or
            ``reject`` before it is discarded (``approval.expired``).
        approval_check_s: how often kept gates are checked for their expiry.

    Raises:
        ValueError: ``concurrency`` below 1, a ``visibility_s``, ``cancel_poll_s`` or
            ``progress_every_s`` that is not positive, a negative ``prefetch``, a
            ``retention_s`` that is neither
            positive nor ``None``.
    """

    worker_id: str
    device: str = "server"
    concurrency: int = 4
    visibility_s: float = 30.0
    heartbeat_s: float | None = None
    cancel_poll_s: float = CANCEL_POLL_S
    prefetch: int = 1
    policy: Policy | None = None
    home: str | os.PathLike[str] | None = None
    skills_root: str | os.PathLike[str] | None = None
    idle_poll_s: float = 1.0
    backstop_margin_s: float = BACKSTOP_MARGIN_S
    python: str | None = None
    retention_s: float | None = DEFAULT_RETENTION_S
    purge_every_s: float = PURGE_EVERY_S
    catalog_every_s: float = CATALOG_EVERY_S
    settle_grace_s: float = SETTLE_GRACE_S
    progress_every_s: float = PROGRESS_EVERY_S
    approval_ttl_s: float = APPROVAL_TTL_S
    approval_check_s: float = APPROVAL_CHECK_S

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.visibility_s <= 0:
            raise ValueError("visibility_s must be positive")
        if self.cancel_poll_s <= 0:
            raise ValueError("cancel_poll_s must be positive")
        if self.progress_every_s <= 0:
            raise ValueError("progress_every_s must be positive")
        if self.approval_ttl_s <= 0 or self.approval_check_s <= 0:
            raise ValueError("approval_ttl_s and approval_check_s must be positive")
        if self.prefetch < 0:
            raise ValueError("prefetch must be zero or more")
        if self.retention_s is not None and not self.retention_s > 0:
            raise ValueError("retention_s must be positive (or None: keep forever)")


def split_settings(keywords: Mapping[str, Any]) -> tuple[SupervisorConfig, dict[str, Any]]:
    """Keywords that mix settings and collaborators (as `worker.serve` takes them) → the
    `SupervisorConfig` of the settings, and the rest (`Supervisor`'s keyword arguments)."""
    fields = SupervisorConfig.__struct_fields__
    config = SupervisorConfig(**{k: v for k, v in keywords.items() if k in fields})
    return config, {k: v for k, v in keywords.items() if k not in fields}
