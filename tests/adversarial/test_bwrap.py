"""The adversarial suite on the bwrap arm: every row of `attempts.BWRAP` through one real
worker per anyio backend (the worker process's ``--backend``), as whoever runs the suite
(root: a root worker with slot uids; else an unprivileged worker)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from metnos_exec.sandbox.bwrap import bwrap_probe

from ..conftest import need
from .attempts import BWRAP, is_helper, prepare
from .harness import Run, judge, run_attempts, world_at

pytestmark = pytest.mark.bwrap

ROWS = [a for a in BWRAP if not is_helper(a)]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    with world_at(tmp_path_factory.mktemp("adv-bwrap")) as world:
        prepare(world)
        yield run_attempts(world, BWRAP, backend=request.param, sandbox="bwrap")


def test_the_table_is_the_suite() -> None:
    ids = [a.id for a in BWRAP]
    assert len(ids) == len(set(ids))
    assert len(ROWS) >= 40
    for a in ROWS:
        assert a.axis in ("files", "network", "process_tree", "user", "resources"), a.id
        assert a.mechanism, a.id


def test_every_job_ran_on_bwrap_and_nothing_survived(run: Run) -> None:
    assert not run.survivors, run.survivors
    for aid, result in run.results.items():
        if result is not None and result.containment is not None:
            assert result.containment.sandbox == "bwrap", (aid, result.containment)


@pytest.mark.parametrize("attempt", ROWS, ids=[a.id for a in ROWS])
def test_attempt(run: Run, attempt: object) -> None:
    judge(run, attempt)  # type: ignore[arg-type]
