"""Every arm through the conformance suite (`tests/sandbox/conformance.py`).

Every arm is imported directly: a missing or broken arm module is a collection error,
never a skip. Only a missing *system component* (a usable bwrap, wasmtime) skips, through
`need`, which fails instead in CI. The arms run for real (real bwrap, real wasmtime).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.errors import HostFault
from metnos_exec.sandbox._types import (
    Failure,
    ResourceLimits,
    Sandbox,
    SandboxExit,
    SandboxJob,
    Success,
    Timeout,
    WasmProgram,
)
from metnos_exec.sandbox.bwrap import BwrapSandbox, bwrap_probe
from metnos_exec.sandbox.direct import DirectSandbox
from metnos_exec.sandbox.doubles import EchoSandbox, FaultSandbox
from metnos_exec.sandbox.wasm import WasmSandbox, spare_processes

from ..conftest import need
from .conformance import CHECKS, ArmUnderTest, applicable, compile_wats, native_jobs, wasm_jobs


def echo_arm() -> ArmUnderTest:
    return ArmUnderTest(
        name="echo",
        make=lambda check: EchoSandbox(stdout=b"!"),
        well_formed=lambda tmp: SandboxJob(stdin=b"ping"),
        expected_stdout=b"ping!",
        flood=lambda tmp: SandboxJob(stdin=b"x" * 5000, limits=ResourceLimits(output_bytes=1000)),
        not_applicable={
            "denial": "echo runs nothing, so there is nothing to deny",
            "budget": "echo runs nothing, so no budget can be exceeded",
            "tiny_budget": "echo runs nothing, so no budget can be exceeded",
        },
    )


def fault_arm() -> ArmUnderTest:
    scripts: dict[str, tuple[list[SandboxExit | BaseException], bytes]] = {
        "poison": ([Success(), Failure(13), Success()], b"scripted"),
        "well_formed": ([Success()], b"scripted"),
        "flood": ([Success()], b"x" * 5000),
        "denial": ([Failure(13)], b""),
        "granted": ([Success()], b""),
        "budget": ([Timeout()], b""),
        "tiny_budget": ([Timeout()], b""),
    }

    def make(check: str) -> Sandbox:
        script, out = scripts[check]
        return FaultSandbox(list(script), stdout=out)

    return ArmUnderTest(
        name="fault",
        make=make,
        well_formed=lambda tmp: SandboxJob(),
        expected_stdout=b"scripted",
        flood=lambda tmp: SandboxJob(limits=ResourceLimits(output_bytes=1000)),
        forbidden=lambda tmp: SandboxJob(),
        granted=lambda tmp: SandboxJob(),
        over_budget=lambda tmp: SandboxJob(limits=ResourceLimits(wall_time_s=1.0)),
    )


def direct_arm() -> ArmUnderTest:
    return ArmUnderTest(name="none", make=lambda check: DirectSandbox(), **native_jobs())


def bwrap_arm() -> ArmUnderTest:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    return ArmUnderTest(name="bwrap", make=lambda check: BwrapSandbox(), **native_jobs())


@pytest.fixture(scope="session")
def wasm_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Compile the suite's modules and load them into the process-wide engine once per
    session: its compiled images stay mapped (memfds) for the session by design, which a
    per-test fd check must not mistake for a leak."""
    try:
        import wasmtime  # noqa: F401
    except ImportError:
        return {}  # a missing system component: `wasm_arm` turns this into `need`
    folder = tmp_path_factory.mktemp("conformance-wasm")
    modules = compile_wats(folder)
    cache = folder / "cache"
    arm = WasmSandbox(cache_dir=cache)

    async def warm() -> None:
        # One instantiation per module: wasmtime maps each module's memory image, and its
        # WASI runtime opens its event fds, once per process.
        for path in modules.values():
            job = SandboxJob(
                wasm=WasmProgram(str(path), ("warm",)), limits=ResourceLimits(fuel=10_000)
            )
            await arm.run(job)

    anyio.run(warm)
    return {"modules": modules, "cache": cache}


def wasm_arm(setup: dict[str, Any]) -> ArmUnderTest:
    need(bool(setup), "wasmtime is not installed")
    modules, cache = setup["modules"], setup["cache"]
    return ArmUnderTest(
        name="wasm", make=lambda check: WasmSandbox(cache_dir=cache), **wasm_jobs(modules)
    )


ARMS: dict[str, Callable[[dict[str, Any]], ArmUnderTest]] = {
    "echo": lambda _: echo_arm(),
    "fault": lambda _: fault_arm(),
    "direct": lambda _: direct_arm(),
    "bwrap": lambda _: bwrap_arm(),
    "wasm": wasm_arm,
    # The same arm with each job served by a spare process (`spare_processes`).
    "wasm-spare": wasm_arm,
}


