"""A small HTTP server on 127.0.0.1 that misbehaves on purpose (robust_fetch's tests)."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class Bad:
    """What the server does wrong, and what it sent (body bytes, requests)."""

    def __init__(self, data: bytes, mode: str, *, drop_after: int = 0, corrupt_at: int = 0):
        self.data = data
        self.mode = mode
        self.drop_after = drop_after
        self.corrupt_at = corrupt_at
        self.sent = 0
        self.requests: list[str | None] = []
        self.dropped = 0
        self.corrupted = 0
        self.lock = threading.Lock()

    def body(self, start: int, end: int) -> bytes:
        if self.mode == "different":
            return os.urandom(end - start + 1)
        if self.mode == "same_wrong":
            return bytes(b ^ 0xFF for b in self.data[start : end + 1])
        chunk = self.data[start : end + 1]
        if self.mode == "corrupt_once" and start <= self.corrupt_at <= end and not self.corrupted:
            self.corrupted += 1
            i = self.corrupt_at - start
            chunk = chunk[:i] + bytes([chunk[i] ^ 1]) + chunk[i + 1 :]
        return chunk


def _handler(bad: Bad) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            rng = self.headers.get("Range")
            with bad.lock:
                bad.requests.append(rng)
            size = len(bad.data)
            m = _RANGE.match(rng or "")
            if bad.mode.startswith("ignore_range") or m is None:
                start, end, status = 0, size - 1, 200
            else:
                start = int(m.group(1))
                end = min(int(m.group(2) or size - 1), size - 1)
                status = 206
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            body = bad.body(start, end)
            self.send_response(status)
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.send_header("ETag", '"v1"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            drop = bad.mode.endswith("drop_once") and not bad.dropped and len(body) > 0
            if drop and (status == 200 or start > 0):
                bad.dropped += 1
                body = body[: bad.drop_after]
                self.close_connection = True
            # Counted before the write: the client may finish (and the test read the
            # count) before this thread runs again.
            with bad.lock:
                bad.sent += len(body)
            self.wfile.write(body)
            self.wfile.flush()

    return Handler


@contextlib.contextmanager
def serving() -> Iterator[Callable[[Bad], str]]:
    """``start(bad) -> url``: a server per call, each shut down and joined on exit."""
    servers: list[ThreadingHTTPServer] = []
    threads: list[threading.Thread] = []

    def start(bad: Bad, name: str = "runtime.bin") -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(bad))
        server.daemon_threads = True
        t = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        t.start()
        servers.append(server)
        threads.append(t)
        return f"http://127.0.0.1:{server.server_address[1]}/{name}"

    try:
        yield start
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        for t in threads:
            t.join(5)
