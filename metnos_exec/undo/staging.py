"""Reversible runs: a job's writes are staged and committed (or backed up), never lost.

`Staging` is the worker's piece of it (one per worker: the blob store, the commit journal,
the staging namespace); `Staging.prepare` gives each job that may write a `Reversible`:

- **staged** (`OverlayRun`, in `metnos_exec.undo.overlay_run`; the bwrap arm with the
  staging namespace available): the job writes into a copy-on-write overlay over each
  writable folder, on a tmpfs as large as its disk budget. On success `commit` computes
  the change set (`changes.plan_commit`), stores the originals as blobs, writes the
  journal and applies the changes to the real folders; the undo entry is the reverse. On
  failure, timeout or cancel `discard` drops the overlay: the real folders never saw a
  byte.
- **backup** (`BackupRun`: the direct or wasm arm, a worker without the staging namespace,
  or folders an unprivileged worker does not own): the job writes straight into the real
  folders. Before it runs, its *declared targets* (path arguments under an ``fs:write``
  hint) are backed up; after success the undo entry records how to restore them; after a
  failure they are restored at once. What is lost is said once per job
  (``sandbox.degraded``, reason ``no_staging``) and in the entry (`UndoEntry.lost`).

After the result is acked, `settle` keeps (stored) or rolls back (lease lost) a commit. A
worker killed in the middle is settled by the next start (`Staging.recover`, see
`metnos_exec.undo.journal`): changes whose result was stored stand, the others are rolled back.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
import msgspec

from ..brokers.base import Broker
from ..logs import get_logger
from ..private import private_dir
from ..sandbox._types import AxisVerdict, ContainmentReport, SandboxJob
from ._types import Committed, Reversible
from .backup import BackupRun
from .blobs import BlobStore
from .folder_lock import FolderLock
from .journal import (
    Conflict,
    HostTree,
    Journal,
    JournalRecord,
    rollback,
)
from .overlay import HelperGone, OverlayNamespace, StagingUnavailable
from .overlay_run import OverlayRun
from .seal import UndoLedger, UndoSeal

__all__ = (
    "STATE_DIR_ENV",
    "BackupRun",
    "Committed",
    "OverlayRun",
    "Reversible",
    "Staging",
    "default_state_dir",
    "disk_verdict",
)

#: Where a worker keeps its blobs, journals and staging mount points.
STATE_DIR_ENV: Final = "METNOS_STATE_DIR"
#: A blob younger than this is never collected, needed or not: it may belong to a backup
#: taken before a long job ran, or to a commit whose entry is not stored yet.
BLOB_MIN_AGE_S: Final = 24 * 3600.0
#: How long a staging helper that failed to start is trusted before it is tried again.
RETRY_UNAVAILABLE_S: Final = 30.0

_log = get_logger()


def default_state_dir(queue: str | None = None) -> Path:
    """``$METNOS_STATE_DIR``, else the queue's folder in ``$XDG_STATE_HOME/metnos-exec``
    (else ``~/.local/state/metnos-exec``): ``queues/<scheme>-<hash of queue>``.

    Args:
        queue: `Broker.queue_id` (``None``: the folder above every queue's). Workers of
            two queues on one machine then keep apart their journals (one queue's must
            never be settled by the other's worker, which does not know its jobs) and
            their blobs (collected by what one queue's entries need). An install from
            before keeps its one folder (``blobs/`` or ``journal/`` in it): its blobs
            and key hold the undo entries already recorded; its journals are recovered
            by the queue that wrote them (`Staging.recover`).
    """
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    base = Path(xdg) / "metnos-exec"
    if queue is None or (base / "blobs").is_dir() or (base / "journal").is_dir():
        return base
    scheme = queue.partition(":")[0] or "queue"
    return base / "queues" / f"{scheme}-{hashlib.sha256(queue.encode()).hexdigest()[:16]}"


def disk_verdict(
    report: ContainmentReport, *, method: str | None, disk_bytes: int | None
) -> ContainmentReport:
    """The resources axis with the disk wall added: a staged job's writes are bounded by
    its staging tmpfs; a job writing straight into host folders is not bounded at all."""
    axis = report.resources
    if method == "staged" and disk_bytes is not None:
        mib = disk_bytes / (1024 * 1024)
        verdict = AxisVerdict(
            axis.state, f"{axis.reason}; disk writes bounded ({mib:g} MiB staged)"
        )
    elif method == "backup":
        state: Any = "partial" if axis.state == "kept" else axis.state
        verdict = AxisVerdict(state, f"{axis.reason}; disk writes unbounded (no staging)")
    else:
        return report
    return msgspec.structs.replace(report, resources=verdict)


# --- the worker's side ----------------------------------------------------------------


class Staging:
    """A worker's blob store, commit journal and staging namespace.

    Args:
        state_dir: default `default_state_dir`; holds ``blobs/``, ``journal/`` and, for
            a worker that is not root, the (empty on the host) ``stage/`` mount base.
        blob_dir: the blob store (default ``<state_dir>/blobs``). An undo reads its blobs
            here, and the key that seals undo entries (``undo.key``): workers of one
            device on several machines need a shared one.
        overlay: use overlay staging when the arm can (``False``: always back up).
        fsync: flush blobs, journals and committed files (power-loss safety; slower).
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        blob_dir: str | os.PathLike[str] | None = None,
        overlay: bool = True,
        fsync: bool = False,
    ) -> None:
        # Absolute: bubblewrap (started under nsenter, at the namespace's root) binds the
        # overlays below it by path.
        self.state_dir = (
            Path(state_dir) if state_dir is not None else default_state_dir()
        ).absolute()
        private_dir(self.state_dir)
        self.store = BlobStore(
            blob_dir if blob_dir is not None else self.state_dir / "blobs", fsync=fsync
        )
        self.journal = Journal(self.state_dir / "journal", fsync=fsync)
        #: Seals the undo entries this device records, and checks those it is asked to
        #: undo (`metnos_exec.undo.seal`). Its key is kept beside the blobs: what the
        #: workers of one device share for undo to work at all.
        self.seal = UndoSeal.beside(self.store.root)
        #: Which entries this device undid (`metnos_exec.undo.seal.UndoLedger`).
        self.ledger = UndoLedger.beside(self.store.root)
        self.fsync = fsync
        # A root worker's base is under /run, where its slots' uids may pass (see
        # `metnos_exec.undo.overlay`); anyone else's is in its state folder.
        base = None if os.geteuid() == 0 else self.state_dir / "stage"
        self._ns = OverlayNamespace(base) if overlay else None
        self._unavailable: str | None = None if overlay else "overlay staging switched off"
        self._failed_at = 0.0
        self._lock = anyio.Lock()
        #: Journals of other queues or devices already said (`recover`): said once.
        self._foreign: set[str] = set()
        #: One commit (or undo) applied at a time by this worker: two jobs changing the
        #: same file then conflict at planning, not in between one op's check and write.
        self.commit_lock = anyio.Lock()

    @property
    def unavailable(self) -> str | None:
        """Why overlay staging is not available (``None``: it is, or was not tried yet)."""
        return self._unavailable

    async def start(self) -> str | None:
        """Start the staging namespace now (else at the first job that needs it).

        Returns:
            ``None`` when staging works, else why not.
        """
        ns = self._ns
        if ns is None:
            return self._unavailable
        async with self._lock:
            if ns.running:
                return None
            if (
                self._unavailable is not None
                and time.monotonic() - self._failed_at < RETRY_UNAVAILABLE_S
            ):
                return self._unavailable
            try:
                await ns.start()
            except StagingUnavailable as exc:
                self._unavailable = str(exc)
                self._failed_at = time.monotonic()
                _log.warning("staging.unavailable", reason=self._unavailable)
                return self._unavailable
            self._unavailable = None
            return None

    async def aclose(self) -> None:
        if self._ns is not None:
            await self._ns.aclose(final=True)

    async def restart(self) -> str | None:
        """A new staging helper after the last one died (killed, OOM); as `start`."""
        if self._ns is not None:
            await self._ns.aclose()
        return await self.start()

    async def prepare(
        self,
        *,
        job_id: str,
        executor: str,
        device: str,
        job: SandboxJob,
        write_roots: Sequence[str],
        write_targets: Sequence[str],
        arm_stages: bool,
    ) -> Reversible | None:
        """Set up the reversible run of one job; ``None`` when it writes nowhere.

        Args:
            job_id: the job.
            executor: its executor (recorded in the entry).
            device: the device it runs on (recorded in the entry: the undo runs there).
            job: what the arm would run.
            write_roots: `Invocation.write_roots`.
            write_targets: `Invocation.write_targets`.
            arm_stages: the arm can run a job in the staging namespace (bwrap).

        Raises:
            HostFault: staging or the backups could not be set up (a mount failed, a root
                changed); nothing ran.
        """
        roots = [m.host for m in job.mounts if m.writable and m.host in set(write_roots)]
        if not roots:
            return None
        why = "the arm cannot stage (only bubblewrap jobs are staged)"
        if arm_stages and self._ns is not None:
            why = await self.start() or _not_folders(roots) or _not_owned(roots) or ""
            if not why:
                try:
                    return await OverlayRun.create(
                        self, self._ns, job_id, executor, device, job, roots
                    )
                except HelperGone:
                    why = await self.restart() or ""
                    if not why:
                        return await OverlayRun.create(
                            self, self._ns, job_id, executor, device, job, roots
                        )
        elif self._ns is None:
            why = self._unavailable or why
        return await BackupRun.create(
            self.store, job_id, executor, device, job, roots, write_targets, why
        )

    def serves(self, queue: str) -> None:
        """Note that a worker of `queue` (`Broker.queue_id`) keeps its blobs here: one
        file per queue in ``<blob_dir>/queues`` (see `collect`)."""
        notes = private_dir(self.store.root / "queues")
        note = notes / hashlib.sha256(queue.encode()).hexdigest()[:16]
        if not note.exists():
            tmp = notes / f".{os.getpid()}-{os.urandom(4).hex()}"
            tmp.write_text(queue)
            tmp.chmod(0o600)
            os.replace(tmp, note)

    def _other_queues(self, queue: str) -> list[str]:
        notes = self.store.root / "queues"
        try:
            found = [p.read_text() for p in notes.iterdir() if not p.name.startswith(".")]
        except FileNotFoundError:
            return []
        return sorted(q for q in found if q != queue)

    async def collect(self, broker: Broker, *, min_age_s: float = BLOB_MIN_AGE_S) -> None:
        """Delete blobs no stored undo entry needs (retention follows the results': an
        entry goes with its job's result, see `Broker.purge`), older than `min_age_s`.
        Logged as ``blobs.collected``.

        Only in a blob store no other queue's worker noted (`serves`): this queue's
        entries do not say what another's need, and its undo would find its originals
        gone. A shared one is said (``worker.error``) and left to grow."""
        others = await anyio.to_thread.run_sync(self._other_queues, broker.queue_id)
        if others:
            _log.warning(
                "worker.error",
                error=f"blobs not collected: the blob store {self.store.root} is also used "
                f"by the queue(s) {', '.join(others)}, whose undo entries this queue cannot "
                "see; give each queue its own state folder (the default) to collect them",
            )
            return
        keep = await broker.undo_blobs()
        stats = await anyio.to_thread.run_sync(
            functools.partial(self.store.collect, keep, min_age_s=min_age_s)
        )
        _log.info(
            "blobs.collected",
            removed=stats.removed,
            removed_bytes=stats.removed_bytes,
            kept=stats.kept,
        )

    async def recover(self, broker: Broker, *, device: str | None = None) -> list[tuple[str, str]]:
        """Settle the journals of commits whose worker died (see `metnos_exec.undo.journal`).

        Only journals of `broker`'s queue (and of `device`, when given) are settled: a
        commit whose job's stored result lists its entry stands (the journal is just
        removed); any other is rolled back. Another queue's or device's is left for its
        own workers, as is one written before journals named their queue whose job this
        queue does not know (another queue's worker would look it up in vain and roll
        back a commit its own queue acknowledged). Each is logged as
        ``journal.recovered`` (action ``kept``, ``rolled_back``, or ``skipped`` with the
        reason, once per journal).

        Returns:
            ``(job_id, "kept" | "rolled_back")`` for each journal settled.
        """
        handles, unreadable = await anyio.to_thread.run_sync(self.journal.orphans)
        for path, why in unreadable:
            # Left in place for a person: what it did cannot be known.
            _log.error("worker.error", error=f"commit journal {path} unreadable: {why}")
        done: list[tuple[str, str]] = []
        try:
            while handles:
                handle = handles[0]
                record = handle.record
                why_not = await _not_ours(record, broker, device)
                if why_not is not None:
                    handles.pop(0).close(remove=False)
                    if record.id not in self._foreign:
                        self._foreign.add(record.id)
                        _log.info(
                            "journal.recovered",
                            job_id=record.job_id,
                            action="skipped",
                            reason=why_not,
                            ops=len(record.ops),
                        )
                    continue
                result = await broker.get_result(record.job_id)
                if result is not None and record.entry_id in result.undo_ids:
                    action, left = "kept", []
                else:
                    action = "rolled_back"
                    left = await anyio.to_thread.run_sync(_rollback_record, record, self.store)
                # An undo's marks in the device's ledger follow its journal's fate.
                self.ledger.settled(record.entry_id, kept=action == "kept")
                handles.pop(0).close()
                done.append((record.job_id, action))
                _log.log(
                    logging.WARNING if action == "rolled_back" else logging.INFO,
                    "journal.recovered",
                    job_id=record.job_id,
                    action=action,
                    ops=len(record.ops),
                    left=[str(c) for c in left[:20]],
                )
        finally:
            for handle in handles:
                handle.close(remove=False)  # the broker failed: the next call tries again
        return done


async def _not_ours(record: JournalRecord, broker: Broker, device: str | None) -> str | None:
    """Why `record` is not this worker's to settle (``None``: it is)."""
    if record.queue and record.queue != broker.queue_id:
        return f"a journal of another queue ({record.queue}), left for its workers"
    if device is not None and record.device and record.device != device:
        return f"a journal of device {record.device}, left for its workers"
    if not record.queue and await broker.get_job_state(record.job_id) is None:
        return (
            "a journal that names no queue (written before journals did), of a job this "
            "queue does not know: left for the queue that wrote it"
        )
    return None


def _rollback_record(record: JournalRecord, store: BlobStore) -> list[Conflict]:
    with FolderLock(record.roots), HostTree(record.roots) as tree:
        return rollback(tree, record.ops, store=store, tag=record.id)


def _not_folders(roots: Sequence[str]) -> str | None:
    """Why these roots cannot be staged because one is not a folder (``None``: all are).

    A ``fs:write`` hint may name a single file, mounted alone; an overlay stages folders
    only, and such a job used to die as a host fault in every attempt."""
    for root in roots:
        try:
            st = os.lstat(root)
        except OSError:
            continue  # gone: staging refuses it with the reason
        if not stat.S_ISDIR(st.st_mode):
            return f"{root} is not a folder (an overlay stages folders; the hint names a file)"
    return None


def _not_owned(roots: Sequence[str]) -> str | None:
    """Why an unprivileged worker cannot stage these roots (``None``: it can)."""
    if os.geteuid() == 0:
        return None
    uid, gid = os.getuid(), os.getgid()
    for root in roots:
        st = os.lstat(root)
        if (st.st_uid, st.st_gid) != (uid, gid):
            return (
                f"{root} is owned by {st.st_uid}:{st.st_gid}, not the worker's {uid}:{gid} "
                "(an unprivileged overlay can only copy up the worker's own files)"
            )
    return None
