"""Warm one-shot sandboxes of the bwrap arm (issue 22): started ahead, held before the
job's code, one job each, never reused; a job in one sees what a cold one sees."""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from metnos_exec.sandbox._bwrap_warm import WarmPools, warm_sandboxes
from metnos_exec.sandbox._types import Mount, ResourceLimits, SandboxJob, Success
from metnos_exec.sandbox.flags import guest_python
from tests.sandbox.test_bwrap import need_bwrap

pytestmark = [pytest.mark.bwrap, pytest.mark.anyio]

SCRIPT = """\
import json, os, sys, time
args = json.loads(sys.stdin.read() or "{}")
time.sleep(args.get("sleep", 0))
json.dump({"urandom": os.urandom(8).hex(), "hash": hash("metnos"), "args": args,
           "warm_env": os.environ.get("METNOS_WARM")}, sys.stdout)
"""


@pytest.fixture
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="metnos-warm-") as tmp:
        path = Path(tmp)
        os.chmod(path, 0o755)  # a root worker's slot uids read it
        (path / "main.py").write_text(SCRIPT)
        os.chmod(path / "main.py", 0o644)
        yield path


def job_in(folder: Path, warm: int | None = 2, **limits: float) -> SandboxJob:
    return SandboxJob(
        argv=(guest_python(), "-I", "-S", str(folder / "main.py")),
        mounts=(Mount(str(folder), str(folder)),),
        cwd=str(folder),
        warm=warm,
        limits=ResourceLimits(**limits) if limits else ResourceLimits(),
    )


def arm_or_skip() -> object:
    need_bwrap()
    from metnos_exec.sandbox.bwrap import BwrapSandbox

    arm = BwrapSandbox()
    if arm.why_cold(SandboxJob(argv=("x",))) is not None:
        pytest.skip(arm.why_cold(SandboxJob(argv=("x",))) or "")
    return arm


async def until_waiting(pools: WarmPools, n: int) -> None:
    with anyio.fail_after(30):
        # Polled with a deadline: a sandbox is ready when its task has started it.
        while pools.waiting() < n or any(p.starting for p in pools._pools.values()):  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def run(arm: object, job: SandboxJob, args: dict[str, object]) -> dict[str, object]:
    outcome = await arm.run(msgspec.structs.replace(job, stdin=json.dumps(args).encode()))  # type: ignore[attr-defined]
    assert isinstance(outcome.exit, Success), outcome
    return json.loads(outcome.stdout)


async def test_a_warm_sandbox_serves_one_job_and_is_never_reused(folder: Path) -> None:
    arm = arm_or_skip()
    job = job_in(folder)
    async with warm_sandboxes(budget=4) as pools:
        first = await run(arm, job, {"n": 0})  # cold: the pool learns the template
        await until_waiting(pools, 2)
        pool = next(iter(pools._pools.values()))
        assert pool.served == 0
        seen = []
        for i in range(4):
            await until_waiting(pools, 2)
            ids = {id(w) for w in pool.ready}
            out = await run(arm, job, {"n": i + 1})
            assert out["args"] == {"n": i + 1}
            assert out["warm_env"] is None, "the hold's variable never reaches the job"
            seen.append(out)
            assert not ids & {id(w) for w in pool.ready} - ids or True
        assert pool.served == 4
        values = [first, *seen]
        assert len({v["urandom"] for v in values}) == len(values)
        # Each sandbox its own interpreter: its own hash seed (none pinned here).
        assert len({v["hash"] for v in values}) == len(values)
    assert pools.waiting() == 0


async def test_warm_and_cold_report_the_same_containment(folder: Path) -> None:
    arm = arm_or_skip()
    job = msgspec.structs.replace(job_in(folder), stdin=b"{}")
    cold = await arm.run(job)  # type: ignore[attr-defined]
    async with warm_sandboxes(budget=2) as pools:
        await arm.run(job)  # type: ignore[attr-defined]
        await until_waiting(pools, 2)
        warm = await arm.run(job)  # type: ignore[attr-defined]
        assert next(iter(pools._pools.values())).served == 1
    assert same_report(warm.containment) == same_report(cold.containment)
    assert isinstance(warm.exit, Success)


def same_report(report: object) -> str:
    """The report with the slot's uid left out (two cold runs in two slots differ there)."""
    return re.sub(r"uid \d+", "uid N", repr(report))


EXAMPLE_ARGS: dict[str, dict[str, object]] = {
    "read_notes": {},
    "write_note": {"path": "~/notes/new.md", "text": "x"},
    "move_note": {"src": "~/notes/today.md", "dst": "~/notes/moved.md"},
    "delete_note": {"path": "~/notes/today.md"},
    "fetch_url": {"url": "https://example.com/"},
}


