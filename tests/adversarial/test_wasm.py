"""The adversarial suite on the wasm arm: the attempts that apply to a WASI guest (fuel,
wall time, memory and table growth, preopens, sockets), through one real worker per
anyio backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..conftest import need_import
from .attempts import WASM, is_helper, prepare
from .harness import Run, judge, run_attempts, world_at


@pytest.fixture(
    scope="module",
    # The worker keeps spare guest processes by default (METNOS_WASM_SPARES=1): every row
    # is judged with them and without (each job its own fresh process).
    params=[("asyncio", "1"), ("trio", "1"), ("asyncio", "0"), ("trio", "0")],
    ids=["asyncio-spares", "trio-spares", "asyncio-fresh", "trio-fresh"],
)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    need_import("wasmtime", "wasm")
    backend, spares = request.param
    with world_at(tmp_path_factory.mktemp("adv-wasm")) as world:
        prepare(world)
        yield run_attempts(
            world, WASM, backend=backend, sandbox="wasm", env={"METNOS_WASM_SPARES": spares}
        )


def test_every_job_ran_on_wasm(run: Run) -> None:
    assert not run.survivors, run.survivors
    for aid, result in run.results.items():
        if result is not None and result.containment is not None:
            assert result.containment.sandbox == "wasm", (aid, result.containment)


ROWS = [a for a in WASM if not is_helper(a)]


@pytest.mark.parametrize("attempt", ROWS, ids=[a.id for a in ROWS])
def test_attempt(run: Run, attempt: object) -> None:
    judge(run, attempt)  # type: ignore[arg-type]
