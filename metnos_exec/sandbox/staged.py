"""The seam between a staged job and the bwrap arm: its overlays are placed at the run.

A job whose writes are staged (`metnos_exec.undo.staging`) writes into overlays that live in
the staging helper's mount namespace; bubblewrap is started inside it (``nsenter``) and
binds them by path (`Mount.staged`). How they are mounted depends on *as whom* the job
runs, which only the arm knows, once it has borrowed its slot
(`metnos_exec.process.pooled_slot`): a root worker's job runs as the slot's own host uid
(`metnos_exec.identities`), and then the overlays' lower layers, and every other folder
the job binds, must be idmapped clones that show root's files as that uid's.

So the staging layer registers a `Stager` under the job's key (`SandboxJob.stage`) while
the job may run, and the arm calls `Stager.place` once it knows the identity (``None``:
the job runs as the worker's own uid). A key with no stager is a host fault: the staging
layer dropped the job's overlays before its run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import HostFault
from ..identities import SlotIdentity

__all__ = ("IdmapUnavailable", "StagedPlacement", "Stager", "register", "stager_for", "unregister")


class IdmapUnavailable(OSError):
    """The job's folders cannot be shown to the slot's uid (idmapped mounts refused by a
    filesystem or the kernel): the arm places the job as the worker instead, and its
    report says why."""


@dataclass
class StagedPlacement:
    """Where bubblewrap starts for a staged job, and what it binds from there.

    Attributes:
        enter: the command prefix bubblewrap runs under (``nsenter`` into the staging
            namespace; with ``--setuid``/``--setgid`` to `uid` after entering it).
        sources: the job's other mount sources (host path → fd to bind from, valid inside
            the staging namespace): the worker's own fds, or the helper's fds on the
            idmapped clones it attached for the slot's uid.
        uid: the host uid ``enter`` drops to (the slot's), ``None``: it keeps the worker's.
    """

    enter: tuple[str, ...]
    sources: dict[str, int]
    uid: int | None = None
    owned: list[int] = field(default_factory=list)

    def close(self) -> None:
        """Close the fds this placement opened (the staged mounts stay with the job)."""
        owned, self.owned = self.owned, []
        for fd in owned:
            os.close(fd)


class Stager(Protocol):
    """The staging layer's side of one staged job."""

    async def place(
        self, identity: SlotIdentity | None, sources: Mapping[str, int]
    ) -> StagedPlacement:
        """Mount the job's overlays for a run as `identity` (``None``: as the worker).

        Args:
            identity: the slot's uid the job will run as.
            sources: the job's other mount sources (host path → ``O_PATH`` fd opened by
                the arm without following symlinks).

        Raises:
            IdmapUnavailable: `identity` cannot be used here; nothing stays mounted.
            HostFault: the staging helper failed or is gone.
        """
        ...


_stagers: dict[str, Stager] = {}


def register(key: str, stager: Stager) -> None:
    """Make `stager` the one for jobs whose `SandboxJob.stage` is `key`."""
    _stagers[key] = stager


def unregister(key: str) -> None:
    _stagers.pop(key, None)


def stager_for(key: str) -> Stager:
    """The stager registered under `key`.

    Raises:
        HostFault: none is (the job's staging was dropped before it ran).
    """
    stager = _stagers.get(key)
    if stager is None:
        raise HostFault(f"staged job {key} has no staging layer (dropped before its run)")
    return stager
