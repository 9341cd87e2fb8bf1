"""robust_fetch against a misbehaving HTTP server on 127.0.0.1 (real sockets, real httpx)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from metnos_exec.devices.fetch import RANGE_BYTES, FetchError, robust_fetch
from tests.conftest import need_import
from tests.helpers.http_server import Bad, serving

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _needs_device_extra() -> None:
    need_import("httpx", "device")


Serve = Callable[[Bad], str]


@pytest.fixture
def serve() -> Iterator[Serve]:
    with serving() as start:
        yield start


def payload(n: int) -> bytes:
    # Not all zeros: a misplaced range would change the hash.
    return hashlib.sha256(b"seed").digest() * (n // 32) + b"x" * (n % 32)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_resumes_after_a_drop_mid_range_refetching_less_than_one_range(
    serve: Serve, tmp_path: Path
) -> None:
    data = payload(2 * RANGE_BYTES + 12345)
    bad = Bad(data, "drop_once", drop_after=3 * 1024 * 1024)
    url = serve(bad)
    with capture_logs() as logs:
        out = await robust_fetch(url, sha(data), tmp_path / "rt.bin", retry_delay_s=0)
    assert out.read_bytes() == data
    assert bad.dropped == 1
    refetched = bad.sent - len(data)
    assert 0 <= refetched < RANGE_BYTES
    # The request after the drop starts where the dropped range's bytes ended.
    resumed = f"bytes={RANGE_BYTES + 3 * 1024 * 1024}-"
    assert [r for r in bad.requests if r and r.startswith(resumed)], bad.requests
    assert not (tmp_path / "rt.bin.part").exists()
    events = [r["event"] for r in logs]
    assert "fetch.retry" in events and events[-1] == "fetch.finished"
    assert any(r["event"] == "fetch.progress" for r in logs)  # not a terminal here


async def test_a_part_file_left_by_an_earlier_run_is_resumed(serve: Serve, tmp_path: Path) -> None:
    data = payload(300_000)
    bad = Bad(data, "ok")
    url = serve(bad)
    (tmp_path / "rt.bin.part").write_bytes(data[:200_000])
    out = await robust_fetch(url, sha(data), tmp_path / "rt.bin", range_bytes=64 * 1024)
    assert out.read_bytes() == data
    assert bad.sent == 100_000
    assert bad.requests[0] == "bytes=200000-265535"


async def test_one_corrupted_copy_is_detected_and_fetched_again(
    serve: Serve, tmp_path: Path
) -> None:
    data = payload(500_000)
    bad = Bad(data, "corrupt_once", corrupt_at=333_333)
    url = serve(bad)
    with capture_logs() as logs:
        out = await robust_fetch(url, sha(data), tmp_path / "rt.bin", range_bytes=100_000)
    assert out.read_bytes() == data
    assert bad.corrupted == 1 and bad.sent == 2 * len(data)
    retries = [r for r in logs if r["event"] == "fetch.retry"]
    assert retries and retries[0]["reason"] == "sha256_mismatch"
    assert retries[0]["pinned"] == sha(data) and retries[0]["got"] != sha(data)


async def test_a_server_that_ignores_range_still_completes(serve: Serve, tmp_path: Path) -> None:
    data = payload(400_000)
    bad = Bad(data, "ignore_range")
    url = serve(bad)
    # A stale .part cannot be resumed against such a server: it is discarded, not spliced.
    (tmp_path / "rt.bin.part").write_bytes(b"stale" * 1000)
    out = await robust_fetch(url, sha(data), tmp_path / "rt.bin", range_bytes=64 * 1024)
    assert out.read_bytes() == data
    assert len(bad.requests) == 1 and bad.sent == len(data)


async def test_a_server_that_ignores_range_and_drops_starts_over(
    serve: Serve, tmp_path: Path
) -> None:
    data = payload(400_000)
    bad = Bad(data, "ignore_range_drop_once", drop_after=150_000)
    url = serve(bad)
    out = await robust_fetch(url, sha(data), tmp_path / "rt.bin", retry_delay_s=0)
    assert out.read_bytes() == data
    assert bad.dropped == 1 and bad.sent == len(data) + 150_000


async def test_a_server_that_always_serves_different_bytes_is_a_clear_error(
    serve: Serve, tmp_path: Path
) -> None:
    data = payload(100_000)
    bad = Bad(data, "different")
    url = serve(bad)
    with pytest.raises(FetchError) as info:
        await robust_fetch(url, sha(data), tmp_path / "rt.bin", max_copies=3)
    msg = info.value.message
    assert info.value.code == "E_FETCH"
    assert "3 downloads never matched" in msg and sha(data) in msg
    assert len(re.findall(r"\b[0-9a-f]{64}\b", msg)) == 4  # the pin and the three copies
    assert not (tmp_path / "rt.bin").exists() and not (tmp_path / "rt.bin.part").exists()


async def test_two_copies_that_agree_on_the_wrong_hash_name_both(
    serve: Serve, tmp_path: Path
) -> None:
    data = payload(100_000)
    bad = Bad(data, "same_wrong")
    url = serve(bad)
    wrong = sha(bytes(b ^ 0xFF for b in data))
    with pytest.raises(FetchError, match="two downloads agree") as info:
        await robust_fetch(url, sha(data), tmp_path / "rt.bin")
    assert wrong in info.value.message and sha(data) in info.value.message
    assert bad.sent == 2 * len(data)
    assert not (tmp_path / "rt.bin").exists()


async def test_an_existing_matching_file_needs_no_request(serve: Serve, tmp_path: Path) -> None:
    data = payload(1000)
    bad = Bad(data, "ok")
    url = serve(bad)
    (tmp_path / "rt.bin").write_bytes(data)
    await robust_fetch(url, sha(data), tmp_path / "rt.bin")
    assert bad.requests == []


async def test_no_pin_no_download(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="not 64 hex digits"):
        await robust_fetch("http://127.0.0.1:9/x", "", tmp_path / "x")


async def test_a_dead_server_gives_up_after_bounded_tries(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(FetchError, match="gave up after 3 tries"):
        await robust_fetch(
            f"http://127.0.0.1:{port}/x", "0" * 64, tmp_path / "x", max_tries=3, retry_delay_s=0
        )


async def test_progress_draws_a_bar_on_a_terminal(serve: Serve, tmp_path: Path) -> None:
    import io

    from metnos_exec.devices.fetch import _Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    data = payload(200_000)
    url = serve(Bad(data, "ok"))
    screen = Tty()
    await robust_fetch(
        url, sha(data), tmp_path / "rt.bin", range_bytes=50_000, progress=_Progress(url, screen)
    )
    assert "100.0%" in screen.getvalue() and "[###" in screen.getvalue()