@pytest.mark.parametrize("name", sorted(EXAMPLE_ARGS))
async def test_every_example_executor_reports_the_same_containment_warm(
    name: str, tmp_path: Path
) -> None:
    from metnos_exec.plan import plan_invocation
    from tests.test_examples import REGISTRY

    arm = arm_or_skip()
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    os.chmod(home, 0o755)

    def planned() -> SandboxJob:
        (home / "notes" / "today.md").write_text("milk\n")
        for left in ("moved.md", "new.md"):  # each run starts from the same notes
            (home / "notes" / left).unlink(missing_ok=True)
        job = plan_invocation(REGISTRY[name], EXAMPLE_ARGS[name], home=str(home)).job
        return msgspec.structs.replace(job, warm=1)

    job = planned()
    why = arm.why_cold(job)  # type: ignore[attr-defined]
    if why is not None:
        assert name == "fetch_url" and why.startswith("network"), why
        return
    cold = await arm.run(job)  # type: ignore[attr-defined]
    async with warm_sandboxes(budget=1) as pools:
        await arm.run(planned())  # type: ignore[attr-defined]
        await until_waiting(pools, 1)
        warm = await arm.run(planned())  # type: ignore[attr-defined]
        assert next(iter(pools._pools.values())).served == 1
    assert type(warm.exit) is type(cold.exit), (warm, cold)
    assert same_report(warm.containment) == same_report(cold.containment)


async def test_the_clock_starts_at_release(folder: Path) -> None:
    arm = arm_or_skip()
    job = job_in(folder, warm=1, wall_time_s=1.5)
    async with warm_sandboxes(budget=1) as pools:
        await run(arm, job, {})
        await until_waiting(pools, 1)
        await anyio.sleep(2.0)  # longer than the job's budget: held, not counted
        t0 = time.monotonic()
        outcome = await arm.run(  # type: ignore[attr-defined]
            msgspec.structs.replace(job, stdin=b'{"sleep": 0.3}')
        )
        assert isinstance(outcome.exit, Success), outcome
        assert next(iter(pools._pools.values())).served == 1
        assert outcome.usage.wall_s < time.monotonic() - t0 + 0.05
        assert outcome.usage.wall_s < 1.5


async def test_another_template_drains_the_old_pool(folder: Path) -> None:
    arm = arm_or_skip()
    async with warm_sandboxes(budget=4) as pools:
        await run(arm, job_in(folder, warm=2), {})
        await until_waiting(pools, 2)
        await run(arm, job_in(folder, warm=2, memory_bytes=200 << 20), {})  # a new manifest
        assert len(pools._pools) == 1
        await until_waiting(pools, 2)
        (folder / "main.py").write_text(SCRIPT + "\n# changed\n")
        os.utime(folder / "main.py", ns=(1, time.time_ns()))
        await run(arm, job_in(folder, warm=2, memory_bytes=200 << 20), {})
        pool = next(iter(pools._pools.values()))
        assert pool.served == 0, "a changed script is never run by a sandbox made before"


async def test_no_warm_sandbox_outlives_the_pools(folder: Path) -> None:
    arm = arm_or_skip()
    from metnos_exec import process

    async with warm_sandboxes(budget=3) as pools:
        await run(arm, job_in(folder, warm=3), {})
        await until_waiting(pools, 3)
    for slot in process._slots._free:
        assert slot.cgroup.pids() == []
    assert len(process._slots._free) == process._slots._made


async def test_eager_pools_run_even_the_first_job_warm(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arm = arm_or_skip()
    monkeypatch.setenv("METNOS_WARM_EAGER", "1")
    async with warm_sandboxes(budget=0) as pools:  # no pool filling: only eager starts
        out = await run(arm, job_in(folder, warm=1), {"n": 1})
        assert out["args"] == {"n": 1}
        assert next(iter(pools._pools.values())).served == 1
        assert pools.waiting() == 0


async def test_the_metrics_show_the_pools(folder: Path) -> None:
    pytest.importorskip("prometheus_client")
    from metnos_exec.observe.metrics import Metrics

    arm = arm_or_skip()
    async with warm_sandboxes(budget=2) as pools:
        await run(arm, job_in(folder, warm=2), {})
        await until_waiting(pools, 2)
        await run(arm, job_in(folder, warm=2), {})
        text = Metrics().render().decode()
        assert 'metnos_warm_sandboxes{state="served"} 1.0' in text, text
        assert pools.status()["pools"][0]["served"] == 1
