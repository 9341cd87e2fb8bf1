"""The retry schedule, tested with a seeded RNG (no clocks, no sleeps)."""

from __future__ import annotations

import random

import pytest

from metnos_exec.backoff import retry_delay


def test_without_jitter_the_schedule_is_exponential_and_capped() -> None:
    delays = [retry_delay(a, jitter=0.0) for a in range(1, 12)]
    assert delays == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]


def test_jitter_stays_within_bounds_and_is_reproducible() -> None:
    a = [retry_delay(n, rng=random.Random(7)) for n in range(1, 9)]
    b = [retry_delay(n, rng=random.Random(7)) for n in range(1, 9)]
    assert a == b
    for n, d in enumerate(a, start=1):
        nominal = min(300.0, 2.0 ** (n - 1))
        assert nominal * 0.9 <= d <= nominal * 1.1
    rng = random.Random(1)
    spread = {round(retry_delay(3, rng=rng), 6) for _ in range(50)}
    assert len(spread) > 40  # actually jittered
    assert min(spread) >= 3.6 and max(spread) <= 4.4


def test_cap_holds_with_jitter_and_huge_attempts() -> None:
    rng = random.Random(3)
    assert all(retry_delay(10_000, rng=rng, jitter=1.0) <= 300.0 for _ in range(100))
    assert retry_delay(5000, base=1.0, factor=10.0, jitter=0.0) == 300.0


def test_custom_base_factor_cap() -> None:
    assert [retry_delay(n, base=0.5, factor=3.0, cap=10.0, jitter=0.0) for n in (1, 2, 3, 4)] == [
        0.5,
        1.5,
        4.5,
        10.0,
    ]


@pytest.mark.parametrize(
    "kwargs",
    [{"attempt": 0}, {"attempt": 1, "jitter": 1.5}, {"attempt": 1, "factor": 0.5}],
)
def test_nonsense_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        retry_delay(**kwargs)  # type: ignore[arg-type]
