"""Issue 18, item 5: an outage is said once, reminded with a count, and its end said once
(Redis down 63 s gave 139 broker.error records; at maxmemory, 366 errors and 272
recoveries in 20 s)."""

from __future__ import annotations

from structlog.testing import capture_logs

from metnos_exec.supervisor.outage import OutageLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_minute_down_is_one_record_two_reminders_and_one_recovery() -> None:
    clock = Clock()
    log = OutageLog(remind_s=30.0, clock=clock)
    with capture_logs() as logs:
        for _ in range(126):  # a failed call every 0.5 s for 63 s
            log.failed(op="lease", code="E_BROKER_UNAVAILABLE")
            clock.now += 0.5
        assert log.recovered(op="lease")
    errors = [r for r in logs if r["event"] == "broker.error"]
    assert len(errors) == 3  # at 0 s, 30 s, 60 s
    assert "suppressed" not in errors[0] and "down_s" not in errors[0]
    assert [e["suppressed"] for e in errors[1:]] == [59, 59]
    assert [e["down_s"] for e in errors[1:]] == [30.0, 60.0]
    [back] = [r for r in logs if r["event"] == "broker.recovered"]
    assert back["failures"] == 126 and back["down_s"] == 63.0 and back["op"] == "lease"


def test_a_store_that_flaps_is_not_a_record_per_flap() -> None:
    clock = Clock()
    log = OutageLog(remind_s=30.0, clock=clock)
    with capture_logs() as logs:
        for _ in range(200):  # 20 s of writes failing and reads working, by turns
            log.failed(op="ack")
            clock.now += 0.05
            log.recovered(op="ack")
            clock.now += 0.05
    events = [r["event"] for r in logs]
    assert events == ["broker.error", "broker.recovered"]
    # The next record, when it comes, counts what the flaps hid.
    clock.now += 30
    with capture_logs() as later:
        log.failed(op="ack")
    assert later[0]["suppressed"] == 199


def test_a_fatal_error_is_always_said() -> None:
    clock = Clock()
    log = OutageLog(remind_s=30.0, clock=clock)
    with capture_logs() as logs:
        log.failed(op="lease")
        assert not log.failed(op="lease")
        assert log.failed(op="lease", always=True, fatal=True)
    assert [r.get("fatal") for r in logs] == [None, True]
    assert logs[1]["suppressed"] == 1


def test_a_recovery_of_an_outage_never_logged_is_not_said() -> None:
    log = OutageLog(clock=Clock())
    with capture_logs() as logs:
        assert not log.recovered(op="lease")
    assert logs == []
