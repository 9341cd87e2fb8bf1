"""Moving one job's bytes: checked connections out, both directions piped, all counted.

`JobTraffic` is the per-job state every way out shares: the policy and resolver (through
`decide`), the records, the count of open connections and the byte budget
(`EgressLimits`). The sockets are plain non-blocking sockets waited on with
``anyio.wait_readable``/``wait_writable`` (both backends); each connection's task owns
its two sockets and closes them when it ends, cancelled or not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator

import anyio

from ...logs import get_logger
from .policy import Authorized, EgressPolicy, Refused, Resolver, authorize
from .record import EgressRecord, Via

__all__ = ("Conn", "JobTraffic", "recv_some", "send_all")

_log = get_logger()
_CHUNK = 256 * 1024
#: fcntl(2): resize a pipe (<linux/fcntl.h>; Python names it from 3.10 on some builds).
_F_SETPIPE_SZ = 1031
#: A direction that has moved this much is a bulk transfer: its pipe grows to `_BULK_PIPE`.
_BULK_AFTER = 1024 * 1024
#: The bulk pipe (pipe-max-size's default): a quarter of the wake-ups of a 256 KiB one;
#: measured alone on loopback, 1 MiB splices moved 800-1,450 MiB/s against 320-800 for
#: 256 KiB ones on the same loaded box, for less CPU. Only bulk directions get it: a pipe's
#: pages count against the worker user's pipe-user-pages-soft (64 MiB) by size, not use,
#: and past it an unprivileged worker's new pipes get two pages only.
_BULK_PIPE = 1024 * 1024
#: A pipe's size when it could not be resized (Linux's default).
_DEFAULT_PIPE = 64 * 1024
#: The most records one job's result keeps (and logs); the rest are counted.
MAX_RECORDS = 1000
#: The most refusals of one job logged one by one; the rest are said once, counted, when
#: the job's wall comes down (a job flooding the wall made a log line per connection).
LOGGED_REFUSALS = 20


async def recv_some(sock: socket.socket, n: int = _CHUNK) -> bytes:
    """Up to `n` bytes (``b""``: end of file), waiting without blocking the loop."""
    while True:
        try:
            return sock.recv(n)
        except (BlockingIOError, InterruptedError):
            await anyio.wait_readable(sock)


async def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except (BlockingIOError, InterruptedError):
            await anyio.wait_writable(sock)
            continue
        view = view[sent:]


class Conn:
    """One accepted connection of the job: its socket, what it asked for, its counters."""

    def __init__(self, sock: socket.socket, via: Via) -> None:
        self.sock = sock
        self.via: Via = via
        self.sent = 0
        self.received = 0
        self.last = time.monotonic()


class JobTraffic:
    """Everything the ways out of one job share (see the module doc).

    Args:
        policy: the job's fixed policy.
        resolver: the worker's resolver.
    """

    def __init__(self, policy: EgressPolicy, resolver: Resolver) -> None:
        self.policy = policy
        self.resolver = resolver
        self.records: list[EgressRecord] = []
        #: Records past `MAX_RECORDS`, counted only.
        self.dropped = 0
        #: Refusals past `LOGGED_REFUSALS`, in the result but not logged one by one.
        self.unlogged_refusals = 0
        self._logged_refusals = 0
        self.open = 0
        self.bytes = 0
        #: Set when the byte budget is spent: every relay stops.
        self.spent = anyio.Event()
        #: The token bucket of new connections (`EgressLimits.rate`, `burst`).
        self._tokens = float(policy.limits.burst)
        self._filled_at: float | None = None  # the event loop's clock, at the first admit
        #: How many times the job had to wait for it.
        self.throttled = 0

    async def admit(self) -> None:
        """Wait until the job may open one more connection (or ask one more DNS
        question), and count it: a token bucket of `EgressLimits.rate` per second after
        a first `EgressLimits.burst`. While it waits the wall does not accept (nor read)
        for the job, whose kernel holds what it sends meanwhile."""
        limits = self.policy.limits
        while True:
            now = anyio.current_time()
            if self._filled_at is not None:
                self._tokens = min(
                    float(limits.burst), self._tokens + (now - self._filled_at) * limits.rate
                )
            self._filled_at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return
            self.throttled += 1
            if self.throttled == 1:
                _log.warning(
                    "egress.throttled",
                    rate=limits.rate,
                    burst=limits.burst,
                    reason="the job opens connections faster than its rate; the wall "
                    "takes them later",
                )
            await anyio.sleep((1.0 - self._tokens) / max(limits.rate, 1e-3))

    async def decide(self, host: str, port: int) -> Authorized | Refused:
        return await authorize(self.policy, host, port, self.resolver)

    @contextlib.contextmanager
    def slot(self) -> Iterator[bool]:
        """A place among the job's open connections; ``False``: at the limit."""
        if self.open >= self.policy.limits.connections or self.spent.is_set():
            yield False
            return
        self.open += 1
        try:
            yield True
        finally:
            self.open -= 1

    def refuse(self, via: Via, host: str, port: int, reason: str) -> None:
        self._record(EgressRecord(host=host, port=port, allowed=False, reason=reason, via=via))

    def allow(self, conn: Conn, ok: Authorized, address: str) -> None:
        self._record(
            EgressRecord(
                host=ok.host,
                port=ok.port,
                allowed=True,
                reason=f"allowed by {ok.rule.source}",
                via=conn.via,
                address=address,
                sent=conn.sent,
                received=conn.received,
            )
        )

    def _record(self, record: EgressRecord) -> None:
        if len(self.records) >= MAX_RECORDS:
            # A job that floods the wall must not grow the worker's memory (nor its logs)
            # without bound: past this, connections are counted, not listed.
            self.dropped += 1
            return
        self.records.append(record)
        fields = {k: v for k, v in structlog_fields(record).items() if v is not None}
        if record.allowed:
            _log.info("egress.allowed", **fields)
        elif self._logged_refusals < LOGGED_REFUSALS:
            self._logged_refusals += 1
            _log.warning("egress.refused", **fields)
        else:
            self.unlogged_refusals += 1

    def log_summary(self) -> None:
        """Say the refusals not logged one by one (and the records not kept), once."""
        if self.unlogged_refusals or self.dropped:
            _log.warning(
                "egress.refused",
                suppressed=self.unlogged_refusals + self.dropped,
                reason=f"{self.unlogged_refusals + self.dropped} more connections of the job "
                f"were refused or not listed after its first {LOGGED_REFUSALS} refusals "
                "were logged (the result's egress lists up to "
                f"{MAX_RECORDS}); blocked by the executor's manifest",
            )

    async def connect(self, ok: Authorized) -> tuple[socket.socket, str]:
        """A connection to the first of the checked addresses that answers.

        Raises:
            OSError: none did (the last error), within the connect timeout.
        """
        last: OSError = OSError(f"no address for {ok.host}")
        for address in ok.addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                with anyio.fail_after(self.policy.limits.connect_timeout_s):
                    try:
                        sock.connect((address, ok.port))
                    except (BlockingIOError, InterruptedError):
                        await anyio.wait_writable(sock)
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, f"connect to {address}:{ok.port}: {_strerror(err)}")
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock, address
            except TimeoutError:
                sock.close()
                last = OSError(f"connect to {address}:{ok.port} timed out")
            except OSError as exc:
                sock.close()
                last = exc
            except BaseException:
                sock.close()
                raise
        raise last

    async def pipe(self, conn: Conn, upstream: socket.socket, first: bytes = b"") -> None:
        """Relay both ways until both sides are done, the connection idles out, or the
        job's byte budget is spent (`first`: bytes of the job already read, sent first)."""
        if first:
            if not self._count(conn, len(first), up=True):
                return
            await send_all(upstream, first)
        async with anyio.create_task_group() as tg:
            relay = _Relay(self, conn, tg.cancel_scope)

            async def budget() -> None:
                await self.spent.wait()
                tg.cancel_scope.cancel()

            async def both() -> None:
                async with anyio.create_task_group() as inner:
                    inner.start_soon(relay.one_way, conn.sock, upstream, True)
                    inner.start_soon(relay.one_way, upstream, conn.sock, False)
                tg.cancel_scope.cancel()

            tg.start_soon(budget)
            tg.start_soon(both)

    def _count(self, conn: Conn, n: int, *, up: bool) -> bool:
        """Count `n` bytes; ``False`` when they would pass the job's byte budget (then
        they are not relayed, and every connection of the job is closed)."""
        if self.bytes + n > self.policy.limits.bytes:
            self.spent.set()
            return False
        conn.last = time.monotonic()
        if up:
            conn.sent += n
        else:
            conn.received += n
        self.bytes += n
        return True


