"""``GET /metrics`` on an anyio TCP listener, in the worker's own event loop.

Why not prometheus_client's ``start_http_server``: it runs a ``ThreadingHTTPServer`` in a
daemon thread, outside the worker's structured concurrency (nothing joins it, a failure
in it is nobody's), and it could only read the queue depth by calling the async broker
from a foreign thread. The listener here is one task in the supervisor's task group, on
asyncio and trio alike: it reads the broker's counts with the broker's own client (cached,
`metrics.QUEUE_CACHE_S`), renders with ``generate_latest`` (microseconds for this many
series) and closes the connection. It answers one request per connection (no keep-alive)
with a small read limit and a deadline: Prometheus needs nothing more.

Bind: loopback unless the operator says otherwise (`check_bind`): the page names the
executors and the error codes of the queue.
"""

from __future__ import annotations

import contextlib
import ipaddress
from typing import TYPE_CHECKING, Final

import anyio
import anyio.abc

from ..errors import BadConfig
from ..logs import get_logger

if TYPE_CHECKING:
    from ._observer import ObservedWorker
    from .metrics import Metrics

__all__ = ("PUBLIC_FLAG", "check_bind", "serve_metrics")

#: The worker option that allows a bind outside loopback.
PUBLIC_FLAG: Final = "--metrics-public"

#: A request larger than this, or slower than `_READ_S`, is dropped.
_MAX_REQUEST: Final = 8192
_READ_S: Final = 5.0

_log = get_logger()

_CONTENT_TYPE: Final = b"text/plain; version=0.0.4; charset=utf-8"


def check_bind(text: str, *, public: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port), refusing a host outside loopback unless `public`.

    Raises:
        BadConfig: not ``HOST:PORT``, a bad port, or a non-loopback host without `public`.
    """
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise BadConfig(f"--metrics takes HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}")
    if not public and not _loopback(host):
        raise BadConfig(
            f"--metrics {text}: {host} is not a loopback address; the metrics name the "
            f"queue's executors and errors: add {PUBLIC_FLAG} to serve them there"
        )
    return host, int(port_text)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


async def open_listener(metrics: Metrics) -> anyio.abc.Listener[anyio.abc.SocketStream]:
    """The listener on ``metrics.bind``.

    Raises:
        BadConfig: the address cannot be bound (in use, not this host's).
    """
    assert metrics.bind is not None
    host, port = metrics.bind
    try:
        return await anyio.create_tcp_listener(local_host=host, local_port=port)
    except OSError as exc:
        raise BadConfig(f"cannot serve metrics on {host}:{port}: {exc}") from None


async def serve_metrics(
    metrics: Metrics,
    source: ObservedWorker,
    *,
    listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/metrics`` until cancelled, on `listener` (default: `open_listener`).

    Raises:
        BadConfig: the address cannot be bound (in use, not this host's).
    """
    if listener is None:
        listener = await open_listener(metrics)

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            # The scraper went away: nothing to tell it.
            with contextlib.suppress(anyio.BrokenResourceError, anyio.EndOfStream, OSError):
                try:
                    await _answer(stream, metrics, source)
                except Exception as exc:
                    # A bug in the metrics must not stop the worker serving jobs.
                    _log.exception("worker.error", error=f"/metrics: {type(exc).__name__}: {exc}")
                    await _reply(stream, b"500 Internal Server Error", b"", b"text/plain")

    async with listener:
        metrics.port = listener.extra(anyio.abc.SocketAttribute.local_port, None)
        task_status.started()
        await listener.serve(handle)


async def _answer(stream: anyio.abc.SocketStream, metrics: Metrics, source: ObservedWorker) -> None:
    head = b""
    with anyio.move_on_after(_READ_S):
        while b"\r\n\r\n" not in head and len(head) < _MAX_REQUEST:
            head += await stream.receive(4096)
    line = head.split(b"\r\n", 1)[0].split()
    if len(line) < 2 or line[0] not in (b"GET", b"HEAD"):
        await _reply(stream, b"405 Method Not Allowed", b"GET /metrics\n", b"text/plain")
        return
    if line[1].split(b"?", 1)[0] != b"/metrics":
        await _reply(stream, b"404 Not Found", b"GET /metrics\n", b"text/plain")
        return
    await refresh(metrics, source)
    body = metrics.render()
    await _reply(stream, b"200 OK", b"" if line[0] == b"HEAD" else body, _CONTENT_TYPE)


async def refresh(metrics: Metrics, source: ObservedWorker) -> None:
    """Set the gauges read at scrape time: this worker's slots, the queue's counts."""
    metrics.running.set(source.running)
    metrics.slots_free.set(source.free_slots)
    if not metrics.queue_due():
        return
    try:
        stats = await source.broker.stats()
    except Exception:
        # The store is down: the counts stay as last read; the broker errors counter
        # and the worker's broker.error records say why.
        return
    counts = {
        "queued": stats.queued,
        "delayed": stats.delayed,
        "leased": stats.running,
        "done": stats.done,
        "dead": stats.dead,
    }
    metrics.set_queue(counts, getattr(stats, "oldest_queued_at", None))


async def _reply(stream: anyio.abc.SocketStream, status: bytes, body: bytes, kind: bytes) -> None:
    head = (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind
        + b"\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n"
    )  # fmt: skip
    await stream.send(head + body)
