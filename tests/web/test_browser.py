"""The live view in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``) driven by Selenium with the system driver, never a download.

One stack for the module, started once (the browser is heavy): a real SQLite queue, a
real worker (the echo arm, each run waiting `DELAY_S`, so a job is seen running), a real
``metnos-exec web --allow-actions --token`` on a free loopback port, and one browser.
The browser is kept off the network: every name but loopback resolves to nothing, no
proxy, no background fetches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec._terminal import visible
from metnos_exec.brokers import open_broker
from metnos_exec.messages import ErrorInfo, Job, Result
from tests.conftest import ALLOWED_CHILDREN, child_pids, need, need_import
from tests.helpers.web_queue import ESCAPES, HOSTILE, report
from tests.helpers.worker_cli import wait_for_event, worker_argv

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "t0ken-for-the-browser-0123456789"
DELAY_S = "3"
TOOL = """\
name = "tool"
version = "1"
runtime = "python"
entry = "main.py"
[args.n]
type = "number"
default = 0
[args.note]
type = "string"
default = ""
"""

# Selenium's connection to its driver is a keep-alive pool it opens as it likes.
pytestmark = pytest.mark.allow_fd_leak


def _need_browser() -> None:
    need_import("selenium", "web-test")
    need_import("starlette", "web")
    need_import("hypercorn", "web")
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        need(
            os.access(path, os.X_OK),
            f"{path} is missing (apt install {package}): the browser tests need it",
        )


@dataclass
class Stack:
    url: str
    base: str
    driver: Any
    tmp: Path

    def submit(self, job: Job) -> str:
        async def go() -> str:
            async with open_broker(self.url) as b:
                return (await b.submit(job)).job_id

        return anyio.run(go)

    def state(self, job_id: str) -> str:
        async def go() -> str:
            async with open_broker(self.url, create=False) as b:
                state = await b.get_job_state(job_id)
            assert state is not None
            return state.state

        return anyio.run(go)

    def wait(self, predicate: Any, what: str, timeout: float = 30) -> Any:
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(
            lambda d: predicate(d), message=what
        )

    # The page rebuilds its tables every second: an element found in one round is stale
    # in the next. Each look and click is one script, so it sees one round's table.
    def row(self, table: str, job_id: str) -> str | None:
        """The row's text as shown (`innerText`), or ``None`` while it is not there."""
        found = self.driver.execute_script(
            'const r = document.querySelector(`#${arguments[0]} tr[data-job="${arguments[1]}"]`);'
            "return r ? r.innerText : null;",
            table,
            job_id,
        )
        return None if found is None else str(found)

    def click(self, table: str, job_id: str, inner: str = "") -> bool:
        """Click the row (or `inner`, a selector inside it); whether it was there."""
        return bool(
            self.driver.execute_script(
                "const r = document.querySelector("
                '`#${arguments[0]} tr[data-job="${arguments[1]}"] ${arguments[2]}`);'
                "if (r) r.click(); return Boolean(r);",
                table,
                job_id,
                inner,
            )
        )

    def walls(self, table: str, job_id: str) -> list[str]:
        return list(
            self.driver.execute_script(
                "return [...document.querySelectorAll("
                '`#${arguments[0]} tr[data-job="${arguments[1]}"] span.wall`)]'
                ".map(b => b.dataset.state);",
                table,
                job_id,
            )
        )

    def text(self, element_id: str) -> str:
        return str(
            self.driver.execute_script(
                "return document.getElementById(arguments[0]).textContent", element_id
            )
        )


def _start_driver(tmp: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    home = tmp / "browser-home"
    home.mkdir()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--disable-gpu",
        # The crash handler double-forks away from the browser (and would be our orphan).
        "--disable-breakpad",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-default-apps",
        "--no-proxy-server",
        "--password-store=basic",
        # Off the network: no name but loopback resolves.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--user-data-dir={tmp / 'profile'}",
        "--window-size=1280,1400",
    ):
        options.add_argument(flag)
    if os.geteuid() == 0:
        # Chromium's own sandbox refuses to run as root; an ordinary user keeps it.
        options.add_argument("--no-sandbox")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    env = {
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
    }
    # The path given: Selenium Manager (which downloads drivers) is never consulted.
    service = Service(executable_path=CHROMEDRIVER, env=env, log_output=str(tmp / "driver.log"))
    return webdriver.Chrome(options=options, service=service)


