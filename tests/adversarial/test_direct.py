"""The adversarial suite on the direct arm (``METNOS_SANDBOX=off``): it keeps nothing and
says so. Each row is an attempt that *succeeds* there, proving that the axis the report
calls ``not_kept`` (or ``partial``) really is open: a report that said ``kept`` for one of
them, or an attempt that failed (the row would prove nothing), fails the row."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .attempts import DIRECT, prepare
from .harness import Run, judge, outcome_of, run_attempts, world_at


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    with world_at(tmp_path_factory.mktemp("adv-direct")) as world:
        prepare(world)
        yield run_attempts(world, DIRECT, backend=request.param, sandbox="direct")


def test_every_axis_has_an_open_door() -> None:
    assert sorted(a.axis for a in DIRECT) == sorted(
        ("files", "network", "process_tree", "user", "resources")
    )


@pytest.mark.parametrize("attempt", DIRECT, ids=[a.id for a in DIRECT])
def test_attempt_gets_through_and_the_report_says_so(run: Run, attempt: object) -> None:
    through, what = outcome_of(run, attempt)  # type: ignore[arg-type]
    assert through, f"{attempt.id} did not get through on the direct arm: {what}"  # type: ignore[attr-defined]
    result = run.results[attempt.id]  # type: ignore[attr-defined]
    assert result is not None and result.containment is not None
    assert result.containment.sandbox == "none"
    judge(run, attempt)  # type: ignore[arg-type]
