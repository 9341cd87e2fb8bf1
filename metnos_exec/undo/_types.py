"""What every reversible run gives the supervisor (see `metnos_exec.undo.staging`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from ..changeset import ChangeSet
from ..messages import UndoEntry
from ..sandbox._types import SandboxJob

__all__ = ("Committed", "Reversible")


@dataclass(frozen=True)
class Committed:
    """A commit applied on the host, waiting for the result to be stored.

    Attributes:
        entry: the undo entry (``None``: the job changed nothing).
        filtered: ``(path, what)`` not committed as staged (stripped bits, special files).
        changes: the change set (``None``: not a staged run, which knows none).
    """

    entry: UndoEntry | None
    filtered: tuple[tuple[str, str], ...] = ()
    changes: ChangeSet | None = None


class Reversible(Protocol):
    """One job's reversible run (see the module docstring)."""

    method: Literal["staged", "backup"]
    job: SandboxJob
    #: Why this job is not staged (``None`` when it is); logged as ``sandbox.degraded``.
    no_staging: str | None

    async def commit(self) -> Committed: ...

    def disk_exceeded(self) -> bool: ...

    async def settle(self, *, stored: bool) -> None: ...

    async def discard(self, *, restore: bool = True) -> None:
        """Drop the run (idempotent): staged writes vanish; a backup run puts its
        targets back unless ``restore=False`` (another delivery may be writing them)."""
        ...

    async def abandon(self) -> None:
        """Whether the result was stored is unknown (the broker failed mid-ack): leave
        the commit journal for `Staging.recover` to settle, and let go of the rest."""
        ...
