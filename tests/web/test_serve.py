"""``metnos-exec web`` as a real process on a free loopback port (asyncio and trio), and
its start rules: a bind off loopback or ``--allow-actions`` without a token refuses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from metnos_exec.errors import BadConfig
from tests.conftest import need_import
from tests.helpers.web_queue import fill_queue

need_import("starlette", "web")
need_import("hypercorn", "web")
need_import("httpx", "web-test")

import httpx  # noqa: E402

from metnos_exec.web.serve import check_settings, parse_bind  # noqa: E402

TOKEN = "t0ken-for-the-tests-0123456789"


def test_bind_rules() -> None:
    url = "sqlite:///q.db"
    assert parse_bind("127.0.0.1:8765") == ("127.0.0.1", 8765)
    assert parse_bind("[::1]:0") == ("::1", 0)
    for bad in ("127.0.0.1", ":80", "127.0.0.1:http", "127.0.0.1:70000"):
        with pytest.raises(BadConfig, match="HOST:PORT"):
            parse_bind(bad)
    # Loopback (any of 127/8, ::1, localhost): no token needed to read.
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        s = check_settings(host, 1, broker_url=url, token=None, allow_actions=False, environ={})
        assert s.token is None and "127.0.0.1:1" in s.hosts
    bind_any = "0.0.0.0"  # only a bind address here: nothing listens or connects
    with pytest.raises(BadConfig, match="other than loopback"):
        check_settings(bind_any, 1, broker_url=url, token=None, allow_actions=False, environ={})
    with pytest.raises(BadConfig, match="other than loopback"):
        check_settings("myhost", 1, broker_url=url, token=None, allow_actions=False, environ={})
    with pytest.raises(BadConfig, match="--allow-actions needs a token"):
        check_settings("127.0.0.1", 1, broker_url=url, token=None, allow_actions=True, environ={})
    with pytest.raises(BadConfig, match="at least 16"):
        check_settings("127.0.0.1", 1, broker_url=url, token="short", allow_actions=True)
    off = check_settings(
        bind_any, 1, broker_url=url, token=None, allow_actions=True,
        environ={"METNOS_WEB_TOKEN": TOKEN},
    )  # fmt: skip
    # Off loopback the Host is not checked (no name is known): the token guards reads too.
    assert off.token == TOKEN and off.hosts == ()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "metnos_exec", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_the_command_refuses_unsafe_starts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    no_token = _cli("web", "--broker", url, "--bind", "0.0.0.0:0", env={"METNOS_WEB_TOKEN": ""})
    assert no_token.returncode == 2
    assert "other than loopback" in no_token.stderr
    actions = _cli("web", "--broker", url, "--allow-actions", env={"METNOS_WEB_TOKEN": ""})
    assert actions.returncode == 2 and "needs a token" in actions.stderr
    missing = _cli("web", "--broker", url, "--bind", "127.0.0.1:0")
    assert missing.returncode == 4 and "E_BROKER_UNAVAILABLE" in missing.stderr


@pytest.fixture
def served(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, str]]]:
    url, ids = fill_queue(tmp_path / "q.db")
    err = tmp_path / "web.err"
    with open(err, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "metnos_exec", "web", "--broker", url, "--bind",
             "127.0.0.1:0", "--backend", request.param, "--allow-actions", "--token", TOKEN],
            stdout=subprocess.DEVNULL,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while b"serving on " not in err.read_bytes():
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "the view did not start"
            time.sleep(0.02)  # polling its stderr, with a deadline
        base = err.read_text().split("serving on ", 1)[1].split()[0].rstrip("/")
        yield base, ids
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("served", ["asyncio", "trio"], indirect=True)
def test_a_real_view_serves_the_page_and_the_api(served: tuple[str, dict[str, str]]) -> None:
    base, ids = served
    assert base.startswith("http://127.0.0.1:")
    with httpx.Client(base_url=base, timeout=10) as http:
        page = http.get("/")
        assert page.status_code == 200 and '<script src="/app.js"' in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert http.get("/api/overview").status_code == 401
        doc = http.get("/api/overview", headers={"x-metnos-token": TOKEN}).json()
        assert doc["counts"]["running"] == 1
        assert {j["job_id"] for j in doc["recent"]} >= {ids["ok"], ids["refused"]}
        cancel = http.post(
            f"/api/jobs/{ids['queued']}/cancel",
            headers={"x-metnos-token": TOKEN, "origin": base},
        )
        assert cancel.json() == {"outcome": "cancelled"}
