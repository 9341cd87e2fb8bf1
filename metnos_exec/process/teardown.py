"""Teardown after the result: what a run leaves to clean up once its outcome is known.

A run's outcome is known once its child has exited, its output pipes have closed and it
is reaped; what follows does not change it: the slot's cgroup drained of the sandbox's
last processes (bubblewrap's init, still tearing its namespaces down), the slot lent
again, the job's mount sources unmounted and closed. A caller that hands the result on
(the supervisor: the broker's ack) opens `after_result` around the run; an arm that can
defer (the bwrap arm) finds its `Later` (`current_later`) and passes it to `run_process`,
leaving those steps there instead of awaiting them, and the caller awaits them
(shielded) once the result is stored, in the job's own task. An arm that does not look
is torn down first, as before.

The guarantees are those of a run that tears down first: nothing of the job outlives the
job's task (the steps run before it ends, cancelled or not); a slot is lent again only
once its cgroup is empty (the drain step keeps it retired until then, and the release
step follows it); a slot's uid is therefore not reused while the old job's processes
live. A step that fails is logged (``sandbox.teardown_failed``) and the others still
run; the slot of a failed drain stays retired, as before.

Without a `Later` (`run_process`'s default, every caller that does not open one), each
step runs at once, as it always did.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio

__all__ = ("Later", "after_result", "current_later")


class Later:
    """The teardown steps of one job, awaited in the order they were added."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], Awaitable[None]]] = []
        #: What the steps raised, in order (for the caller's log; empty when all held).
        self.errors: list[BaseException] = []

    def add(self, step: Callable[[], Awaitable[None]]) -> None:
        """Leave `step` for `finish`."""
        self._steps.append(step)

    def __len__(self) -> int:
        return len(self._steps)

    async def finish(self) -> None:
        """Await every step, shielded, in order; one that raises does not stop the
        others (its exception is kept in `errors`)."""
        with anyio.CancelScope(shield=True):
            while self._steps:
                step = self._steps.pop(0)
                try:
                    await step()
                except Exception as exc:  # kept for the caller's log; the rest still run
                    self.errors.append(exc)


_LATER: contextvars.ContextVar[Later | None] = contextvars.ContextVar(
    "metnos_exec_later", default=None
)


@contextlib.asynccontextmanager
async def after_result() -> AsyncIterator[Later]:
    """A `Later` for one job, finished on exit whatever happened (shielded): the caller
    stores the result inside, the teardown runs after it."""
    later = Later()
    token = _LATER.set(later)
    try:
        yield later
    finally:
        _LATER.reset(token)
        await later.finish()


def current_later() -> Later | None:
    """The `Later` of the `after_result` open in this task, if any."""
    return _LATER.get()
