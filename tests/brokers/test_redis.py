"""The Redis broker: the conformance suite on a private redis-server, and what a fleet needs."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import coredis
import pytest
from structlog.testing import capture_logs

from metnos_exec.brokers import BadBrokerURL, Broker, Lease, open_broker
from metnos_exec.brokers.redis import GROUP, RedisBroker
from metnos_exec.brokers.sqlite import BrokerUnavailable
from metnos_exec.errors import BrokerFull
from metnos_exec.messages import E_LEASE_EXPIRED, ErrorInfo, Job, Result, encode
from tests.conftest import need
from tests.helpers.redis_server import RedisServer, redis_server_path

from .conformance import T0, BrokerConformance, VirtualClock, undo_entry


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


class TestRedisBroker(BrokerConformance):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def broker_url(self) -> str:
        """Where the broker under test connects (a subclass may give credentials)."""
        return self.server.url

    def admin_url(self) -> str:
        """A connection that may reconfigure the server (`storage_fault`)."""
        return self.server.url

    @contextlib.asynccontextmanager
    async def open_broker(self, clock: VirtualClock) -> AsyncIterator[Broker]:
        # A long poll interval: the suite's wait tests must be woken in process. A short
        # settle patience, for `storage_fault` (no other test of the suite fails a call).
        async with RedisBroker(
            self.broker_url(),
            prefix=_prefix(),
            clock=clock,
            poll_interval_s=30.0,
            settle_patience_s=0.2,
        ) as broker:
            yield broker

    @contextlib.asynccontextmanager
    async def storage_fault(self, broker: Broker) -> AsyncIterator[None]:
        # The server turned into a replica (of a master that is not there), as after a
        # failover: it refuses every write (READONLY) and keeps its data. (A full Redis
        # is no fault for a settle: its scripts free memory first, and Redis lets a
        # script that already wrote go on.)
        async with _raw(self.admin_url()) as raw:
            await raw.replicaof("127.0.0.1", 1)
            try:
                yield
            finally:
                await raw.replicaof()


# --- helpers --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _broker(
    url: str, clock: VirtualClock | None = None, **kw: Any
) -> AsyncIterator[RedisBroker]:
    async with RedisBroker(url, prefix=_prefix(), clock=clock, **kw) as broker:
        yield broker


@contextlib.asynccontextmanager
async def _raw(url: str) -> AsyncIterator[coredis.Redis[bytes]]:
    async with coredis.Redis.from_url(url, decode_responses=False) as client:
        yield client


async def _keys(raw: coredis.Redis[bytes], broker: RedisBroker) -> set[str]:
    return {k.decode() async for k in raw.scan_iter(match=broker.keys.base + "*")}


async def _pending(raw: coredis.Redis[bytes], stream: str) -> list[tuple[str, str, int]]:
    """(entry id, consumer, delivery count) of each pending entry of `stream`."""
    reply = await raw.xpending(stream, GROUP, "-", "+", 100)
    assert isinstance(reply, tuple)
    return [(_s(e.identifier), _s(e.consumer), int(e.delivered)) for e in reply]


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ok(lease: Lease, worker: str = "w1") -> Result:
    return Result(job_id=lease.job.id, status="succeeded", worker=worker, attempt=lease.attempt)


# --- URL and opening ------------------------------------------------------------------


def test_open_broker_redis_url() -> None:
    broker = open_broker("redis://127.0.0.1:1/3?prefix=q7&poll_interval_s=0.2&settle_patience_s=5")
    assert isinstance(broker, RedisBroker)
    assert broker.keys.base == "{q7}:" and broker.where == "redis://127.0.0.1:1"
    assert isinstance(open_broker("rediss://user:secret@example.org:6380/0"), RedisBroker)
    assert "secret" not in open_broker("redis://:secret@h:1/0").where  # type: ignore[attr-defined]
    with pytest.raises(BadBrokerURL, match="unknown redis broker options"):
        open_broker("redis://127.0.0.1:1/0?colour=blue")
    with pytest.raises(ValueError, match="prefix"):
        RedisBroker("redis://127.0.0.1:1/0", prefix="a{b}")


@pytest.mark.anyio
async def test_a_broker_not_entered_says_how_to_use_it() -> None:
    broker = RedisBroker("redis://127.0.0.1:1/0")
    with pytest.raises(BrokerUnavailable, match="async with") as info:
        await broker.stats()
    assert info.value.code == "E_BROKER_UNAVAILABLE"
    await broker.close()


# --- lessons from the peers' trackers, each a test ------------------------------------


@pytest.mark.anyio
async def test_a_heartbeating_lease_is_never_taken_over(redis_server: RedisServer) -> None:
    clock = VirtualClock()
    async with _broker(redis_server.url, clock) as b, _raw(redis_server.url) as raw:
        j = Job(executor="echo")
        await b.submit(j)
        [lease] = await b.lease("w1", visibility_s=10)
        # Fifty windows long, renewed every 8 s: nobody else ever gets it.
        for _ in range(60):
            clock.advance(8)
            assert (await b.heartbeat(lease)).ok
            assert await b.lease("w2", visibility_s=10, limit=5) == []
        [(_entry, consumer, deliveries)] = await _pending(raw, b.keys.stream("server", 0, "echo"))
        assert (consumer, deliveries) == ("w1", 1)
        assert await b.ack(lease, _ok(lease))
        # Without heartbeats the same window lapses: the renewal is what kept it.
        await b.submit(k := Job(executor="echo"))
        [first] = await b.lease("w1", visibility_s=10)
        clock.advance(10)
        [taken] = await b.lease("w2", visibility_s=10)
        assert taken.job.id == k.id and taken.attempt == 2 and first.token != taken.token


@pytest.mark.anyio
async def test_the_delivery_count_dead_letters_a_poison_job(redis_server: RedisServer) -> None:
    """A job whose workers keep dying is taken over with XCLAIM (the pending entry's
    delivery count grows) until its attempts are spent, then dead: never a loop."""
    clock = VirtualClock()
    async with _broker(redis_server.url, clock) as b, _raw(redis_server.url) as raw:
        j = Job(executor="crasher", max_attempts=3)
        await b.submit(j)
        stream = b.keys.stream("server", 0, "crasher")
        for n, worker in enumerate(("w1", "w2", "w3"), 1):
            [lease] = await b.lease(worker, visibility_s=5)
            assert lease.attempt == n
            [(_entry, consumer, deliveries)] = await _pending(raw, stream)
            assert (consumer, deliveries) == (worker, n)
            clock.advance(5)  # the worker dies: no heartbeat, no ack
        with capture_logs() as logs:
            assert await b.lease("w4", visibility_s=5) == []
        result = await b.get_result(j.id)
        assert result is not None and result.status == "dead"
        assert result.error is not None and result.error.code == E_LEASE_EXPIRED
        [letter] = await b.dead_letters()
        assert (letter.job_id, letter.attempts, letter.worker) == (j.id, 3, "w3")
        [record] = [r for r in logs if r["event"] == "job.dead_lettered"]
        assert (record["job_id"], record["executor"], record["worker"]) == (j.id, "crasher", "w3")
        assert await _pending(raw, stream) == []


@pytest.mark.anyio
async def test_streams_hold_only_live_jobs(redis_server: RedisServer) -> None:
    """Every way a job leaves (ack, retry, dead letter, release, cancel, takeover) acks
    and deletes its stream entry; empty streams go, so nothing grows without bound."""
    clock = VirtualClock()
    async with _broker(redis_server.url, clock) as b, _raw(redis_server.url) as raw:
        jobs = [
            Job(executor="echo", priority=i % 3, device=("phone" if i % 4 == 0 else None))
            for i in range(40)
        ]
        await b.submit_many(jobs)
        for i in range(3):
            await b.submit(Job(executor="echo", args={"cancel": i}, priority=7))
        err = ErrorInfo(code="E_X", message="x")
        streams = {b.keys.stream(d, p, "echo") for d in ("server", "phone") for p in range(3)}
        assert streams <= await _keys(raw, b)
        for device in ("server", "phone"):
            leases = await b.lease("w1", visibility_s=5, device=device, limit=100)
            for n, lease in enumerate(leases):
                match n % 5:
                    case 0:
                        assert await b.ack(lease, _ok(lease))
                    case 1:
                        assert await b.retry(lease, error=err, delay_s=1) == "scheduled"
                    case 2:
                        assert await b.dead_letter(lease, error=err)
                    case 3:
                        assert await b.release(lease)
                    case 4:
                        pass  # its worker dies
        for cancelled in (await b.stats(),):
            assert cancelled.queued > 0
        for key in await _keys(raw, b):
            if ":q:" in key and key.endswith(":7:echo"):
                for job in await raw.xrange(key):
                    await b.cancel(job.field_values[b"id"].decode())
        clock.advance(5)
        for _ in range(6):  # retries fall due, lapsed leases are taken over, all acked
            for device in ("server", "phone"):
                for lease in await b.lease("w2", visibility_s=5, device=device, limit=100):
                    assert await b.ack(lease, _ok(lease, "w2"))
            clock.advance(1)
        stats = await b.stats()
        assert (stats.queued, stats.running) == (0, 0)
        assert stats.done + stats.dead == 43
        keys = await _keys(raw, b)
        assert not [k for k in keys if ":q:" in k], "empty streams are deleted"
        for device in ("server", "phone"):
            assert await raw.zcard(b.keys.leases(device)) == 0


@pytest.mark.anyio
async def test_a_route_listed_without_its_stream_costs_a_lease_nothing(
    redis_server: RedisServer,
) -> None:
    """A route still listed for a device whose stream is gone (deleted once empty) read
    as an error in the lease script (XINFO on a missing key), after the script's reads
    had taken their entries: those jobs were leased to nobody until their lease lapsed
    (CI found a checkpoint's next job waiting 30 s). The lease goes on past it."""
    clock = VirtualClock()
    async with _broker(redis_server.url, clock) as b, _raw(redis_server.url) as raw:
        await b.submit(Job(executor="gone"))
        assert await raw.delete([b.keys.stream("server", 0, "gone")]) == 1
        job = Job(executor="echo")
        await b.submit(job)
        [lease] = await b.lease("w1", visibility_s=30, limit=4)
        assert lease.job.id == job.id and lease.attempt == 1
        assert await b.ack(lease, _ok(lease))
        assert await b.lease("w1", visibility_s=30, limit=4) == []


@pytest.mark.anyio
async def test_no_lock_and_no_key_outside_the_documented_layout(redis_server: RedisServer) -> None:
    """Recovery takes no lock (each step is one atomic script), so a killed worker can
    leave nothing that blocks the others: after takeovers, retries and purges every key
    is one of the documented families, and no plain string but an idempotency key."""
    clock = VirtualClock()
    async with _broker(redis_server.url, clock) as b, _raw(redis_server.url) as raw:
        await b.submit_many(  # with a result ttl: their acks list them in `expiring`
            [Job(executor="echo", idempotency_key=f"k{i}", result_ttl_s=3600) for i in range(6)]
        )
        await b.submit(Job(executor="echo", not_before=T0 + 100))
        await b.submit_raw(b"not json")
        await raw.xadd(b.keys.inbox, {"job": b'{"executor": "echo"}'})
        leases = await b.lease("w1", visibility_s=5, limit=3)
        clock.advance(6)
        leases += await b.lease("w2", visibility_s=5, limit=10)
        # A client waited on one of them (its ack writes done:<id>).
        assert await b.wait_result(leases[3].job.id, timeout=0.01) is None
        for lease in leases[3:-1]:  # one stays running
            await b.ack(lease, _ok(lease, "w2"))
        documented = _documented_keys()
        assert len(documented) == 23
        await b.publish_executors([])  # the catalog is tested in tests/devices/test_catalog.py
        documented.pop("executors")
        documented.pop("aside:<key>:<time>")  # made by the wrong-kind test below
        documented.pop("lost")  # made by the data-loss tests below
        documented.pop("workers")  # written by a supervisor (tests/test_fleet_routing.py)
        # An undo entry recorded by the job that stays running (never acked).
        assert await b.record_undo(leases[-1], [undo_entry(leases[-1].job.id, "a" * 64)])
        seen = set()
        for key in await _keys(raw, b):
            rest = key[len(b.keys.base) :]
            matches = [name for name, pattern in documented.items() if pattern.fullmatch(rest)]
            assert matches, f"{key} is not in queue/README.md's key layout"
            seen.update(matches)
            if (await raw.type(key)) == b"string":
                assert rest.startswith("idem:") or rest == "epoch", key
        # This run made every kind of key (the inbox stays, empty, once admitted).
        assert seen == set(documented), set(documented) - seen
        assert await raw.xlen(b.keys.inbox) == 0


def _documented_keys() -> dict[str, re.Pattern[str]]:
    """The key names in queue/README.md's layout table, as patterns (``<x>`` = a part)."""
    text = (Path(__file__).parents[2] / "queue" / "README.md").read_text()
    names = re.findall(r"`\{P\}:([^`]+)`", text.split("### Key layout", 1)[1].split("###")[0])
    return {n: re.compile(re.sub(r"<[^>]+>", ".+", n)) for n in dict.fromkeys(names)}


# --- fencing across takeovers ---------------------------------------------------------


@pytest.mark.anyio
async def test_a_late_ack_after_an_xclaim_takeover_changes_nothing(
    redis_server: RedisServer,
) -> None:
    clock = VirtualClock()
    async with _broker(redis_server.url, clock) as b, _raw(redis_server.url) as raw:
        j = Job(executor="echo")
        await b.submit(j)
        [slow] = await b.lease("w1", visibility_s=5)
        clock.advance(5)
        [mine_again] = await b.lease("w1", visibility_s=5)  # the same worker retakes it
        assert mine_again.token != slow.token
        clock.advance(5)
        [fast] = await b.lease("w2", visibility_s=5)
        [(_e, consumer, deliveries)] = await _pending(raw, b.keys.stream("server", 0, "echo"))
        assert (consumer, deliveries) == ("w2", 3)
        for stale in (slow, mine_again):
            assert not (await b.heartbeat(stale)).ok
            assert not await b.ack(stale, _ok(stale))
            assert not await b.release(stale)
            assert await b.retry(stale, error=ErrorInfo(code="E", message="m"), delay_s=0) == "lost"
            assert not await b.dead_letter(stale, error=ErrorInfo(code="E", message="m"))
        state = await b.get_job_state(j.id)
        assert state is not None and (state.state, state.worker, state.attempt) == (
            "running",
            "w2",
            3,
        )
        assert await b.ack(fast, _ok(fast, "w2"))
        result = await b.get_result(j.id)
        assert result is not None and result.worker == "w2"


@pytest.mark.anyio
async def test_a_resent_settle_reports_what_its_first_try_did(redis_server: RedisServer) -> None:
    """After a dropped connection a settle is resent with the replay flag: if the first
    try was carried out, the resend says so instead of "lease lost"; without the flag (a
    second ack by mistake) it is refused as before."""
    async with _broker(redis_server.url) as b:
        await b.submit_many([Job(executor="echo"), Job(executor="echo")])
        one, two = await b.lease("w1", visibility_s=30, limit=2)
        assert await b.ack(one, _ok(one))
        args = (one.job.id, one.token, encode(_ok(one)), "succeeded")
        assert await b._script("ack", "1", *args) == [1]
        assert await b._script("ack", "0", *args) == [0]
        assert await b.release(two)
        assert await b._script("release", "1", two.job.id, two.token) == 1
        assert await b._script("release", "0", two.job.id, two.token) == 0
        assert await b._script("ack", "1", two.job.id, two.token, b"{}", "succeeded") == [0]


# --- the server's clock ---------------------------------------------------------------


@pytest.mark.anyio
async def test_without_a_clock_leases_use_the_servers_time(redis_server: RedisServer) -> None:
    async with _broker(redis_server.url) as b, _raw(redis_server.url) as raw:
        await b.submit(Job(executor="echo"))
        [lease] = await b.lease("w1", visibility_s=30)
        server_now = (await raw.time()).timestamp()
        assert abs(lease.lease_until - 30 - server_now) < 5
        beat = await b.heartbeat(lease, visibility_s=60)
        assert beat.lease_until is not None and beat.lease_until > lease.lease_until + 25


# --- the inbox for producers in other languages ---------------------------------------


@pytest.mark.anyio
async def test_inbox_entries_are_queued_or_dead_lettered_once(redis_server: RedisServer) -> None:
    async with _broker(redis_server.url) as b, _raw(redis_server.url) as raw:
        given = Job(executor="echo", args={"a": 1}, idempotency_key="k", priority=3)
        await raw.xadd(b.keys.inbox, {"job": encode(given)})
        await raw.xadd(b.keys.inbox, {"job": encode(Job(executor="echo", idempotency_key="k"))})
        await raw.xadd(b.keys.inbox, {"job": b'{"executor": "echo", "args": {"b": 2}}'})
        await raw.xadd(b.keys.inbox, {"job": b'{"executor": 7}', "id": "bad-1"})
        await raw.xadd(b.keys.inbox, {"job": encode(Job(executor="echo")), "id": "other"})
        await raw.xadd(b.keys.inbox, {"id": "no-job"})
        # A device worker leaves the inbox alone.
        assert await b.lease("p", visibility_s=30, device="phone", limit=10) == []
        assert await raw.xlen(b.keys.inbox) == 6
        with capture_logs() as logs:
            leases = await b.lease("s", visibility_s=30, limit=10)
        assert await raw.xlen(b.keys.inbox) == 0
        assert leases[0].job == given  # priority 3 first; the duplicate key dropped
        assert [le.job.args for le in leases] == [{"a": 1}, {"b": 2}]
        bad = {r["job_id"] for r in logs if r["event"] == "job.bad_message"}
        assert "bad-1" in bad and "no-job" in bad and len(bad) == 3
        letters = {d.job_id: d for d in await b.dead_letters()}
        assert set(letters) == bad
        assert letters["bad-1"].raw == b'{"executor": 7}'
        assert "$.executor" in letters["bad-1"].error.message
        result = await b.get_result("bad-1")
        assert result is not None and result.status == "dead"
        assert (await b.stats()).dead == 3


@pytest.mark.anyio
async def test_inbox_entries_with_bytes_that_are_not_utf8_are_dead_lettered_once(
    redis_server: RedisServer,
) -> None:
    """Found by the chaos run: one inbox entry whose `id` (or a field name) was not UTF-8
    stopped every lease with E_HOST_FAULT, and the jobs the lease script had taken
    meanwhile lapsed until they were dead without having run."""
    async with _broker(redis_server.url) as b, _raw(redis_server.url) as raw:
        good = Job(executor="echo", args={"a": 1})
        await b.submit(good)
        body = b'{"v":1,"id":"x","executor":"echo"}'
        await raw.xadd(b.keys.inbox, {"id": b"P-BADID\xff", "job": body})
        await raw.xadd(b.keys.inbox, {b"j\xffob": b'{"v":1,"id":"P-FIELD","executor":"echo"}'})
        await raw.xadd(b.keys.inbox, {"id": b"", "job": b"garbage"})
        late = Job(executor="echo", args={"b": 2})
        await raw.xadd(b.keys.inbox, {"job": encode(late)})
        with capture_logs() as logs:
            leases = await b.lease("s", visibility_s=30, limit=10)
            assert await b.lease("s", visibility_s=30, limit=10) == []
        assert [le.job.id for le in leases] == [good.id, late.id]
        assert await raw.xlen(b.keys.inbox) == 0
        bad = [r["job_id"] for r in logs if r["event"] == "job.bad_message"]
        assert len(bad) == 3 and "P-BADID\ufffd" in bad
        assert not [r for r in logs if r["event"] == "broker.error"]
        letters = {d.job_id: d for d in await b.dead_letters()}
        assert set(letters) == set(bad)
        assert all(d.error.code == "E_BAD_MESSAGE" for d in letters.values())
        assert letters["P-BADID\ufffd"].raw == body
        assert (await b.stats()).dead == 3


@pytest.mark.anyio
async def test_entries_written_past_the_inbox_never_hide_the_queue(
    redis_server: RedisServer,
) -> None:
    """Found by the chaos run: a producer that XADDs to a job stream itself (not the
    inbox) before any job of that priority made it left a stream without the workers'
    group: every job submitted at that priority afterwards was queued and never leased,
    and nothing said why. The stream gets the group; the stray entries are dropped."""
    async with _broker(redis_server.url) as b, _raw(redis_server.url) as raw:
        stream = b.keys.stream("server", 0, "echo")
        await raw.xadd(stream, {"id": "no-such-job"})
        await raw.xadd(stream, {b"\xff": b"\xff"})
        job = Job(executor="echo")
        await b.submit(job)
        leases = await b.lease("w", visibility_s=30, limit=10)
        assert [le.job.id for le in leases] == [job.id]
        assert await b.ack(leases[0], Result(job_id=job.id, status="succeeded"))
        assert await raw.xlen(stream) == 0 or not await raw.exists([stream])


@pytest.mark.anyio
async def test_leases_taken_before_the_inbox_fails_are_handed_out(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease script has started the jobs it hands out (their attempt counts): if the
    inbox step after it fails, those leases are still the caller's, not lost to lapse."""
    async with _broker(redis_server.url) as b, _raw(redis_server.url) as raw:
        job = Job(executor="echo", max_attempts=1)
        await b.submit(job)
        await raw.xadd(b.keys.inbox, {"job": encode(Job(executor="echo"))})

        async def failing(worker_id: str) -> None:
            raise BrokerUnavailable("Redis went away between the two calls")

        monkeypatch.setattr(b, "_admit_inbox", failing)
        with capture_logs() as logs:
            leases = await b.lease("s", visibility_s=30, limit=10)
        assert [le.job.id for le in leases] == [job.id]
        assert [r["event"] for r in logs] == ["broker.error"]
        # No leases to hand out: the failure is the caller's to see.
        with pytest.raises(BrokerUnavailable):
            await b.lease("s", visibility_s=30, limit=10)


# --- keys a producer wrote wrong (issue 18, item 1) ----------------------------------

#: (which key, how a producer spoils it, the problem the broker names). Each write is one
#: a producer writing Redis by hand makes; each used to fail every lease script halfway,
#: after it had taken jobs (16 of 20 then dead-lettered E_LEASE_EXPIRED, never run).
SPOILED = [
    ("inbox", "set", "type=string"),
    ("inbox", "lpush", "type=list"),
    ("inbox", "hset", "type=hash"),
    ("delayed", "set", "type=string"),
    ("finished", "lpush", "type=list"),
    ("counts", "hset-text", "field=queued"),
    ("priorities", "zadd-text", "member=high"),
    ("leases", "set", "type=string"),
    ("stream", "set", "type=string"),
]


async def _spoil(raw: coredis.Redis[bytes], b: RedisBroker, which: str, how: str) -> str:
    key = {
        "inbox": b.keys.inbox,
        "delayed": b.keys.delayed,
        "finished": b.keys.finished,
        "counts": b.keys.counts,
        "priorities": b.keys.priorities("server"),
        "leases": b.keys.leases("server"),
        "stream": b.keys.stream("server", 7, "echo"),  # a route no job had yet
    }[which]
    if how == "set":
        await raw.delete([key])
        await raw.set(key, "by hand")
    elif how == "lpush":
        await raw.delete([key])
        await raw.lpush(key, ["by hand"])
    elif how == "hset":
        await raw.delete([key])
        await raw.hset(key, {"by": "hand"})
    elif how == "hset-text":
        await raw.hset(key, {"queued": "many"})
    elif how == "zadd-text":
        await raw.zadd(key, {"high": 1})
    return key


@pytest.mark.anyio
@pytest.mark.parametrize(("which", "how", "problem"), SPOILED)
async def test_a_key_of_the_wrong_kind_is_set_aside_and_costs_no_job_an_attempt(
    redis_server: RedisServer, which: str, how: str, problem: str
) -> None:
    async with _broker(redis_server.url) as b, _raw(redis_server.url) as raw:
        jobs = [Job(executor="echo", max_attempts=1) for _ in range(4)]
        jobs.append(Job(executor="echo", max_attempts=1, priority=7))
        await b.submit_many(jobs[:3])
        key = await _spoil(raw, b, which, how)
        evidence = await raw.dump(key)
        with capture_logs() as logs:
            # Submits (one at the spoiled priority) and leases go on; every job is handed
            # out once, at its first attempt, none lapses or is dead-lettered.
            await b.submit_many(jobs[3:])
            leases = await b.lease("w", visibility_s=30, limit=10)
        assert sorted(le.job.id for le in leases) == sorted(j.id for j in jobs)
        assert {le.attempt for le in leases} == {1}
        for le in leases:
            assert await b.ack(le, _ok(le))
        stats = await b.stats()
        # (A spoiled counter restarts at 0 when it is repaired: `queued` then misses the
        # three jobs queued before; every other count is exact.)
        queued = -3 if which == "counts" else 0
        assert (stats.queued, stats.running, stats.done, stats.dead) == (queued, 0, 5, 0)
        # Set aside once, said once, the evidence kept under the queue's prefix.
        aside = [r for r in logs if r["event"] == "broker.key_set_aside"]
        assert len(aside) == 1, logs
        assert aside[0]["key"] == key and problem in aside[0]["problem"]
        kept = aside[0]["kept_as"]
        assert kept.startswith(b.keys.base) and await raw.exists([kept]) == 1
        if how in ("set", "lpush", "hset"):
            assert await raw.dump(kept) == evidence
        assert not [r for r in logs if r["event"] == "broker.error"], logs


@pytest.mark.anyio
async def test_an_oversized_inbox_entry_is_dead_lettered_as_an_excerpt(
    redis_server: RedisServer,
) -> None:
    """Issue 18, item 6: a 50 MB malformed entry kept its body whole in its job record and
    dead letter (40 x 8 MB took Redis to 519 MB), and a 1 MB inbox `id` became a 1 MB job
    id. Now the entry is cut down in Redis before a worker reads it: an excerpt and the
    size are kept, and an id too long for a job id is replaced."""
    async with _broker(redis_server.url) as b, _raw(redis_server.url) as raw:
        big = b'{"executor": "echo", "args": {"x": "' + b"y" * (3 << 20) + b'"}}'
        long_id = "i" * 5000
        await raw.xadd(b.keys.inbox, {"id": long_id, "job": big})
        await raw.xadd(b.keys.inbox, {"id": "x" * 300, "job": b"not json"})
        good = Job(executor="echo")
        await raw.xadd(b.keys.inbox, {"job": encode(good)})
        leases = await b.lease("w", visibility_s=30, limit=10)
        assert [le.job.id for le in leases] == [good.id]
        letters = await b.dead_letters(limit=10)
        assert len(letters) == 2
        for letter in letters:
            assert 1 <= len(letter.job_id) <= 128 and letter.job_id != long_id
            assert letter.raw is not None and len(letter.raw) <= 64 * 1024
            body = await raw.hget(b.keys.job(letter.job_id), "body")
            assert body is not None and len(body) <= 64 * 1024
        by_size = {le.error.message: le for le in letters}
        [over] = [m for m in by_size if "over MAX_JOB_BYTES" in m]
        # (the entry's size: its fields' names and values)
        assert f"{len(big) + len(long_id) + 5} bytes" in over and "over 128 characters" in over
        assert await raw.xlen(b.keys.inbox) == 0
        info = await raw.memory_usage(b.keys.job(letters[0].job_id))
        assert info is not None and info < 512 * 1024


# --- Redis unreachable or restarting --------------------------------------------------


@pytest.mark.anyio
async def test_an_unreachable_redis_is_broker_unavailable_and_logged() -> None:
    from tests.helpers.redis_server import _free_port

    url = f"redis://127.0.0.1:{_free_port()}/0"
    async with _broker(url, connect_timeout_s=1.0) as b:
        with capture_logs() as logs:
            for call in (b.stats(), b.lease("w", visibility_s=5), b.submit(Job(executor="e"))):
                with pytest.raises(BrokerUnavailable, match="cannot reach Redis") as info:
                    await call
                assert info.value.code == "E_BROKER_UNAVAILABLE"
        assert [r["event"] for r in logs] == ["broker.error"] * 3
        assert all(r["broker"] == url.rsplit("/", 1)[0] for r in logs)


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_result_is_kept_while_redis_restarts_and_stored_after(tmp_path: Path) -> None:
    need(redis_server_path() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()
    try:
        async with _broker(server.url, settle_patience_s=60) as b:
            j = Job(executor="echo")
            await b.submit(j)
            [lease] = await b.lease("w1", visibility_s=60)
            await anyio.to_thread.run_sync(server.stop)
            with pytest.raises(BrokerUnavailable):
                await b.heartbeat(lease)
            stored: list[bool] = []
            with capture_logs() as logs:
                async with anyio.create_task_group() as tg:

                    async def ack() -> None:
                        stored.append(await b.ack(lease, _ok(lease)))

                    tg.start_soon(ack)
                    with anyio.fail_after(30):
                        while not any(r["event"] == "broker.error" for r in logs):  # noqa: ASYNC110
                            await anyio.sleep(0.01)
                    assert not stored  # still holding the result, retrying
                    await anyio.to_thread.run_sync(server.start)
            assert stored == [True]
            assert "broker.recovered" in [r["event"] for r in logs]
            result = await b.get_result(j.id)
            assert result is not None and result.status == "succeeded"
    finally:
        server.stop()


@pytest.mark.anyio
async def test_a_submit_whose_answer_is_lost_says_the_outcome_is_unknown(tmp_path: Path) -> None:
    """Issue 18, item 2: a Redis stalled (SIGSTOP) while a client with a live connection
    submits: the request is in Redis's socket, the answer never comes in time. The submit
    said "nothing was queued" (E_BROKER_UNAVAILABLE) and the job ran once Redis resumed;
    a caller's retry ran it twice. Now: E_SUBMIT_UNKNOWN with the job's id, and a resubmit
    of that id queues nothing twice. A Redis that cannot be reached at all is still
    "nothing was queued"."""
    import signal

    from metnos_exec.errors import SubmitOutcomeUnknown

    need(redis_server_path() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path / "redis")
    server.start()
    assert server.proc is not None
    try:
        async with _broker(server.url, stream_timeout_s=0.5) as b:
            await b.stats()  # a live connection
            job = Job(executor="echo")
            server.proc.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(SubmitOutcomeUnknown) as caught:
                    await b.submit(job)
                with pytest.raises(SubmitOutcomeUnknown, match="may be queued"):
                    await b.submit_many([Job(executor="echo"), Job(executor="echo")])
            finally:
                server.proc.send_signal(signal.SIGCONT)
            assert caught.value.job_id == job.id and caught.value.code == "E_SUBMIT_UNKNOWN"
            assert isinstance(caught.value, BrokerUnavailable)  # what callers caught before
            # Whether the stalled call was carried out or not (Redis drops a request whose
            # client left before it resumed; one whose connection stays is carried out),
            # resubmitting the id queues the job exactly once.
            assert (await b.submit(job)).job_id == job.id
            state = await b.get_job_state(job.id)
            assert state is not None and state.state == "queued"
            queued = (await b.stats()).queued
            assert (await b.submit(job)).job_id == job.id
            assert (await b.stats()).queued == queued
    finally:
        server.stop()
    with pytest.raises(BrokerUnavailable) as down:
        async with _broker(server.url, connect_timeout_s=0.5) as b:
            await b.submit(Job(executor="echo"))
    assert type(down.value) is BrokerUnavailable  # never sent: nothing was queued


@pytest.mark.anyio
async def test_a_full_redis_is_broker_full_and_nothing_is_evicted(tmp_path: Path) -> None:
    """maxmemory reached under noeviction (queue/redis.conf): writes are refused with
    ``E_BROKER_FULL`` (the worker retries), and nothing already queued is lost."""
    need(redis_server_path() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        async with _broker(server.url) as b, _raw(server.url) as raw:
            kept = Job(executor="echo")
            await b.submit(kept)
            used = int((await raw.info("memory"))["used_memory"])
            await raw.config_set({"maxmemory": used})
            with (
                capture_logs() as logs,
                pytest.raises(BrokerFull, match="refuses writes: OOM") as info,
            ):
                await b.submit(Job(executor="echo", args={"pad": "x" * 100_000}))
            assert info.value.code == "E_BROKER_FULL" and info.value.retry
            assert [r["event"] for r in logs] == ["broker.error"]
            await raw.config_set({"maxmemory": 0})
            [lease] = await b.lease("w", visibility_s=30)
            assert lease.job == kept
    finally:
        server.stop()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_sync_client_on_redis(redis_server: RedisServer, backend: str) -> None:
    """The blocking client opens the Redis broker in its portal's own task (the client's
    connections live there) and closes it with the client."""
    from metnos_exec.client import SyncClient

    with SyncClient(f"{redis_server.url}?prefix={_prefix()}", backend=backend) as client:
        job_id = client.submit("echo", {"n": 1})
        assert client.result(job_id) is None
        assert client.cancel(job_id) == "cancelled"
        result = client.result(job_id, wait=5)
        assert result is not None and result.status == "cancelled"


@pytest.mark.anyio
async def test_an_ack_whose_reply_was_lost_is_reported_stored(redis_server: RedisServer) -> None:
    """The connection drops after Redis ran the ack but before its reply arrived: the
    broker's resend (and any later ack of the same lease) must say "stored", not "lease
    lost", or the worker would log a lost lease for a job whose result is in."""
    async with _broker(redis_server.url, settle_patience_s=30) as b:
        await b.submit_many([Job(executor="echo"), Job(executor="echo")])
        one, two = await b.lease("w1", visibility_s=30, limit=2)
        real = b._script
        lost: list[str] = []

        async def reply_lost(name: str, *args: str | bytes) -> Any:
            out = await real(name, *args)
            if not lost:
                lost.append(name)
                raise BrokerUnavailable("cannot reach Redis: reply lost (test)")
            return out

        b._script = reply_lost  # type: ignore[method-assign]
        assert await b.ack(one, _ok(one, "w1"))  # carried out, reply lost, resent: stored
        assert lost == ["ack"]
        b._script = real  # type: ignore[method-assign]
        result = await b.get_result(one.job.id)
        assert result is not None and result.worker == "w1"
        # Another lease's double ack is still refused: the replay is per token.
        assert await b.ack(two, _ok(two))
        assert not await b.ack(two, _ok(two))


@pytest.mark.anyio
async def test_scripts_flushed_under_an_open_broker_are_loaded_again(
    redis_server: RedisServer,
) -> None:
    """The hot scripts run as bare EVALSHA on a pooled connection; a Redis that no longer
    has them (restarted, or SCRIPT FLUSH) answers NOSCRIPT, and the call loads the script
    and runs it: no error, each step done once."""
    clock = VirtualClock()
    async with _broker(redis_server.url, clock) as b, _raw(redis_server.url) as raw:
        await b.submit(first := Job(executor="echo"))
        await raw.script_flush()
        [lease] = await b.lease("w1", visibility_s=10)
        assert lease.job.id == first.id and lease.attempt == 1
        await raw.script_flush()
        assert await b.mark_started(lease)
        await raw.script_flush()
        assert await b.ack(lease, _ok(lease))
        assert not await b.ack(lease, _ok(lease))  # fenced: settled once
        result = await b.get_result(first.id)
        assert result is not None and result.status == "succeeded"
        assert (await b.stats()).done == 1


@pytest.mark.anyio
async def test_a_redis_that_would_lose_acknowledged_jobs_is_said_at_worker_start(
    tmp_path: Path,
) -> None:
    """Redis without its append-only file loses every queued job and result when it
    restarts (a chaos run lost 1,500 acknowledged jobs, with nothing said)."""
    from metnos_exec.manifest import ExecutorRegistry
    from metnos_exec.sandbox.doubles import EchoSandbox
    from metnos_exec.sandbox.select import ArmChoice
    from metnos_exec.supervisor import Supervisor, SupervisorConfig

    need(redis_server_path() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path / "redis")  # queue/redis.conf with --appendonly no
    server.start()
    (tmp_path / "executors").mkdir()
    try:
        async with _broker(server.url) as b, _raw(server.url) as raw:
            weak = await b.durability()
            assert weak is not None and "keeps nothing on disk" in weak
            await raw.config_set({"save": "900 1"})
            weak = await b.durability()
            assert weak is not None and "only snapshots" in weak and "900 1" in weak
            sup = Supervisor(
                b,
                ExecutorRegistry.load(tmp_path / "executors"),
                SupervisorConfig(worker_id="w", retention_s=None),
                arm_chooser=lambda runtime, **_: ArmChoice(sandbox=EchoSandbox()),
            )
            with capture_logs() as logs:
                await sup.run(burst=True)
            said = [r for r in logs if r["event"] == "broker.not_durable"]
            assert len(said) == 1 and said[0]["detail"] == weak
            await raw.config_set({"appendonly": "yes"})
            assert await b.durability() is None
            with capture_logs() as logs:
                await sup.run(burst=True)
            assert "broker.not_durable" not in [r["event"] for r in logs]
            # Back as it was: a server with save points or an append-only file being
            # written takes its time to stop.
            await raw.config_set({"appendonly": "no"})
            await raw.config_set({"save": ""})
    finally:
        server.stop()


@pytest.mark.anyio
async def test_stats_say_when_the_oldest_due_queued_job_was_submitted(
    redis_server: RedisServer,
) -> None:
    """Issue 20: /metrics' oldest queued age read 0 on Redis (the broker did not say)."""
    clock = VirtualClock()
    async with _broker(redis_server.url, clock) as b:
        assert (await b.stats()).oldest_queued_at is None
        first = Job(executor="echo", submitted_at=T0 - 30)
        second = Job(executor="other", submitted_at=T0 - 20, priority=5)
        phone = Job(executor="echo", submitted_at=T0 - 10, device="phone")
        waits = Job(executor="echo", submitted_at=T0 - 99, not_before=T0 + 100)
        await b.submit_many([first, second, phone, waits])
        assert (await b.stats()).oldest_queued_at == T0 - 30  # not the delayed one
        assert await b.cancel(first.id) == "cancelled"
        assert (await b.stats()).oldest_queued_at == T0 - 20
        [lease] = await b.lease("w", visibility_s=30, executors=["other"])
        assert (await b.stats()).oldest_queued_at == T0 - 10  # another device's counts
        clock.advance(101)  # due, not yet moved to its stream: queued all the same
        stats = await b.stats()
        assert stats.oldest_queued_at == T0 - 99 and stats.delayed == 0
        assert await b.ack(lease, _ok(lease))