class _Relay:
    """One connection's two directions (`JobTraffic.pipe`): each one way, spliced through
    a pipe or else copied, every byte counted; `scope` (the connection's) is cancelled
    when either side resets or both idle out."""

    def __init__(self, traffic: JobTraffic, conn: Conn, scope: anyio.CancelScope) -> None:
        self.traffic = traffic
        self.conn = conn
        self.scope = scope
        self.idle = traffic.policy.limits.idle_timeout_s

    async def one_way(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            try:
                pipe = _pipe()
            except OSError:
                await self._copied(src, dst, up)  # out of fds for a pipe: copy
                return
            try:
                await self._spliced(src, dst, up, *pipe)
            finally:
                os.close(pipe[0])
                os.close(pipe[1])
        except OSError:
            self.scope.cancel()  # a reset on either side ends the connection

    async def _wait(self, src: socket.socket) -> bool:
        """Wait for `src`; ``False`` when the connection idled out both ways."""
        while True:
            with anyio.move_on_after(self.idle) as waited:
                await anyio.wait_readable(src)
            if not waited.cancelled_caught:
                return True
            if time.monotonic() - self.conn.last >= self.idle:
                self.scope.cancel()  # idle both ways
                return False

    async def _spliced(
        self, src: socket.socket, dst: socket.socket, up: bool, r: int, w: int
    ) -> None:
        # splice(2) through a pipe: the bytes go socket to socket in the kernel,
        # never copied through the worker (the relay's CPU cost is what limits a
        # big download on a busy machine).
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        chunk, moved, bulk = _CHUNK, 0, False
        while True:
            if not bulk and moved >= _BULK_AFTER:
                chunk, bulk = _grow(w, _BULK_PIPE, chunk), True  # tried once
            room = self.traffic.policy.limits.bytes - self.traffic.bytes
            try:
                n = os.splice(src.fileno(), w, min(chunk, max(room, 1)), flags=flags)
            except BlockingIOError:
                if not await self._wait(src):
                    return
                continue
            if n == 0:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            if not self.traffic._count(self.conn, n, up=up):
                return  # the budget task closes the connection
            moved += n
            while n:
                try:
                    n -= os.splice(r, dst.fileno(), n, flags=flags)
                except BlockingIOError:
                    await anyio.wait_writable(dst)

    async def _copied(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        while True:
            with anyio.move_on_after(self.idle) as waited:
                data = await recv_some(src)
            if waited.cancelled_caught:
                if time.monotonic() - self.conn.last >= self.idle:
                    self.scope.cancel()  # idle both ways
                    return
                continue  # the other direction is busy
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            if not self.traffic._count(self.conn, len(data), up=up):
                return  # the budget task closes the connection
            await send_all(dst, data)


def _pipe() -> tuple[int, int]:
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    _grow(w, _CHUNK, 0)
    return r, w


def _grow(fd: int, size: int, current: int) -> int:
    """Resize the pipe to `size` bytes, best effort: the size it has afterwards (the
    kernel's answer, or `current` when refused: over pipe-max-size or the user's pages)."""
    try:
        return int(fcntl.fcntl(fd, _F_SETPIPE_SZ, size))
    except OSError:
        return current or _DEFAULT_PIPE


def structlog_fields(record: EgressRecord) -> dict[str, object]:
    return {
        "host": record.host,
        "port": record.port,
        "via": record.via,
        "reason": record.reason,
        "address": record.address,
        "sent": record.sent,
        "received": record.received,
    }


def _strerror(err: int) -> str:
    return os.strerror(err)
