"""The Redis broker's idle waits: blocking reads instead of the poll (issue 22).

An idle worker and a client waiting for a result used to ask Redis again every
``poll_interval_s`` (50 ms): a tool call through an idle worker took up to a poll period
on each side however fast its job was. Now each blocks in Redis until the event it waits
for, on a connection of its own (`RedisStore._blocker`: a blocked connection cannot carry
the leases, heartbeats and acks multiplexed on the shared one):

- **Work.** Every script that makes a job ready (a submit, a retry or release, a delayed
  job falling due, an inbox entry admitted) appends one entry per route to the ``wake``
  stream (``d`` the device, ``e`` the executor; capped, redis.lua's ``wake``). A lease
  returns the stream's last id, the inbox's and how long until the next delayed job or
  lease deadline (`WorkCursor`); `wait_for_work` then ``XREAD BLOCK`` s on ``wake`` (and
  ``inbox`` for a server worker) after those ids, until an entry for its device and an
  executor it serves arrives, the next delayed job or lapsing lease is due, or its timeout
  (the supervisor's ``idle_poll_s``, 1 s) passes. Nothing is consumed: every idle worker
  sees every wake-up, and the lease script, atomic as before, decides who gets the job
  (priorities, routing, takeovers unchanged). A wake-up after the lease's look is after
  its cursor, so none is missed between the two.
- **Results.** `wait_result` runs ``await_result`` (the result, or the job marked as
  waited on, atomically), then ``XREAD BLOCK`` s on ``done:<id>``, which the script that
  stores the result writes for a marked job (a one-entry stream that expires in a
  minute; any number of clients may read it).

On a cluster the keys share the queue's hash tag, so the blocked read goes to the node
owning the queue's slot like every script; through Sentinel it goes to the primary. A
wake-up is a hint, never the only look: a read blocks at most `BLOCK_CAP_S` (and a
worker's wait its timeout), so a wake-up lost with a failover costs a second at most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import anyio
import anyio.lowlevel

from ..errors import BrokerError, BrokerReadOnly
from ..messages import Result
from ._common import PolledWaits
from ._redis_client import _BLOCK_CAP_S, RedisStore, as_str, stored_result

__all__ = ("BLOCK_CAP_S", "RedisWaits", "WorkCursor")

#: The longest one blocked read lasts (the blocking client's reply timeout is this more).
BLOCK_CAP_S: Final = _BLOCK_CAP_S


@dataclass
class WorkCursor:
    """Where a worker's idle wait starts: what its last lease saw (redis.lua's lease)."""

    device: str
    served: frozenset[str] | None  # None: every executor
    wake: str  # the last wake-up entry id the lease saw
    inbox: str | None  # the last inbox entry id (server workers only)
    next_in: float | None  # seconds until a delayed job or a lease falls due
    at: float  # anyio.current_time() when the lease answered

    def wants(self, fields: dict[bytes, bytes]) -> bool:
        """Whether a wake-up entry is work this worker may lease."""
        if as_str(fields.get(b"d", b"")) != self.device:
            return False
        executor = as_str(fields.get(b"e", b""))
        return self.served is None or not executor or executor in self.served


def _ms(seconds: float) -> int:
    """A ``BLOCK`` argument: at least 1 ms (``BLOCK 0`` blocks forever)."""
    return max(1, math.ceil(min(seconds, BLOCK_CAP_S) * 1000))


class RedisWaits(RedisStore):
    """`wait_for_work` and `wait_result` by blocking reads (the module docstring); the
    poll of `PolledWaits` where there is nothing to block on yet."""

    async def wait_for_work(self, timeout: float) -> None:  # noqa: ASYNC109
        cursor = self._work_cursor
        if cursor is None:  # no lease yet: nothing says where to start
            await PolledWaits.wait_for_work(self, timeout)
            return
        now = anyio.current_time()
        deadline = now + timeout
        if cursor.next_in is not None:
            # On an injected clock its seconds are not ours: look again at the poll.
            soon = cursor.next_in if self._clock is None else self._poll
            deadline = min(deadline, cursor.at + soon)
        streams = {self.keys.wake: cursor.wake}
        if cursor.inbox is not None:
            streams[self.keys.inbox] = cursor.inbox
        while (left := deadline - anyio.current_time()) > 0:
            try:
                reply = await self._guard(self._blocker.xread(streams, block=_ms(left), count=100))
            except BrokerError:
                # Said by the next lease (which the supervisor reports); a blip here
                # must not end the leasing loop.
                await anyio.sleep(min(left, self._poll))
                return
            if not reply:
                continue
            for key, entries in reply.items():
                name = as_str(key)
                if name != self.keys.wake:
                    return  # an inbox entry: the next lease admits it
                streams[name] = cursor.wake = as_str(entries[-1].identifier)
                if any(cursor.wants(dict(e.field_values)) for e in entries):
                    return
        await anyio.lowlevel.checkpoint()

    async def wait_result(
        self,
        job_id: str,
        *,
        timeout: float | None,  # noqa: ASYNC109
    ) -> Result | None:
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        while True:
            try:
                body, known = await self._script("await_result", job_id)
            except BrokerReadOnly:  # a replica just after a failover: read, and poll
                left = deadline - anyio.current_time()
                return await PolledWaits.wait_result(self, job_id, timeout=max(0.0, left))
            if body:
                return stored_result(job_id, body, self.where)
            left = deadline - anyio.current_time()
            if left <= 0:
                return None
            if as_str(known) != "1":
                # No such job (yet): nothing will write its done key; the poll finds it.
                result = await PolledWaits.wait_result(self, job_id, timeout=min(left, self._poll))
                if result is not None:
                    return result
                continue
            await self._guard(self._blocker.xread({self.keys.done(job_id): "0-0"}, block=_ms(left)))
