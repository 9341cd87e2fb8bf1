"""The Redis broker's watch on its data set: a restart of the server, and whether the
queue's data came back with it (issue 18, item 8).

A Redis without its append-only file restarted with nothing: 2,000 jobs (839 results
among them) were gone, and nothing said why. So each queue has a marker, ``epoch``: a
string written once (``SET NX``) by the first writer to find none, a random id and when.
The broker remembers the marker, the server's ``run_id`` (``INFO server``) and the counts
it last saw, and looks again when a connection to Redis was made anew (a restart drops
every connection), or after `DataWatch.every_s` otherwise (a ``FLUSHDB`` drops none):

* the marker it saw is gone, or another one is there: the data set it knew is not this
  one. That is data loss: ``broker.data_lost`` is logged once (with the cause: the run id
  changed, a ``restart``; it did not, a ``flush``; it cannot be read, ``unknown``, and the
  counts last seen: those jobs and results are what was lost, with whatever came after),
  and the first writer to see it records it in the new data set (``lost``: a hash, field
  = the new marker, value = the `DataLoss` as JSON, kept `LOST_KEEP_S`), which is what
  ``status`` and ``doctor`` report (`RedisInspection.data_lost`);
* the marker is the same and the run id changed: the server restarted and kept the data
  (the append-only file, or a failover to a replica): ``broker.restarted``, nothing lost
  but at most the last second of writes (``appendfsync everysec``).

What cannot be known: a process that never saw the queue before the loss (a worker
started after it, ``status`` run afresh) finds no marker and cannot tell a new queue
from a lost one; it writes the marker and goes on. Readers (``create=False``) write
nothing: neither the marker nor the record.

A look that fails (Redis down) is said by the call that follows it, not by the watch; the
next look comes with the next connection made, or after `every_s`. Commands: ``INFO``
(optional: without it a loss is still found, its cause ``unknown``), ``GET``, ``SET``,
``HSETNX``, ``EXPIRE`` and the ``stats`` script; the README's ACL has them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Final, Literal

import coredis
import msgspec
from coredis.tokens import PureToken

from ..logs import get_logger
from .base import BrokerStats, DataLoss

__all__ = ("LOST_KEEP_S", "DataWatch", "decode_losses")

_log = get_logger()

#: How long the record of a data loss is kept in the new data set (``status``, ``doctor``).
LOST_KEEP_S: Final = 7 * 86400


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _counts(stats: BrokerStats | None) -> str:
    if stats is None:
        return "no counts were seen before"
    return (
        f"{stats.queued} queued ({stats.delayed} delayed), {stats.running} running, "
        f"{stats.done} done and {stats.dead} dead (results and dead letters)"
    )


def decode_losses(values: Sequence[Any]) -> list[DataLoss]:
    """The stored records (``lost``'s values), newest first; an unreadable one is left out."""
    out: list[DataLoss] = []
    for value in values:
        try:
            out.append(msgspec.json.decode(value, type=DataLoss))
        except (msgspec.DecodeError, TypeError):
            continue
    return sorted(out, key=lambda loss: loss.at, reverse=True)


class DataWatch:
    """What one broker saw of its queue's data set (module docstring).

    Args:
        redis: the broker's client.
        marker: the ``epoch`` key; lost: the ``lost`` key.
        where: the server, for messages (never the password).
        prefix: the queue's prefix, for the log record.
        create: ``False`` for readers, which write nothing.
        stats: runs the ``stats`` script (its raw reply).
        info: ``INFO server`` of the server holding the queue (default: `redis`'s).
    """

    #: Seconds between two looks while no connection is made anew.
    every_s: ClassVar[float] = 10.0

    def __init__(
        self,
        redis: Any,
        *,
        marker: str,
        lost: str,
        where: str,
        prefix: str,
        create: bool,
        stats: Callable[[], Awaitable[Sequence[Any]]],
        info: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self._redis = redis
        self._info = info if info is not None else lambda: redis.info("server")
        self._marker = marker
        self._lost = lost
        self._where = where
        self._prefix = prefix
        self._create = create
        self._stats = stats
        self.epoch: str | None = None
        self.run_id: str | None = None
        self.counts: BrokerStats | None = None
        self.counts_at: float | None = None
        #: A connection to Redis was made since the last look (set by the pool's).
        self.reconnected = False
        self._looked_at: float | None = None
        self._failed = False
        self._busy = False

    def connected(self) -> None:
        """A connection was made (the pool's connect hook)."""
        self.reconnected = True

    def due(self, connection_usable: bool) -> bool:
        """Whether the next call should look first (cheap: called before every script)."""
        if self._busy:
            return False
        if self._looked_at is None or self.reconnected:
            return True
        if not connection_usable and not self._failed:
            return True  # a connection will be made: look at what it finds first
        return time.monotonic() - self._looked_at >= self.every_s

    def saw(self, stats: BrokerStats, at: float) -> None:
        """Counts a call read (`stats`): the last seen, unless a connection was made since
        the last look (they may be the new data set's, before the look that says so)."""
        if not self.reconnected and not self._busy and self._looked_at is not None:
            self.counts, self.counts_at = stats, at

    async def look(self, now: float) -> DataLoss | None:
        """Look at the marker and the server; the loss found, if any (logged, recorded)."""
        self._busy = True
        try:
            try:
                run_id, marker, counts = await self._read(now)
            except Exception:  # Redis down, refusing: the call that follows says so
                self._failed = True
                return None
            self._failed = False
            self.reconnected = False
            loss = self._compare(run_id, marker, now)
            if run_id is not None:
                self.run_id = run_id
            self.epoch = marker
            self.counts, self.counts_at = counts, now
            if loss is not None and self._create and marker is not None:
                await self._record(marker, loss)
            return loss
        finally:
            self._looked_at = time.monotonic()
            self._busy = False

    async def _read(self, now: float) -> tuple[str | None, str | None, BrokerStats]:
        run_id: str | None = None
        # INFO not allowed to this user (an ACL): a loss is still found, cause unknown.
        with contextlib.suppress(coredis.exceptions.ResponseError):
            run_id = _text((await self._info()).get("run_id"))
        marker = _text(await self._redis.get(self._marker))
        if marker is None and self._create:
            fresh = f"{os.urandom(8).hex()} {now!r}"
            await self._redis.set(self._marker, fresh, condition=PureToken.NX)
            marker = _text(await self._redis.get(self._marker))
        queued, delayed, running, done, dead = (int(x) for x in await self._stats())
        counts = BrokerStats(queued=queued, delayed=delayed, running=running, done=done, dead=dead)
        return run_id, marker, counts

    def _compare(self, run_id: str | None, marker: str | None, now: float) -> DataLoss | None:
        before = self.run_id
        restarted = before is not None and run_id is not None and run_id != before
        if self.epoch is None or marker == self.epoch:
            if restarted:
                _log.info(
                    "broker.restarted",
                    broker=self._where,
                    prefix=self._prefix,
                    run_id_before=before,
                    run_id_now=run_id,
                )
            return None
        cause: Literal["restart", "flush", "unknown"]
        if restarted:
            cause = "restart"
            how = (
                f"Redis at {self._where} restarted (run id {before} -> {run_id}) without "
                "this queue's data: it keeps nothing across a restart (no append-only file)"
            )
        elif before is not None and run_id == before:
            cause = "flush"
            how = (
                f"this queue's data on Redis at {self._where} were deleted while the server "
                "ran (FLUSHDB, FLUSHALL, or its keys deleted by hand)"
            )
        else:
            cause = "unknown"
            how = (
                f"this queue's data on Redis at {self._where} were replaced (its marker is "
                "gone; the server's run id cannot be read: INFO is not allowed)"
            )
        seen = ""
        if self.counts_at is not None:
            seen = time.strftime(" at %Y-%m-%d %H:%M:%S UTC", time.gmtime(self.counts_at))
        loss = DataLoss(
            at=now,
            broker=self._where,
            cause=cause,
            detail=f"{how}; every job queued or running and every result stored before is "
            f"gone: last seen{seen}, {_counts(self.counts)}",
            last_seen=self.counts,
            last_seen_at=self.counts_at,
            run_id_before=before,
            run_id_now=run_id,
        )
        _log.error(
            "broker.data_lost",
            prefix=self._prefix,
            **msgspec.to_builtins(loss),
        )
        return loss

    async def _record(self, marker: str, loss: DataLoss) -> None:
        """Keep `loss` in the new data set (the first finder's record stays)."""
        try:
            await self._redis.hsetnx(self._lost, marker, msgspec.json.encode(loss))
            await self._redis.expire(self._lost, LOST_KEEP_S)
        except Exception as exc:  # the log record said it; the next loss may be kept
            _log.debug("broker.error", broker=self._where, op="record_loss", error=repr(exc))
