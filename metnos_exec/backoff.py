"""The retry schedule: exponential backoff with bounded jitter.

Delay before redelivery after the `attempt`-th delivery failed::

    nominal = min(cap, base * factor ** (attempt - 1))
    delay   = nominal * (1 + uniform(-jitter, +jitter)), clamped to [0, cap]

Bounded ("equal-ish") jitter rather than full jitter: an operator reading the logs can
predict when the retry comes (within ±10 % by default), while workers that failed together
still spread out instead of hammering a recovering dependency in lock-step.
"""

from __future__ import annotations

import random

__all__ = ("retry_delay", "store_backoff")

_default_rng = random.Random()


def retry_delay(
    attempt: int,
    *,
    base: float = 1.0,
    factor: float = 2.0,
    cap: float = 300.0,
    jitter: float = 0.1,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before delivering a job again after delivery `attempt` failed.

    Args:
        attempt: the 1-based delivery that just failed.
        base: the delay after the first failure.
        factor: growth per further failure.
        cap: the longest delay, jitter included.
        jitter: relative spread, 0 (none) to 1 (anything from 0 to twice the nominal).
        rng: the random source; pass a seeded `random.Random` for a reproducible schedule.

    Raises:
        ValueError: a negative or nonsensical parameter.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    if base < 0 or cap < 0 or factor < 1:
        raise ValueError("need base >= 0, cap >= 0 and factor >= 1")
    if not 0 <= jitter <= 1:
        raise ValueError(f"jitter must be within [0, 1], got {jitter}")
    # Exponent clamped before the power: factor ** 10_000 overflows a float long after the
    # cap has been reached.
    exponent = min(attempt - 1, 1024)
    try:
        nominal = min(cap, base * factor**exponent)
    except OverflowError:
        nominal = cap
    spread = (rng or _default_rng).uniform(-jitter, jitter) if jitter else 0.0
    return max(0.0, min(cap, nominal * (1.0 + spread)))


def store_backoff(failures: int) -> float:
    """Seconds before a worker tries its failing store again, after `failures` failures
    in a row: from 0.25 s, doubling, at most 5 s (±20 %), so a store that comes back is
    used again within seconds, and one that stays down is not hammered."""
    return retry_delay(failures, base=0.25, factor=2.0, cap=5.0, jitter=0.2)
