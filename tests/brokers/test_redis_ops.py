"""Running the Redis broker in earnest (issue 18, items 8 and 9), each on a real private
redis-server: a restart that loses the data set is said (``broker.data_lost``, kept for
``status`` and ``doctor``), and a broker URL with a password or an ACL user works, with
the least ACL the README documents, and a refusal is ``E_BROKER_AUTH`` without the
password in any message or log."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import coredis
import msgspec
import pytest
from structlog.testing import capture_logs

from metnos_exec.brokers import BrokerStats, Lease
from metnos_exec.brokers._redis_watch import DataWatch
from metnos_exec.brokers.redis import RedisBroker
from metnos_exec.errors import BrokerAuth, BrokerUnavailable
from metnos_exec.messages import Job, Result
from tests.conftest import ALLOWED_CHILDREN, need
from tests.helpers.redis_server import RedisServer, redis_server_path

from . import test_redis

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

ADMIN_PW = "admin-Secret-8f3a"
USER_PW = "user-Secret-41c9"


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _ok(lease: Lease) -> Result:
    return Result(job_id=lease.job.id, status="succeeded", worker="w1", attempt=lease.attempt)


@contextlib.asynccontextmanager
async def _raw(url: str) -> AsyncIterator[coredis.Redis[bytes]]:
    async with coredis.Redis.from_url(url, decode_responses=False) as client:
        yield client


async def _answered(call: Callable[[], Awaitable[T]]) -> T:
    """`call` once Redis answers again (after a restart)."""
    with anyio.fail_after(20):
        while True:
            try:
                return await call()
            except BrokerUnavailable:
                await anyio.sleep(0.05)


def _server(tmp_path: Path, **kw: Any) -> RedisServer:
    need(redis_server_path() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path / "redis", **kw)
    server.start()
    return server


# --- item 8: a restart without persistence ------------------------------------------


async def _fill(b: RedisBroker) -> BrokerStats:
    """5 jobs: one done, one running, three queued; the counts as the broker saw them."""
    await b.submit_many([Job(executor="echo") for _ in range(5)])
    [first] = await b.lease("w1", visibility_s=60)
    assert await b.ack(first, _ok(first))
    await b.lease("w1", visibility_s=60)
    stats = await b.stats()
    assert (stats.queued, stats.running, stats.done) == (3, 1, 1)
    return stats


@pytest.mark.anyio
async def test_a_restart_without_persistence_is_said_once_with_what_was_lost(
    tmp_path: Path,
) -> None:
    """Issue 18, item 8: a Redis without its append-only file restarted with nothing, and
    nothing said why the jobs were gone. Now the broker that saw the queue logs
    ``broker.data_lost`` once, with the counts it last saw, and records it in the new
    data set, where a reader started afterwards (``status``, ``doctor``) finds it."""
    server = _server(tmp_path)  # queue/redis.conf with --appendonly no
    prefix = _prefix()
    try:
        async with RedisBroker(server.url, prefix=prefix) as b:
            seen = await _fill(b)
            await anyio.to_thread.run_sync(server.restart)
            with capture_logs() as logs:
                after = await _answered(b.stats)
                await b.lease("w1", visibility_s=60)
                await b.submit(Job(executor="echo"))
                await b.stats()
            assert (after.queued, after.done) == (0, 0)
            lost = [r for r in logs if r["event"] == "broker.data_lost"]
            assert len(lost) == 1, logs  # once, not once per call
            record = lost[0]
            assert record["log_level"] == "error" and record["cause"] == "restart"
            assert record["last_seen"] == msgspec.to_builtins(seen)
            assert record["run_id_before"] != record["run_id_now"]
            assert "3 queued" in record["detail"] and "1 done" in record["detail"]
            assert "no append-only file" in record["detail"]
            [kept] = await b.data_lost()
            assert kept.cause == "restart" and kept.last_seen == seen
        async with RedisBroker(server.url, prefix=prefix, create=False) as reader:
            [found] = await reader.data_lost()
            assert found == kept
    finally:
        server.stop()


@pytest.mark.anyio
async def test_a_restart_that_keeps_the_data_is_no_loss(tmp_path: Path) -> None:
    """With the append-only file the marker comes back with the jobs: a restart, said at
    info level, and nothing recorded as lost."""
    server = _server(tmp_path, appendonly=True)
    try:
        async with RedisBroker(server.url, prefix=_prefix()) as b:
            seen = await _fill(b)
            await anyio.to_thread.run_sync(server.restart)
            with capture_logs() as logs:
                after = await _answered(b.stats)
                await b.stats()
            assert after == seen
            events = [r["event"] for r in logs]
            assert "broker.data_lost" not in events
            [restarted] = [r for r in logs if r["event"] == "broker.restarted"]
            assert restarted["run_id_before"] != restarted["run_id_now"]
            assert await b.data_lost() == []
    finally:
        server.stop()


@pytest.mark.anyio
async def test_keys_flushed_under_a_running_server_are_a_flush(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No connection drops when the keys are deleted (FLUSHDB, a DEL by hand): the broker
    looks again after `DataWatch.every_s` and finds the marker gone, the server the same."""
    monkeypatch.setattr(DataWatch, "every_s", 0.0)
    prefix = _prefix()
    async with RedisBroker(redis_server.url, prefix=prefix) as b, _raw(redis_server.url) as raw:
        await b.submit(Job(executor="echo"))
        await b.stats()
        keys = [k async for k in raw.scan_iter(match="{" + prefix + "}:*")]
        await raw.delete(keys)
        with capture_logs() as logs:
            await b.stats()
            await b.stats()
        [lost] = [r for r in logs if r["event"] == "broker.data_lost"]
        assert lost["cause"] == "flush" and lost["last_seen"]["queued"] == 1


