"""What a worker says about its store while it fails: one record, reminders, one recovery.

A Redis down for a minute gave 139 ``broker.error`` records (each failure once from the
client and once from the supervisor), and a Redis at ``maxmemory``, whose reads work and
whose writes fail, 366 errors and 272 recoveries in 20 s. An operator needs to know
that the store failed, that it is still failing (and how often), and that it is back.

`OutageLog` decides which failures become records:

* the first failure of an outage is logged (``broker.error``);
* while it lasts, failures are counted, and at most one reminder is logged every
  `remind_s` seconds, with ``suppressed`` (how many failures since the last record);
* a recovery is logged (``broker.recovered``) only for an outage that was logged, with
  the failures it counted and how long it lasted;
* a new failure within `remind_s` of the last record is part of the same trouble (a
  store that flaps): counted, said by the next reminder, not logged on its own.

A fatal error, and anything a caller marks ``always``, is logged whatever the timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

from ..logs import get_logger

__all__ = ("REMIND_S", "OutageLog")

_log = get_logger()

#: Seconds between two ``broker.error`` records of one outage.
REMIND_S: Final = 30.0


class OutageLog:
    """The ``broker.error`` / ``broker.recovered`` records of one worker (module doc).

    Args:
        remind_s: the least time between two records of one outage.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self, remind_s: float = REMIND_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.remind_s = remind_s
        self._clock = clock
        self._last_record: float | None = None
        self._logged_outage = False
        self._down_since: float | None = None
        self._suppressed = 0
        self._failures = 0

    def failed(self, *, always: bool = False, **fields: Any) -> bool:
        """A failed store call (`fields`: the record's); ``True`` when it was logged."""
        now = self._clock()
        self._failures += 1
        if self._down_since is None:
            self._down_since = now
        due = self._last_record is None or now - self._last_record >= self.remind_s
        if not (due or always):
            self._suppressed += 1
            return False
        extra: dict[str, Any] = {}
        if self._suppressed:
            extra["suppressed"] = self._suppressed
        if self._logged_outage:
            extra["down_s"] = round(now - self._down_since, 3)
        _log.error("broker.error", **fields, **extra)
        self._last_record = now
        self._suppressed = 0
        self._logged_outage = True
        return True

    def recovered(self, **fields: Any) -> bool:
        """The store works again; ``True`` when that was logged (its outage had been)."""
        now = self._clock()
        logged = self._logged_outage
        if logged:
            assert self._down_since is not None
            _log.info(
                "broker.recovered",
                **fields,
                failures=self._failures,
                down_s=round(now - self._down_since, 3),
            )
        # (Failures of a flap that was never logged stay counted in `_suppressed`: the
        # next record says them.)
        self._logged_outage = False
        self._down_since = None
        self._failures = 0
        return logged
