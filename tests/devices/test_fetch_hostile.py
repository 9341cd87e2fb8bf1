"""robust_fetch against a hostile server on 127.0.0.1: raw sockets, answers no honest
server gives (endless bodies, redirect loops), and a ``.part`` planted as a symlink."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from metnos_exec.devices.fetch import FetchError, robust_fetch
from tests.conftest import need_import

pytestmark = pytest.mark.anyio

Handler = Callable[[socket.socket, str], None]


@pytest.fixture(autouse=True)
def _needs_device_extra() -> None:
    need_import("httpx", "device")


def _read_request(conn: socket.socket) -> str:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(4096)
        if not data:
            break
        buf += data
    return buf.decode("latin-1")


def _endless(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while True:
            conn.sendall(b"x" * 65536)


@pytest.fixture
def hostile() -> Iterator[Callable[[Handler], str]]:
    """``start(handler) -> url``: ``handler(conn, request)`` answers each connection."""
    listeners: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def start(handler: Handler) -> str:
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(16)
        listeners.append(lsock)

        def one(conn: socket.socket) -> None:
            with conn:
                handler(conn, _read_request(conn))

        def accept() -> None:
            while True:
                try:
                    conn, _ = lsock.accept()
                except OSError:
                    return
                t = threading.Thread(target=one, args=(conn,), daemon=True)
                threads.append(t)
                t.start()

        t = threading.Thread(target=accept, daemon=True)
        threads.append(t)
        t.start()
        return f"http://127.0.0.1:{lsock.getsockname()[1]}/rt.bin"

    try:
        yield start
    finally:
        for lsock in listeners:
            with contextlib.suppress(OSError):
                lsock.shutdown(socket.SHUT_RDWR)
            lsock.close()
        for t in threads:
            t.join(5)


async def test_an_endless_206_body_is_cut_at_the_range_it_announced(
    hostile: Callable[[Handler], str], tmp_path: Path
) -> None:
    data = b"0123456789"

    def answer(conn: socket.socket, request: str) -> None:
        conn.sendall(
            b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-9/10\r\n"
            b"Connection: close\r\n\r\n" + data
        )
        _endless(conn)  # no Content-Length: the body never ends

    url = hostile(answer)
    with anyio.fail_after(20):
        out = await robust_fetch(url, hashlib.sha256(data).hexdigest(), tmp_path / "rt.bin")
    assert out.read_bytes() == data


async def test_an_endless_200_body_stops_at_max_bytes(
    hostile: Callable[[Handler], str], tmp_path: Path
) -> None:
    def answer(conn: socket.socket, request: str) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        _endless(conn)

    url = hostile(answer)
    with anyio.fail_after(20), pytest.raises(FetchError, match="past 1048576 bytes"):
        await robust_fetch(url, "0" * 64, tmp_path / "rt.bin", max_bytes=1 << 20)
    assert not (tmp_path / "rt.bin.part").exists()


async def test_an_announced_size_beyond_max_bytes_is_refused_before_the_body(
    hostile: Callable[[Handler], str], tmp_path: Path
) -> None:
    def answer(conn: socket.socket, request: str) -> None:
        conn.sendall(
            b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-9/99999999999\r\n"
            b"Content-Length: 10\r\nConnection: close\r\n\r\n0123456789"
        )

    url = hostile(answer)
    with anyio.fail_after(20), pytest.raises(FetchError, match="announces 99999999999 bytes"):
        await robust_fetch(url, "0" * 64, tmp_path / "rt.bin", max_bytes=1 << 20)


async def test_a_content_range_ending_before_it_starts_is_not_written(
    hostile: Callable[[Handler], str], tmp_path: Path
) -> None:
    data = b"abcdefghij"

    def answer(conn: socket.socket, request: str) -> None:
        if "bytes=0-" in request:
            head = b"Content-Range: bytes 0-4/10\r\nContent-Length: 5\r\n"
            body = data[:5]
        else:  # asked for bytes 5-: claims 5-2, sends garbage
            head = b"Content-Range: bytes 5-2/10\r\nContent-Length: 9\r\n"
            body = b"GARBAGE!!"
        conn.sendall(
            b"HTTP/1.1 206 Partial Content\r\n" + head + b"Connection: close\r\n\r\n" + body
        )

    url = hostile(answer)
    with anyio.fail_after(20), pytest.raises(FetchError):
        await robust_fetch(
            url,
            hashlib.sha256(data).hexdigest(),
            tmp_path / "rt.bin",
            retry_delay_s=0,
            max_tries=2,
        )
    part = tmp_path / "rt.bin.part"
    assert part.read_bytes() == data[:5]


async def test_a_redirect_loop_is_a_fetch_error(
    hostile: Callable[[Handler], str], tmp_path: Path
) -> None:
    def answer(conn: socket.socket, request: str) -> None:
        conn.sendall(
            b"HTTP/1.1 302 Found\r\nLocation: /rt.bin\r\nContent-Length: 0\r\n"
            b"Connection: close\r\n\r\n"
        )

    url = hostile(answer)
    with anyio.fail_after(20), pytest.raises(FetchError, match="redirect"):
        await robust_fetch(url, "0" * 64, tmp_path / "rt.bin", retry_delay_s=0)


async def test_a_redirect_to_file_is_a_fetch_error_without_retries(
    hostile: Callable[[Handler], str], tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    requests: list[str] = []

    def answer(conn: socket.socket, request: str) -> None:
        requests.append(request)
        conn.sendall(
            b"HTTP/1.1 302 Found\r\nLocation: file://" + str(secret).encode() + b"\r\n"
            b"Content-Length: 0\r\nConnection: close\r\n\r\n"
        )

    url = hostile(answer)
    with anyio.fail_after(20), pytest.raises(FetchError, match="file://"):
        await robust_fetch(url, hashlib.sha256(b"s3cret").hexdigest(), tmp_path / "d" / "rt.bin")
    assert len(requests) == 1
    assert not (tmp_path / "d" / "rt.bin").exists()


async def test_a_part_file_planted_as_a_symlink_is_not_written_through(
    hostile: Callable[[Handler], str], tmp_path: Path
) -> None:
    data = b"runtime bytes" * 100
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    dest = tmp_path / "d" / "rt.bin"
    dest.parent.mkdir()
    (dest.parent / "rt.bin.part").symlink_to(victim)

    def answer(conn: socket.socket, request: str) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(data) + data
        )

    url = hostile(answer)
    with anyio.fail_after(20):
        out = await robust_fetch(url, hashlib.sha256(data).hexdigest(), dest)
    assert victim.read_bytes() == b"precious"
    assert not out.is_symlink() and out.read_bytes() == data


async def test_a_server_trickling_below_every_timeout_is_cut_at_the_deadline(
    hostile: Callable[[Handler], str], tmp_path: Path
) -> None:
    # One byte every 50 ms: no read ever times out, and every range makes progress, so
    # without a deadline the retries never end (30 MB would take weeks).
    stop = threading.Event()

    def answer(conn: socket.socket, request: str) -> None:
        conn.sendall(
            b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-999999/1000000\r\n"
            b"Content-Length: 1000000\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            while not stop.wait(0.05):
                conn.sendall(b"x")

    url = hostile(answer)
    try:
        with anyio.fail_after(20), pytest.raises(FetchError, match=r"within 1\.0 s"):
            await robust_fetch(url, "0" * 64, tmp_path / "rt.bin", timeout_s=5, deadline_s=1.0)
    finally:
        stop.set()
    assert (tmp_path / "rt.bin.part").exists()  # kept: a later call resumes it


async def test_a_redirect_to_file_through_the_callers_client_is_not_retried(
    hostile: Callable[[Handler], str], tmp_path: Path
) -> None:
    import httpx

    requests: list[str] = []

    def answer(conn: socket.socket, request: str) -> None:
        requests.append(request)
        conn.sendall(
            b"HTTP/1.1 302 Found\r\nLocation: file:///etc/passwd\r\n"
            b"Content-Length: 0\r\nConnection: close\r\n\r\n"
        )

    url = hostile(answer)
    async with httpx.AsyncClient(follow_redirects=True) as client:
        with anyio.fail_after(20), pytest.raises(FetchError, match="file://"):
            await robust_fetch(url, "0" * 64, tmp_path / "rt.bin", client=client)
    assert len(requests) == 1