def _wait_line(path: Path, needle: bytes, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 30
    while needle not in path.read_bytes():
        assert proc.poll() is None, path.read_text()
        assert time.monotonic() < deadline, f"no {needle!r} in {path}"
        time.sleep(0.02)  # polling its stderr, with a deadline
    return path.read_text()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    ALLOWED_CHILDREN.discard(proc.pid)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    _need_browser()
    tmp = tmp_path_factory.mktemp("browser")
    url = f"sqlite:///{tmp / 'q.db'}"
    (tmp / "ex" / "tool").mkdir(parents=True)
    (tmp / "ex" / "tool" / "manifest.toml").write_text(TOOL)
    (tmp / "ex" / "tool" / "main.py").write_text("")  # the echo arm runs nothing
    (tmp / "home").mkdir()
    env = {
        **os.environ,
        "HOME": str(tmp / "home"),
        "METNOS_ARM_OVERRIDE": "echo",
        "METNOS_ECHO_DELAY_S": DELAY_S,
    }
    procs: list[subprocess.Popen[bytes]] = []
    driver = None
    try:
        log = tmp / "worker.jsonl"
        worker = subprocess.Popen(
            worker_argv(url, tmp / "ex", log, "--concurrency", "4"),
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd=tmp,
        )  # fmt: skip
        procs.append(worker)
        ALLOWED_CHILDREN.add(worker.pid)
        wait_for_event(log, "worker.started", worker)
        err = tmp / "web.err"
        with open(err, "wb") as out:
            web = subprocess.Popen(
                [sys.executable, "-m", "metnos_exec", "web", "--broker", url, "--bind",
                 "127.0.0.1:0", "--allow-actions", "--token", TOKEN],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=out,
            )  # fmt: skip
        procs.append(web)
        ALLOWED_CHILDREN.add(web.pid)
        base = _wait_line(err, b"serving on ", web).split("serving on ", 1)[1].split()[0]
        driver = _start_driver(tmp)
        ALLOWED_CHILDREN.add(driver.service.process.pid)
        driver.get(f"{base}#token={TOKEN}")
        yield Stack(url=url, base=base.rstrip("/"), driver=driver, tmp=tmp)
    finally:
        if driver is not None:
            pid = driver.service.process.pid
            driver.quit()
            ALLOWED_CHILDREN.discard(pid)
            _end_browser_orphans()
        for proc in reversed(procs):
            _stop(proc)


#: Chromium's crash handler double-forks away from the browser, so it is re-parented to
#: the test process (a subreaper, see tests/conftest.py) while the browser lives; it is
#: the browser's, and it ends with it (`_end_browser_orphans`).
_BROWSER_ORPHANS: set[int] = set()


def _is_chromium(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe").startswith("/usr/lib/chromium/")
    except OSError:
        return False


@pytest.fixture(autouse=True)
def _browser_orphans() -> Iterator[None]:
    yield
    found = {pid for pid in child_pids() if _is_chromium(pid)}
    _BROWSER_ORPHANS.update(found)
    ALLOWED_CHILDREN.update(found)


def _end_browser_orphans() -> None:
    deadline = time.monotonic() + 10
    while _BROWSER_ORPHANS & child_pids() and time.monotonic() < deadline:
        time.sleep(0.05)  # they leave once the browser is gone; polled with a deadline
    for pid in _BROWSER_ORPHANS & child_pids():
        os.kill(pid, signal.SIGKILL)
    while _BROWSER_ORPHANS & child_pids() and time.monotonic() < deadline + 5:
        time.sleep(0.05)  # child_pids reaps them
    ALLOWED_CHILDREN.difference_update(_BROWSER_ORPHANS)
    _BROWSER_ORPHANS.clear()


def _no_page_errors(stack: Stack) -> None:
    """No CSP violation, no script error in the browser's console."""
    bad = [e for e in stack.driver.get_log("browser") if e.get("level") == "SEVERE"]
    # A 401 the no-token test provokes on purpose is logged as a failed load, not a fault.
    assert [e for e in bad if "401" not in e["message"]] == []


def test_the_page_loads_and_shows_the_queue(stack: Stack, tmp_path: Path) -> None:
    d = stack.driver
    stack.wait(lambda d: stack.text("updated").startswith("updated"), "the first poll")
    assert d.title == "metnos-exec"
    assert stack.text("broker").startswith("sqlite:///")
    stack.wait(lambda d: "live" in stack.text("workers"), "the worker, live")
    assert stack.text("problem") == ""
    # The token left the address bar once read.
    assert "token" not in d.current_url
    shot = tmp_path / "view.png"
    assert d.save_screenshot(str(shot)) and shot.stat().st_size > 1000
    _no_page_errors(stack)


def test_a_running_job_appears_then_finishes(stack: Stack) -> None:
    job_id = stack.submit(Job(executor="tool", args={"n": 7}))
    running = stack.wait(lambda d: stack.row("running", job_id), "the job, running")
    assert "tool" in running
    done = stack.wait(lambda d: stack.row("recent", job_id), "the job, finished", timeout=40)
    assert "succeeded" in done
    assert stack.row("running", job_id) is None
    assert stack.walls("recent", job_id) == ["kept"] * 5
    _no_page_errors(stack)


def test_a_refusal_shows_its_reason(stack: Stack) -> None:
    job_id = stack.submit(Job(executor="tool", args={"nope": 1}))
    row = stack.wait(lambda d: stack.row("recent", job_id), "the refused job")
    assert "rejected" in row and "E_BAD_ARGS" in row
    assert "unknown argument(s) nope" in row
    assert stack.click("recent", job_id)
    stack.wait(lambda d: stack.text("detail-id") == job_id, "the job's detail")
    stack.wait(lambda d: "E_BAD_ARGS" in stack.text("detail-error"), "the detail's error")
    assert stack.driver.find_element("id", "detail").is_displayed()


def _hostile_result(url: str) -> str:
    """A finished job whose stderr and error hold markup and escapes, stored as a worker
    would (for an executor no worker serves, so only this lease takes it)."""

    async def go() -> str:
        async with open_broker(url) as b:
            job_id = (await b.submit(Job(executor="hostile", args={"note": HOSTILE}))).job_id
            [lease] = await b.lease("w-test", visibility_s=60, executors=["hostile"])
            await b.ack(
                lease,
                Result(
                    job_id=job_id, status="failed", stderr=HOSTILE + ESCAPES,
                    error=ErrorInfo(code="E_EXIT", message=HOSTILE + ESCAPES),
                    containment=report(), worker="w-test", attempt=1, finished_at=time.time(),
                ),
            )  # fmt: skip
            return job_id

    return anyio.run(go)


def test_hostile_output_is_inert_text(stack: Stack, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    d = stack.driver
    echoed = stack.submit(Job(executor="tool", args={"note": HOSTILE + ESCAPES}))
    stored = _hostile_result(stack.url)
    stack.wait(lambda d: stack.row("recent", echoed), "the echoed job", timeout=40)
    row = stack.wait(lambda d: stack.row("recent", stored), "the stored hostile result")
    # Shown as the characters it is, invisible ones spelled out (the terminal's rule).
    assert "E_EXIT: " + visible(HOSTILE + ESCAPES) in row
    assert stack.click("recent", stored)
    stack.wait(lambda d: stack.text("detail-id") == stored, "the hostile job's detail")
    # Spelled out by the page's rule, which is the terminal's: a bidi override cannot
    # reorder what the operator reads, an ESC is seen as one.
    spelled = visible(HOSTILE + ESCAPES, newlines=True)
    assert spelled.endswith("\\x1b[2J\\x1b]0;owned\\x07\\u202e")
    stack.wait(lambda d: stack.text("detail-stderr") == spelled, "its stderr, spelled out")
    assert stack.click("recent", echoed)
    stack.wait(lambda d: "<script>alert(1)</script>" in stack.text("detail-output"), "output")
    assert "<img src=x onerror=" in stack.text("detail-args")
    # Nothing of it became markup: no image, no script but the page's own, no handler ran.
    assert d.find_elements(By.TAG_NAME, "img") == []
    scripts = d.find_elements(By.TAG_NAME, "script")
    assert [s.get_attribute("src") for s in scripts] == [f"{stack.base}/app.js"]
    assert d.title == "metnos-exec"
    shot = tmp_path / "hostile.png"
    assert d.save_screenshot(str(shot)) and shot.stat().st_size > 1000
    _no_page_errors(stack)


def test_an_action_needs_the_token(stack: Stack) -> None:
    held = stack.submit(Job(executor="nobody-serves-this"))  # stays queued: no worker
    d = stack.driver
    status = d.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0], {method: 'POST'}).then(r => done(r.status), e => done(String(e)));",
        f"/api/jobs/{held}/cancel",
    )
    assert status == 401
    assert stack.state(held) == "queued"
    # The page without its token: refused, and it says why.
    token = d.execute_script(
        "const t = sessionStorage.getItem('metnos-web-token');"
        "sessionStorage.removeItem('metnos-web-token'); return t;"
    )
    assert token == TOKEN
    d.refresh()
    stack.wait(lambda d: "E_WEB_TOKEN" in stack.text("problem"), "the refusal on the page")
    # With the token, the page's own cancel button works.
    d.get(f"{stack.base}/#token={TOKEN}")
    stack.wait(lambda d: stack.row("queued", held), "the held job, queued")
    assert stack.click("queued", held, 'button[data-action="cancel"]')
    stack.wait(lambda d: "cancel: cancelled" in stack.text("action"), "the cancel's answer")
    assert stack.state(held) == "done"


def test_a_dead_letter_is_retried_from_its_button(stack: Stack) -> None:
    executor = "nobody-retries-this"  # no worker serves it: the retried job stays queued

    async def dead() -> str:
        async with open_broker(stack.url) as b:
            job_id = (await b.submit(Job(executor=executor))).job_id
            [lease] = await b.lease("t", visibility_s=30, executors=[executor])
            error = ErrorInfo(code="E_TEMPFAIL", message="gave up")
            assert await b.dead_letter(lease, error=error)
            return job_id

    held = anyio.run(dead)
    stack.wait(lambda d: stack.row("dead", held), "the dead letter, listed")
    assert stack.click("dead", held, 'button[data-action="retry"]')
    answer = stack.wait(
        lambda d: (t := stack.text("action")).startswith("retry: ") and t, "the retry's answer"
    )
    new_id = answer.removeprefix("retry: ").strip()
    assert new_id != held and stack.state(new_id) == "queued"
    assert stack.state(held) == "dead"
    stack.wait(lambda d: stack.row("queued", new_id), "the retried job, queued")