@pytest.mark.anyio
async def test_a_reader_writes_nothing(redis_server: RedisServer) -> None:
    """``status`` and ``doctor`` (readers) leave no marker on a queue nobody wrote yet."""
    prefix = _prefix()
    async with RedisBroker(redis_server.url, prefix=prefix, create=False) as reader:
        assert (await reader.stats()).queued == 0
        assert await reader.data_lost() == []
    async with _raw(redis_server.url) as raw:
        assert [k async for k in raw.scan_iter(match="{" + prefix + "}:*")] == []


# --- item 9: passwords and ACL users ------------------------------------------------


def documented_acl() -> str:
    """The ACL rules the README gives the queue's user (``ACL SETUSER metnos ...``)."""
    text = (ROOT / "README.md").read_text()
    [rules] = re.findall(r"^\s*ACL SETUSER metnos (.+)$", text, flags=re.MULTILINE)
    conf = (ROOT / "queue" / "redis.conf").read_text()
    [in_conf] = re.findall(r"^#\s*user metnos (.+)$", conf, flags=re.MULTILINE)
    assert in_conf == rules, "queue/redis.conf's ACL line differs from the README's"
    return rules


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server with a password for the default user, and the queue's user made
    with the README's ACL for the prefixes ``t-*`` (each test uses its own)."""
    need(redis_server_path() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis-acl"), extra=["--requirepass", ADMIN_PW])
    server.start()
    assert server.proc is not None
    ALLOWED_CHILDREN.add(server.proc.pid)
    rules = documented_acl().replace(">PASSWORD", ">" + USER_PW)
    rules = rules.replace("~{metnos}:*", "~{t-*}:*")
    admin = f"redis://:{ADMIN_PW}@127.0.0.1:{server.port}/0"

    async def make_user() -> None:
        async with _raw(admin) as raw:
            assert await raw.acl_setuser("metnos", "reset", *rules.split())

    try:
        anyio.run(make_user)
        yield server
    finally:
        ALLOWED_CHILDREN.discard(server.proc.pid)
        server.stop()


def _url(server: RedisServer, credentials: str) -> str:
    return f"redis://{credentials}@127.0.0.1:{server.port}/0"


class TestRedisBrokerAsTheDocumentedAclUser(test_redis.TestRedisBroker):
    """The whole broker contract as the README's least ACL user: every command the
    queue sends (its scripts' too) is one the ACL allows, on the prefix's keys only."""

    @pytest.fixture(autouse=True)
    def _server(self, acl_server: RedisServer) -> None:
        self.server = acl_server

    def broker_url(self) -> str:
        return _url(self.server, f"metnos:{USER_PW}")

    def admin_url(self) -> str:
        return _url(self.server, f":{ADMIN_PW}")


@pytest.mark.anyio
async def test_a_password_and_an_acl_user_work_on_the_servers_clock(
    acl_server: RedisServer,
) -> None:
    """``requirepass`` (``redis://:PASSWORD@``) and the ACL user (``redis://USER:PASSWORD@``)
    run a job through, with the server's clock (TIME), the inbox and the watch (INFO)."""
    for credentials in (f":{ADMIN_PW}", f"metnos:{USER_PW}"):
        async with RedisBroker(_url(acl_server, credentials), prefix=_prefix()) as b:
            job = Job(executor="echo")
            await b.submit(job)
            await b.submit_raw(b"not json")  # the inbox: dead-lettered by the next lease
            [lease] = await b.lease("w1", visibility_s=30)
            assert lease.job == job
            assert (await b.heartbeat(lease)).ok
            assert await b.ack(lease, _ok(lease))
            result = await b.get_result(job.id)
            assert result is not None and result.status == "succeeded"
            assert (await b.stats()).dead == 1
            assert b._watch.run_id is not None  # INFO is allowed: a loss's cause is known
            assert await b.open_access() is None  # the default user needs the password


@pytest.mark.anyio
async def test_a_refused_client_is_e_broker_auth_and_never_shows_the_password(
    acl_server: RedisServer,
) -> None:
    """A wrong password, none, an unknown user, and the ACL user on another queue's keys:
    each one ``E_BROKER_AUTH`` (a `BrokerError`: the CLI's exit 4), saying what to check,
    with no password in the message or in any log record."""
    wrong = "wrong-Secret-77d1"
    cases = [
        (f":{wrong}", "my-queue", "refused the credentials of the default user"),
        ("", "my-queue", "needs a password and the broker URL gives none"),
        (f"nobody:{wrong}", "my-queue", "refused the credentials of user 'nobody'"),
        (f"metnos:{USER_PW}", "other-queue", "does not allow user 'metnos' a command or key"),
    ]
    for credentials, prefix, said in cases:
        url = _url(acl_server, credentials) if credentials else acl_server.url
        with capture_logs() as logs:
            async with RedisBroker(url, prefix=prefix) as b:
                for call in (b.stats, lambda: b.submit(Job(executor="echo"))):
                    with pytest.raises(BrokerAuth) as caught:
                        await call()
                    assert caught.value.code == "E_BROKER_AUTH" and caught.value.retry
                    assert said in caught.value.message, caught.value.message
        text = str(caught.value) + repr(logs)
        for secret in (wrong, USER_PW, ADMIN_PW):
            assert secret not in text


@pytest.mark.anyio
async def test_open_access_is_found(redis_server: RedisServer) -> None:
    """The suite's server asks no password: anyone on its port may use the queue."""
    async with RedisBroker(redis_server.url, prefix=_prefix()) as b:
        said = await b.open_access()
    assert said is not None and "gives no password" in said


# --- what status and doctor say -----------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "METNOS_REQUIRE_SANDBOX": "never"}
    return subprocess.run(
        [sys.executable, "-m", "metnos_exec", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _findings(out: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    return {f["check"]: f for f in json.loads(out.stdout)["findings"]}


def test_status_and_doctor_say_a_data_loss_and_never_the_password(tmp_path: Path) -> None:
    """After a loss (a password-protected Redis without persistence, restarted), a
    ``status`` and a ``doctor`` started afterwards say it: what was lost and when. The
    URL they show has its password as ``***``; a wrong one is exit 4, E_BROKER_AUTH."""
    server = _server(tmp_path, extra=["--requirepass", ADMIN_PW])
    url = f"{_url(server, f':{ADMIN_PW}')}?prefix={_prefix()}"

    async def lose() -> None:
        async with RedisBroker(url.split("?")[0], prefix=url.split("=")[1]) as b:
            await _fill(b)
            await anyio.to_thread.run_sync(server.restart)
            await _answered(b.stats)
            assert await b.data_lost()

    try:
        anyio.run(lose)
        status = _cli("status", "--broker", url, "--json")
        assert status.returncode == 0, status.stderr
        broker = json.loads(status.stdout)["broker"]
        [loss] = broker["data_lost"]
        assert loss["cause"] == "restart" and loss["last_seen"]["queued"] == 3
        assert broker["url"].startswith("redis://:***@127.0.0.1:")
        text = _cli("status", "--broker", url)
        assert "DATA LOST (found " in text.stdout and "3 queued" in text.stdout
        doctor = _cli("doctor", "--broker", url, "--json")
        found = _findings(doctor)
        assert found["broker_data"]["state"] == "weakened"
        assert "lost 1 time(s)" in found["broker_data"]["detail"]
        assert "appendonly yes" in found["broker_data"]["fix"]
        assert "broker_auth" not in found  # the default user needs the password
        bad = _cli("status", "--broker", url.replace(ADMIN_PW, "wrong-Secret-77d1"))
        assert bad.returncode == 4 and bad.stderr.startswith("metnos-exec: E_BROKER_AUTH: "), (
            bad.stderr
        )
        for out in (status, text, doctor, bad):
            assert ADMIN_PW not in out.stdout + out.stderr
            assert "wrong-Secret-77d1" not in out.stdout + out.stderr
    finally:
        server.stop()


def test_doctor_warns_of_a_redis_that_asks_no_password(redis_server: RedisServer) -> None:
    found = _findings(
        _cli("doctor", "--broker", f"{redis_server.url}?prefix={_prefix()}", "--json")
    )
    auth = found["broker_auth"]
    assert auth["state"] == "weakened" and not auth["required"]
    assert "gives no password" in auth["detail"] and "forge results" in auth["meaning"]
    assert "requirepass" in auth["fix"] and "broker_data" not in found
