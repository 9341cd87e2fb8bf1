"""The worker's staging, the commit of a staged job's changes, and the recovery of
commits dead workers left half-done.

A `Staging` (blobs, commit journals, the staging namespace) is made at first use when
none was given. Its journals are settled at start (`recover`), and again before a job
touches its folders when that job is a redelivery or a recovery the store cut short is
owed (`_recover_for`): a run on a half-committed tree would commit its changes under the
dead job's.

A succeeded staged job's changes are committed (`_commit`) while its lease is still
ours, their undo entry recorded, then its result acked; the journal makes every step of
that crash-safe (`Staging.recover` settles what a crash left).
"""

from __future__ import annotations

from typing import Final

import anyio
import msgspec

from ..brokers.base import Lease
from ..errors import BrokerError, CommitConflict, HostFault
from ..logs import get_logger
from ..messages import ErrorInfo, Result, UndoEntry
from ..undo.journal import Blocked
from ..undo.staging import Reversible, Staging, default_state_dir
from .leasing import Leasing

__all__ = ("Commits",)

#: ``commit.filtered`` records logged per job at most (the rest are counted, not listed).
_FILTERED_LOGGED: Final = 100
#: Paths listed in an ``undo.recorded`` / ``undo.applied`` record at most.
_PATHS_LOGGED: Final = 50

_log = get_logger()


class Commits(Leasing):
    """The supervisor's layer that owns the staging, commits, and settles dead workers'
    journals."""

    def _init_parts(self) -> None:
        super()._init_parts()
        #: A journal recovery failed on the store and is owed (`_owes_recovery`).
        self._unrecovered = False

    @property
    def staging(self) -> Staging:
        """The worker's `Staging` (made at first use when none was given)."""
        if self._staging is None:
            self._staging = Staging(default_state_dir(queue=self.broker.queue_id))
        journal = self._staging.journal
        if not journal.queue:
            # Its journals name this queue: no other queue's worker settles them; and
            # its blobs are noted as this queue's (no other queue's worker collects them).
            journal.queue = self.broker.queue_id
            self._staging.serves(journal.queue)
        return self._staging

    async def recover(self) -> None:
        """Settle the commit journals of workers that died mid-commit (see
        `Staging.recover`); a broker that fails now is tried again at the next call."""
        try:
            await self.staging.recover(self.broker, device=self.device)
        except Exception as exc:
            # Owed: until it is done, every job that writes waits for it (`_recover_for`).
            self._unrecovered = isinstance(exc, BrokerError)
            _log.error(
                "worker.error", error=f"journal recovery failed: {type(exc).__name__}: {exc}"
            )
        else:
            self._unrecovered = False

    def _owes_recovery(self, lease: Lease) -> bool:
        """Whether `lease`'s job must wait for the journal recovery before it touches its
        folders: a redelivery (its last worker may have died mid-commit), or any job while
        a recovery the store cut short is owed (a job run on a half-committed tree has its
        changes committed under the dead job's, which then cannot be rolled back)."""
        return lease.attempt > 1 or self._unrecovered

    async def _recover_for(self, lease: Lease) -> bool:
        """Settle the journals of dead workers before a redelivered job touches its
        folders: its last worker may have died mid-commit, and a run on a half-committed
        tree would commit its changes a second time. A store that fails is asked again
        with backoff (the lease is heart-beaten meanwhile). ``False``: the worker gave up
        (it stops); the job must not run."""
        failures = 0
        while True:
            try:
                await self.staging.recover(self.broker, device=self.device)
                self._unrecovered = False
                return True
            except BrokerError as exc:
                failures += 1
                self._broker_failed("recover", exc, job_id=lease.job.id)
                if self._give_up.is_set() or self._draining:
                    return False
                with anyio.move_on_after(self.store_backoff(failures)):
                    await self._give_up.wait()
            except Exception as exc:  # not the store: as at start, said and left
                _log.error(
                    "worker.error", error=f"journal recovery failed: {type(exc).__name__}: {exc}"
                )
                return True

    def _needs_staging(self) -> bool:
        return any(
            cap.name == "fs:write"
            for name in self.registry
            for cap in self.registry[name].manifest.capabilities
        )

    async def _commit(self, lease: Lease, result: Result, reversible: Reversible) -> None:
        """Commit a succeeded job's changes, record their undo entry, ack the result."""
        with anyio.CancelScope(shield=True), self.observer.phase("commit", lease.job):
            try:
                # Still ours? A commit for a job the broker gave to another worker would
                # apply the same changes twice.
                reply = await self.broker.heartbeat(lease)
            except Exception:
                reply = None  # the broker will tell at record_undo
            if reply is not None and not reply.ok:
                self._count_lost()
                _log.warning("lease.lost", visibility_s=self.visibility_s, during="commit")
                return
            try:
                committed = await reversible.commit()
            except CommitConflict as exc:
                await self._ack(
                    lease,
                    msgspec.structs.replace(
                        result,
                        status="failed",
                        error=ErrorInfo(code=exc.code, message=exc.message),
                    ),
                )
                return
            except (HostFault, OSError, Blocked) as exc:
                # Rolled back already (see journal.apply_ops): nothing of it is applied.
                text = exc.message if isinstance(exc, HostFault) else str(exc)
                await self._retry(
                    lease, ErrorInfo(code=HostFault.code, message=f"commit failed: {text}")
                )
                return
            for path, what in committed.filtered[:_FILTERED_LOGGED]:
                _log.warning("commit.filtered", path=path, what=what)
            entry = committed.entry
            if committed.changes is not None:
                result = msgspec.structs.replace(result, changes=committed.changes)
            if entry is None:
                await self._ack(lease, result)
                return
            # A store that fails is tried again with backoff, the lease kept alive, as
            # for an ack: throwing a good commit away would cost the job an attempt.
            recorded = await self._settle(
                "record_undo", lease, lambda: self.broker.record_undo(lease, [entry])
            )
            if not recorded:
                # Not ours any more (or given up: the worker stops): the changes go, the
                # job is delivered again.
                await reversible.settle(stored=False)
                if recorded is False:
                    self._count_lost()
                    _log.warning("lease.lost", visibility_s=self.visibility_s, during="commit")
                return
            try:
                stored = await self._ack(
                    lease, msgspec.structs.replace(result, undo_ids=(entry.id,))
                )
            except BaseException:
                # Whether the result was stored is unknown: the journal stays, and
                # `recover` decides once the broker answers (see Staging.recover).
                await reversible.abandon()
                raise
            await reversible.settle(stored=stored)
            if stored:
                _log_recorded(entry)


def _log_recorded(entry: UndoEntry) -> None:
    paths = entry.paths()
    _log.info(
        "undo.recorded",
        entry_id=entry.id,
        method=entry.method,
        ops=len(entry.ops),
        paths=paths[:_PATHS_LOGGED],
        path_count=len(paths),
        blobs=sorted(entry.blobs())[:_PATHS_LOGGED],
        reverses=entry.reverses,
    )
