"""The harness itself: a row runs on the arm it is about, and aims at loopback only."""

from __future__ import annotations

from pathlib import Path

import pytest

from metnos_exec.messages import Result
from metnos_exec.sandbox._types import AxisVerdict, ContainmentReport

from .attempts import BWRAP
from .harness import Attempt, Run, World, outcome_of

_K = AxisVerdict("kept", "test")


def _run(arm: str, sandbox: str, tmp_path: Path) -> tuple[Run, Attempt]:
    row = next(a for a in BWRAP if a.id == "network.tcp_to_host_loopback")
    report = ContainmentReport(sandbox, _K, _K, _K, _K, _K)
    result = Result(
        job_id="01J0000000000000000000000A",
        status="succeeded",
        output={"escaped": False},
        containment=report,
    )
    run = Run(
        results={row.id: result},
        evidence={},
        dead={},
        world=World(tmp_path),
        privileged=False,
        arm=arm,
        backend="asyncio",
        worker_log=tmp_path / "log",
        worker_exit=0,
        seconds=0.0,
        survivors=[],
    )
    return run, row


def test_a_bwrap_row_that_ran_on_the_direct_arm_fails(tmp_path: Path) -> None:
    run, row = _run("bwrap", "none", tmp_path)
    with pytest.raises(AssertionError, match="ran on 'none'"):
        outcome_of(run, row)
    run, row = _run("bwrap", "bwrap", tmp_path)
    assert outcome_of(run, row) == (False, '{"escaped": false}')


def test_listeners_are_loopback_only(tmp_path: Path) -> None:
    world = World(tmp_path)
    try:
        assert world.listen_tcp("a", "127.0.0.2") > 0
        assert world.listen_udp("b", "::1") > 0
        elsewhere = ".".join(("10", "0", "0", "7"))  # built: see tests/test_addresses.py
        with pytest.raises(AssertionError, match="not a loopback address"):
            world.listen_udp("c", elsewhere)
    finally:
        world.close()
