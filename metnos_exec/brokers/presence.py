"""Who serves the queue: each worker's presence record, and which queued executors no live
worker serves (``status``; issue 18, items 3 and 4).

A worker registers when it starts (`Broker.register_worker`), again every `WORKER_BEAT_S`
with its running jobs, and once more when it stops (``stopped_at`` set). A record not
renewed for `WORKER_TTL_S` is a worker that died without saying so (SIGKILL, a lost
machine): it counts as gone. Records of workers gone for longer than the ``gone_within_s``
a reader asks for are forgotten by that reader (`Broker.workers`), so the table stays the
size of the fleet.

A presence record is advice for people and for ``status``, never a lock or a lease: the
queue's delivery guarantees do not depend on it (a worker that cannot write it keeps
serving).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Final

import msgspec

from ..messages import Job

__all__ = (
    "RECENTLY_GONE_S",
    "WORKER_BEAT_S",
    "WORKER_TTL_S",
    "JOB_STATES",
    "FleetRecords",
    "JobListing",
    "WorkerInfo",
    "decode_worker",
    "encode_worker",
    "is_live",
    "sort_out",
    "unserved",
)

#: How often a worker renews its presence record.
WORKER_BEAT_S: Final = 10.0
#: A record not renewed for this long is a worker gone without a word.
WORKER_TTL_S: Final = 3 * WORKER_BEAT_S
#: How long ``status`` lists a gone worker (and readers keep its record).
RECENTLY_GONE_S: Final = 3600.0

#: Running job ids kept in one record (a record stays small with 1,000 slots).
MAX_RUNNING_LISTED: Final = 200


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's presence record.

    Attributes:
        id: the worker id (``--id``; by default host and pid).
        host: the machine's name. pid: the worker's process id there.
        device: the device it serves (``server`` for server workers).
        executors: the executors it leases (executor routing).
        slots: run slots (``--concurrency``).
        running: ids of the jobs it runs now (at most `MAX_RUNNING_LISTED`).
        version: the metnos-exec version it runs.
        started_at, seen_at: unix seconds it started and last renewed the record.
        stopped_at: unix seconds it stopped, ``None`` while it runs (or if it died).
    """

    id: str
    host: str
    pid: int
    device: str
    executors: tuple[str, ...]
    slots: int
    running: tuple[str, ...] = ()
    version: str = ""
    started_at: float
    seen_at: float
    stopped_at: float | None = None


class JobListing(msgspec.Struct, frozen=True, kw_only=True):
    """One line of ``status --jobs`` (`FleetRecords.list_jobs`).

    Attributes:
        job_id, executor, device: the job (``executor`` ``""`` when its message does not
            decode).
        state: ``queued``, ``running``, ``done`` or ``dead``; ``status``: the result's
            status once finished (``succeeded``, ``failed``, ...).
        attempt: deliveries so far; ``worker``: the last worker that took it.
        finished_at: unix seconds of the result, once finished.
    """

    job_id: str
    executor: str
    device: str
    state: str
    attempt: int = 0
    worker: str | None = None
    status: str | None = None
    finished_at: float | None = None


#: The states `list_jobs` takes, and the default (all).
JOB_STATES: Final = ("queued", "running", "done", "dead")

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(WorkerInfo)


def encode_worker(info: WorkerInfo) -> bytes:
    return _ENCODER.encode(info)


def decode_worker(data: bytes | str) -> WorkerInfo | None:
    """The record, or ``None`` for one that does not decode (written by hand, or by a
    newer build): a reader skips it rather than fail ``status``."""
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return None


def is_live(info: WorkerInfo, now: float) -> bool:
    """Running, and renewed within `WORKER_TTL_S`."""
    return info.stopped_at is None and now - info.seen_at < WORKER_TTL_S


def sort_out(
    found: Iterable[WorkerInfo], now: float, gone_within_s: float
) -> tuple[list[WorkerInfo], set[str]]:
    """What `FleetRecords.workers` returns of the records `found` (the live ones and
    those gone within `gone_within_s`, by start time), and the ids of the records gone
    for longer, which the reader forgets."""
    keep: list[WorkerInfo] = []
    forget: set[str] = set()
    for info in found:
        went = info.stopped_at if info.stopped_at is not None else info.seen_at
        if is_live(info, now) or now - went <= gone_within_s:
            keep.append(info)
        else:
            forget.add(info.id)
    return sorted(keep, key=lambda w: (w.started_at, w.id)), forget


def unserved(
    queued: Mapping[tuple[str, str], int], workers: Iterable[WorkerInfo], now: float
) -> dict[tuple[str, str], int]:
    """Of the queued jobs counted by (device, executor), those no live worker serves
    (an executor of ``""``: jobs an older build stored, which any worker takes)."""
    served = {(w.device, name) for w in workers if is_live(w, now) for name in w.executors}
    devices = {w.device for w in workers if is_live(w, now)}
    return {
        (device, name): n
        for (device, name), n in queued.items()
        if n and (device, name) not in served and not (name == "" and device in devices)
    }


class FleetRecords:
    """`Broker`'s part for the fleet (its defaults: a broker that keeps none of it)."""

    async def executor_names(self) -> set[str]:
        """Every name in the catalog (empty: none published, or no catalog)."""
        return set()

    async def register_worker(self, info: WorkerInfo) -> None:
        """Store or renew a worker's presence record (replacing its id's). The default
        keeps nothing: ``status`` then lists no workers."""
        return None

    async def workers(self, *, gone_within_s: float = RECENTLY_GONE_S) -> list[WorkerInfo]:
        """The workers live now and those gone within `gone_within_s`, by start time;
        records of workers gone for longer are forgotten."""
        return []

    async def queued_executors(self) -> dict[tuple[str, str], int]:
        """Queued jobs, due or delayed, counted by (device, executor); ``""`` for the
        jobs of a build before executor routing (any worker takes them)."""
        return {}

    async def list_jobs(
        self,
        *,
        states: Collection[str] = JOB_STATES,
        executor: str | None = None,
        device: str | None = None,
        limit: int = 50,
    ) -> list[JobListing]:
        """Up to `limit` jobs in `states`, the most recently submitted first, optionally
        of one `executor` or `device`. The default lists none (a broker that cannot)."""
        return []

    async def get_job(self, job_id: str) -> Job | None:
        """The job message stored under `job_id` (its arguments, for the live view), or
        ``None``: unknown, forgotten by a purge, or a body that does not decode (a
        malformed message, which `dead_letters` keeps raw). The default: none."""
        return None
