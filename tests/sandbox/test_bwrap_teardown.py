"""The bwrap arm's result before its teardown (issue 22): under `after_result`, the
outcome comes back with the slot still retired (never lent while its cgroup may hold the
old job's processes), and the teardown empties and lends it afterwards."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from metnos_exec import process
from metnos_exec.process.teardown import after_result, current_later
from metnos_exec.sandbox._types import SandboxJob, Success
from metnos_exec.sandbox.flags import guest_python
from tests.sandbox.test_bwrap import need_bwrap

pytestmark = pytest.mark.anyio

#: A job whose guest leaves a process behind it in the sandbox (killed with the
#: namespace): the slot must not be lent before it is gone.
LEAVES_ONE = (
    "import os, sys\n"
    "if os.fork() == 0:\n"
    "    os.setsid(); os.close(1); os.close(2)\n"
    "    import time; time.sleep(30)\n"
    "sys.stdout.write('ok')\n"
)


async def test_later_runs_its_steps_in_order_even_when_one_fails_or_it_is_cancelled() -> None:
    seen: list[str] = []

    async def step(name: str, fail: bool = False) -> None:
        await anyio.lowlevel.checkpoint()
        seen.append(name)
        if fail:
            raise OSError(name)

    with anyio.CancelScope() as scope:
        async with after_result() as later:
            assert current_later() is later
            later.add(lambda: step("a"))
            later.add(lambda: step("b", fail=True))
            later.add(lambda: step("c"))
            scope.cancel()  # the steps are shielded: they still all run
    assert current_later() is None
    assert seen == ["a", "b", "c"]
    assert [str(e) for e in later.errors] == ["b"]
    assert len(later) == 0


async def test_the_result_comes_back_before_the_slot_is_drained_and_lent() -> None:
    need_bwrap()
    from metnos_exec.sandbox.bwrap import BwrapSandbox

    if not process.slots_available():
        pytest.skip("no cgroup v1 job slots here: nothing is deferred")
    arm = BwrapSandbox()
    job = SandboxJob(argv=(guest_python(), "-I", "-S", "-c", LEAVES_ONE))
    for _ in range(2):  # the second run reuses the slot the first one drained
        async with after_result() as later:
            outcome = await arm.run(job)
            assert isinstance(outcome.exit, Success), outcome
            assert outcome.stdout == b"ok"
            assert len(later) == 2  # the drain, then sources + placement + the slot
            # The job's slot is out of the pool, retired, until its teardown ran.
            assert len(process._slots._free) == process._slots._made - 1
            assert not any(s.retired for s in process._slots._free)
            borrowed = await process._slots.acquire()
            assert borrowed is not None
            try:
                assert borrowed.cgroup.pids() == [], "a lent slot holds nothing of an old job"
            finally:
                process._slots.release(borrowed)
        assert not later.errors
        assert len(process._slots._free) == process._slots._made
        for slot in process._slots._free:
            assert not slot.retired
            assert slot.cgroup.pids() == [], "a lent slot holds nothing of an old job"


async def test_without_after_result_the_arm_tears_down_first() -> None:
    need_bwrap()
    from metnos_exec.sandbox.bwrap import BwrapSandbox

    outcome = await BwrapSandbox().run(
        SandboxJob(argv=(guest_python(), "-I", "-S", "-c", LEAVES_ONE))
    )
    assert isinstance(outcome.exit, Success), outcome
    assert len(process._slots._free) == process._slots._made
    for slot in process._slots._free:
        assert slot.cgroup.pids() == []
