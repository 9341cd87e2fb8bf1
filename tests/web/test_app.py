"""The view's app through Starlette's TestClient, on a real SQLite queue with a job in
every state, on both anyio backends: what it shows, and the guards (headers, Host,
token, read-only, Origin)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers import open_broker
from tests.conftest import need_import
from tests.helpers.web_queue import ESCAPES, HOSTILE, fill_queue, fill_url

need_import("starlette", "web")
need_import("httpx", "web-test")

from starlette.testclient import TestClient  # noqa: E402

from metnos_exec.web.app import CSP, TOKEN_HEADER, WebSettings, create_app  # noqa: E402
from metnos_exec.web.serve import check_settings  # noqa: E402
from metnos_exec.web.snapshot import RunningClock  # noqa: E402

TOKEN = "t0ken-for-the-tests-0123456789"
ORIGIN = "http://127.0.0.1:8765"


@pytest.fixture
def queue(tmp_path: Path) -> tuple[str, dict[str, str]]:
    return fill_queue(tmp_path / "q.db")


def client(settings: WebSettings, backend: str) -> TestClient:
    return TestClient(create_app(settings), base_url=ORIGIN, backend=backend)


@pytest.fixture
def view(queue: tuple[str, dict[str, str]], anyio_backend: str) -> Iterator[TestClient]:
    url, _ = queue
    settings = check_settings("127.0.0.1", 8765, broker_url=url, token=None, allow_actions=False)
    with client(settings, anyio_backend) as c:
        yield c


@pytest.fixture
def acting(queue: tuple[str, dict[str, str]], anyio_backend: str) -> Iterator[TestClient]:
    url, _ = queue
    settings = check_settings("127.0.0.1", 8765, broker_url=url, token=TOKEN, allow_actions=True)
    with client(settings, anyio_backend) as c:
        yield c


def state_of(url: str, job_id: str) -> tuple[str, str | None]:
    async def look() -> tuple[str, str | None]:
        async with open_broker(url, create=False) as b:
            state = await b.get_job_state(job_id)
            result = await b.get_result(job_id)
        assert state is not None
        return state.state, result.status if result else None

    return anyio.run(look)


def test_overview_shows_every_state_the_walls_and_the_workers(
    view: TestClient, queue: tuple[str, dict[str, str]]
) -> None:
    _, ids = queue
    doc = view.get("/api/overview").json()
    c = doc["counts"]
    assert (c["queued"], c["running"], c["done"], c["dead"]) == (1, 1, 4, 1)
    assert [j["job_id"] for j in doc["running"]] == [ids["running"]]
    assert doc["running"][0]["worker"] == "w1" and doc["running"][0]["since_seen"] is True
    assert [j["job_id"] for j in doc["queued"]] == [ids["queued"]]
    recent = {j["job_id"]: j for j in doc["recent"]}
    assert recent[ids["ok"]]["walls"] == {
        "files": "kept",
        "network": "kept",
        "process_tree": "kept",
        "user": "kept",
        "resources": "kept",
        "sandbox": "bwrap",
    }
    degraded = recent[ids["degraded"]]["walls"]
    assert (degraded["network"], degraded["resources"]) == ("not_kept", "partial")
    assert recent[ids["refused"]]["walls"] is None
    assert recent[ids["refused"]]["error"]["code"] == "E_CAPABILITY_DENIED"
    assert recent[ids["dead"]]["status"] == "dead"
    assert [(d["job_id"], d["code"]) for d in doc["dead"]] == [(ids["dead"], "E_LEASE_EXPIRED")]
    [worker] = doc["workers"]
    assert (worker["id"], worker["state"], worker["running"], worker["slots"]) == (
        "w1",
        "live",
        1,
        4,
    )
    assert doc["view"] == {"actions": False}


def test_job_detail_has_arguments_reasons_and_raw_output(
    view: TestClient, queue: tuple[str, dict[str, str]]
) -> None:
    _, ids = queue
    degraded = view.get(f"/api/jobs/{ids['degraded']}").json()
    assert degraded["job"]["args"] == {"n": 2}
    assert degraded["containment"]["network"] == {
        "state": "not_kept",
        "reason": "no network namespace: host network",
    }
    # JSON is exact: the page escapes where it renders, the API never mangles the data.
    hostile = view.get(f"/api/jobs/{ids['hostile']}").json()
    assert hostile["result"]["stderr"] == HOSTILE + ESCAPES
    assert hostile["job"]["args"]["note"] == HOSTILE + ESCAPES
    dead = view.get(f"/api/jobs/{ids['dead']}").json()
    assert dead["dead_letter"]["code"] == "E_LEASE_EXPIRED"
    missing = view.get("/api/jobs/01NOSUCHJOB")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "E_NOT_FOUND"


def test_every_answer_carries_the_security_headers(view: TestClient) -> None:
    for path in ("/", "/app.js", "/style.css", "/api/overview", "/api/jobs/x", "/nope"):
        r = view.get(path)
        assert r.headers["content-security-policy"] == CSP, path
        assert r.headers["x-content-type-options"] == "nosniff", path
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert "unsafe-inline" not in CSP and "unsafe-eval" not in CSP
    assert view.get("/app.js").headers["content-type"].startswith("text/javascript")
    assert view.get("/api/overview").headers["content-type"] == "application/json"


def test_a_foreign_host_is_refused_on_a_loopback_bind(view: TestClient) -> None:
    # DNS rebinding: another site's name pointed at 127.0.0.1 must not read the queue.
    r = view.get("/api/overview", headers={"host": "rebind.example:8765"})
    assert r.status_code == 421 and r.json()["error"]["code"] == "E_WEB_HOST"
    assert view.get("/", headers={"host": "rebind.example:8765"}).status_code == 421
    for host in ("localhost:8765", "127.0.0.1:8765", "[::1]:8765"):
        assert view.get("/api/overview", headers={"host": host}).status_code == 200, host


def test_read_only_by_default(view: TestClient, queue: tuple[str, dict[str, str]]) -> None:
    url, ids = queue
    for verb in ("cancel", "undo"):
        r = view.post(f"/api/jobs/{ids['running']}/{verb}", headers={"origin": ORIGIN})
        assert r.status_code == 403 and r.json()["error"]["code"] == "E_WEB_READ_ONLY"
    assert state_of(url, ids["running"]) == ("running", None)
    r = view.post(f"/api/jobs/{ids['dead']}/retry", headers={"origin": ORIGIN})
    assert r.status_code == 403 and r.json()["error"]["code"] == "E_WEB_READ_ONLY"
    assert _queued(url) == 1  # the fill's one queued job, nothing more


def _queued(url: str) -> int:
    async def look() -> int:
        async with open_broker(url, create=False) as b:
            return (await b.stats()).queued

    return anyio.run(look)


def test_a_dead_letter_is_retried_with_the_token_from_this_origin(
    acting: TestClient, queue: tuple[str, dict[str, str]]
) -> None:
    url, ids = queue
    target = f"/api/jobs/{ids['dead']}/retry"
    assert acting.post(target, headers={"origin": ORIGIN}).status_code == 401
    other = acting.post(target, headers={TOKEN_HEADER: TOKEN, "origin": "http://evil.example"})
    assert other.status_code == 403 and other.json()["error"]["code"] == "E_WEB_ORIGIN"
    cross = acting.post(target, headers={TOKEN_HEADER: TOKEN, "sec-fetch-site": "cross-site"})
    assert cross.status_code == 403
    assert _queued(url) == 1
    done = acting.post(target, headers={TOKEN_HEADER: TOKEN, "origin": ORIGIN})
    assert done.status_code == 200, done.text
    new_id = done.json()["job_id"]
    assert new_id != ids["dead"]

    async def look() -> tuple[Any, Any, Any]:
        async with open_broker(url, create=False) as b:
            return (
                await b.get_job(ids["dead"]),
                await b.get_job(new_id),
                await b.get_job_state(ids["dead"]),
            )

    old, new, old_state = anyio.run(look)
    assert (new.executor, new.args) == (old.executor, old.args)
    assert old_state.state == "dead"  # the record of what happened stays
    assert state_of(url, new_id) == ("queued", None)
    # Only a dead letter is retried.
    again = acting.post(
        f"/api/jobs/{ids['ok']}/retry", headers={TOKEN_HEADER: TOKEN, "origin": ORIGIN}
    )
    assert again.status_code == 409 and again.json()["error"]["code"] == "E_RETRY_UNAVAILABLE"


def test_with_a_token_every_api_call_needs_it(
    acting: TestClient, queue: tuple[str, dict[str, str]]
) -> None:
    _, ids = queue
    assert acting.get("/").status_code == 200  # the page holds no data
    assert acting.get("/api/overview").status_code == 401
    wrong = acting.get("/api/overview", headers={TOKEN_HEADER: TOKEN + "x"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "E_WEB_TOKEN"
    assert acting.get(f"/api/jobs/{ids['ok']}").status_code == 401
    ok = acting.get("/api/overview", headers={TOKEN_HEADER: TOKEN})
    assert ok.status_code == 200 and ok.json()["view"] == {"actions": True}


def test_an_action_needs_the_token_and_this_origin(
    acting: TestClient, queue: tuple[str, dict[str, str]]
) -> None:
    url, ids = queue
    target = f"/api/jobs/{ids['queued']}/cancel"
    assert acting.post(target, headers={"origin": ORIGIN}).status_code == 401
    other = acting.post(target, headers={TOKEN_HEADER: TOKEN, "origin": "http://evil.example"})
    assert other.status_code == 403 and other.json()["error"]["code"] == "E_WEB_ORIGIN"
    cross = acting.post(target, headers={TOKEN_HEADER: TOKEN, "sec-fetch-site": "cross-site"})
    assert cross.status_code == 403
    assert state_of(url, ids["queued"]) == ("queued", None)
    done = acting.post(target, headers={TOKEN_HEADER: TOKEN, "origin": ORIGIN})
    assert done.status_code == 200 and done.json() == {"outcome": "cancelled"}
    assert state_of(url, ids["queued"]) == ("done", "cancelled")
    # Nothing to undo: refused with the client's reason.
    undo = acting.post(
        f"/api/jobs/{ids['ok']}/undo", headers={TOKEN_HEADER: TOKEN, "origin": ORIGIN}
    )
    assert undo.status_code == 409 and undo.json()["error"]["code"] == "E_UNDO_UNAVAILABLE"


def test_the_page_script_never_parses_job_data_as_html() -> None:
    """The page's one rule, checked in its source: no HTML sink at all (the browser test
    checks the rendered DOM)."""
    js = resources.files("metnos_exec.web").joinpath("static", "app.js").read_text()
    sinks = re.findall(
        r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function|"
        r"setAttribute\(\s*['\"]on|srcdoc|DOMParser|createContextualFragment",
        js,
    )
    assert sinks == []
    html = resources.files("metnos_exec.web").joinpath("static", "index.html").read_text()
    # No inline script or handler (the CSP would block them; none should be needed).
    assert re.findall(r"<script(?![^>]*\bsrc=)|\son[a-z]+=", html) == []
    assert "http://" not in html and "https://" not in html  # nothing from elsewhere


def test_running_clock_counts_from_first_sight() -> None:
    from metnos_exec.brokers.presence import JobListing

    now = [100.0]
    clock = RunningClock(lambda: now[0])
    a = JobListing(job_id="A", executor="t", device="server", state="running", attempt=1)
    b = JobListing(job_id="B", executor="t", device="server", state="running", attempt=1)
    assert clock.elapsed([a]) == {"A": (0.0, True)}
    now[0] = 105.0
    assert clock.elapsed([a, b]) == {"A": (5.0, True), "B": (0.0, False)}
    now[0] = 107.0
    again = JobListing(job_id="A", executor="t", device="server", state="running", attempt=2)
    # A new delivery of A is a new run: its time starts over.
    assert clock.elapsed([again, b]) == {"A": (0.0, False), "B": (2.0, False)}


def test_overview_counts_match_status(
    queue: tuple[str, dict[str, str]], anyio_backend: str
) -> None:
    """The page and ``status`` read the same store: same counts."""
    url, _ = queue
    from metnos_exec.web.snapshot import overview

    async def both() -> tuple[dict[str, Any], Any]:
        async with open_broker(url, create=False) as b:
            return await overview(b, RunningClock()), await b.stats()

    doc, stats = anyio.run(both, backend=anyio_backend)
    assert doc["counts"] == {
        "queued": stats.queued,
        "delayed": stats.delayed,
        "running": stats.running,
        "done": stats.done,
        "dead": stats.dead,
        # The oldest due job's submit time (SQLite and memory; None on Redis).
        "oldest_queued_at": stats.oldest_queued_at,
    }


def test_the_view_reads_a_redis_queue_too(
    redis_server: Any, tmp_path: Path, anyio_backend: str
) -> None:
    url = f"{redis_server.url}?prefix=web-{tmp_path.name}"
    ids = fill_url(url)
    settings = check_settings("127.0.0.1", 8765, broker_url=url, token=None, allow_actions=False)
    with client(settings, anyio_backend) as view:
        doc = view.get("/api/overview").json()
        c = doc["counts"]
        assert (c["queued"], c["running"], c["done"], c["dead"]) == (1, 1, 4, 1)
        walls = {j["job_id"]: j["walls"] for j in doc["recent"]}
        assert walls[ids["degraded"]]["network"] == "not_kept"
        assert [w["id"] for w in doc["workers"]] == ["w1"]
        detail = view.get(f"/api/jobs/{ids['hostile']}").json()
        assert detail["job"]["args"]["note"] == HOSTILE + ESCAPES