# The echo double runs nothing, so "denial" and "budget" have no meaning for it; those
# pairs are left out of the matrix rather than skipped (in CI nothing skips).
_NOT_APPLICABLE = {("echo", "denial"), ("echo", "budget"), ("echo", "tiny_budget")}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("arm_name", "check"),
    [(a, c) for a in ARMS for c in CHECKS if (a, c) not in _NOT_APPLICABLE],
)
async def test_conformance(
    arm_name: str, check: str, tmp_path: Path, wasm_setup: dict[str, Any]
) -> None:
    arm = ARMS[arm_name](wasm_setup)
    reason = applicable(arm, check)
    assert reason is None, f"{arm_name}/{check} is in the matrix but says: {reason}"
    if arm_name != "wasm-spare":
        await CHECKS[check](arm, tmp_path)
        return
    async with spare_processes(1, cache_dir=wasm_setup["cache"]):
        await CHECKS[check](arm, tmp_path)


def test_echo_declares_the_pairs_left_out() -> None:
    """The pairs left out of the matrix are exactly those the echo arm declares."""
    arm = ARMS["echo"]({})
    for check in CHECKS:
        assert (applicable(arm, check) is not None) == (("echo", check) in _NOT_APPLICABLE)


# --- the doubles' own contract --------------------------------------------------------


@pytest.mark.anyio
async def test_echo_records_jobs_and_appends_scripted_output() -> None:
    echo = EchoSandbox(stdout=b"+out", stderr=b"err", exit=Failure(2))
    a, b = SandboxJob(stdin=b"a"), SandboxJob(stdin=b"b", argv=("x",))
    oa, ob = await echo.run(a), await echo.run(b)
    assert echo.jobs == [a, b]
    assert (oa.stdout, ob.stdout, ob.stderr, ob.exit) == (b"a+out", b"b+out", b"err", Failure(2))
    report = echo.containment(a)
    assert report.sandbox == "echo"
    assert {v.reason for v in report.axes().values()} == {"nothing runs: test double"}


@pytest.mark.anyio
async def test_echo_waits_its_scripted_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    from metnos_exec.sandbox import doubles

    t = time.monotonic()
    out = await EchoSandbox(delay_s=0.03).run(SandboxJob(stdin=b"a"))
    assert time.monotonic() - t >= 0.03 and out.stdout == b"a"
    drawn: list[tuple[float, float]] = []

    def uniform(lo: float, hi: float) -> float:
        drawn.append((lo, hi))
        return 0.001

    monkeypatch.setattr(doubles.random, "uniform", uniform)
    await EchoSandbox(delay_s=(0.05, 0.2)).run(SandboxJob())
    assert drawn == [(0.05, 0.2)]
    with pytest.raises(ValueError, match="delay_s"):
        EchoSandbox(delay_s=(0.2, 0.1))


def test_echo_delay_from_the_environment() -> None:
    from metnos_exec.errors import BadConfig
    from metnos_exec.sandbox.doubles import echo_from_env, parse_echo_delay

    assert parse_echo_delay("0.1") == (0.1, 0.1)
    assert parse_echo_delay(" 0.05-0.2 ") == (0.05, 0.2)
    assert echo_from_env({}).delay_s == (0.0, 0.0)
    assert echo_from_env({"METNOS_ECHO_DELAY_S": "0.05-0.2"}).delay_s == (0.05, 0.2)
    for bad in ("soon", "0.2-0.1", "-1", "1-2-3", "nan", "4000"):
        with pytest.raises(BadConfig, match="METNOS_ECHO_DELAY_S"):
            parse_echo_delay(bad)


@pytest.mark.anyio
async def test_fault_pops_the_standard_sequence_then_stops() -> None:
    from metnos_exec.sandbox._types import FuelExhausted, Trap
    from metnos_exec.sandbox.doubles import FaultScriptExhausted

    fault = FaultSandbox.standard()
    job = SandboxJob()
    exits = [(await fault.run(job)).exit for _ in range(4)]
    assert [type(e) for e in exits] == [Failure, FuelExhausted, Trap, Timeout]
    with pytest.raises(HostFault, match="scripted host fault"):
        await fault.run(job)
    assert fault.remaining == 0
    with pytest.raises(FaultScriptExhausted, match="exhausted after 5 run"):
        await fault.run(job)
    assert len(fault.jobs) == 6
    assert fault.containment(job).sandbox == "fault"


# --- the suite can fail -----------------------------------------------------------------


@pytest.mark.anyio
async def test_suite_catches_a_lying_arm(tmp_path: Path) -> None:
    # Echo "runs" every job successfully while reporting every axis kept: described as an
    # arm that should deny and time out, it must fail both checks.
    liar = ArmUnderTest(
        name="echo",
        make=lambda check: EchoSandbox(),
        well_formed=lambda tmp: SandboxJob(stdin=b"x"),
        expected_stdout=b"x",
        forbidden=lambda tmp: SandboxJob(stdin=b"secret"),
        over_budget=lambda tmp: SandboxJob(limits=ResourceLimits(wall_time_s=0.1)),
    )
    with pytest.raises(AssertionError, match="forbidden job succeeded"):
        await CHECKS["denial"](liar, tmp_path)
    with pytest.raises(AssertionError, match="exit=Success"):
        await CHECKS["budget"](liar, tmp_path)
    wrong_name = ArmUnderTest(
        name="bwrap",
        make=lambda check: EchoSandbox(),
        well_formed=lambda tmp: SandboxJob(),
        expected_stdout=b"",
    )
    with pytest.raises(AssertionError, match="arm reports name 'echo'"):
        await CHECKS["well_formed"](wrong_name, tmp_path)
