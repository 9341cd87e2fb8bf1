"""The latest progress of each running job (`messages.Progress`; issue 19): stored by the
worker that runs it, read by ``result``, ``status --jobs``, `Client.progress` and the
MCP server.

A worker stores a job's progress at most once every ``progress_every_s`` (a second by
default), and only when it changed (`metnos_exec.supervisor.leasing`). The write is
fenced by the lease like a heartbeat: a worker whose lease was lost writes nothing. One
record per job, replaced by each write and kept with the job (forgotten by `purge` with
it; a new delivery's first write replaces the old one: `Progress.attempt` says which
delivery wrote it). Progress is advice, never state the queue's guarantees rest on: a
broker that keeps none (the default below) only shows none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..messages import Progress

if TYPE_CHECKING:
    from .base import Lease

__all__ = ("ProgressRecords",)


class ProgressRecords:
    """`Broker`'s part for progress (its defaults: a broker that keeps none)."""

    async def report_progress(self, lease: Lease, progress: Progress) -> bool:
        """Store `progress` as the leased job's latest, while `lease` is current.

        Returns:
            ``False`` (nothing written) when the lease was lost, or the broker keeps no
            progress.
        """
        return False

    async def get_progress(self, job_id: str) -> Progress | None:
        """The latest progress stored for `job_id` (``None``: none, an unknown job, or a
        record that does not decode)."""
        return None
