"""Where, as whom and from what the bwrap arm's job runs: its mount sources opened without
following a symlink (`_open_sources`), and, for a root worker, the slot's own uid with the
sources idmapped for it, or why the job runs as root; for a staged job, its overlays placed
for that uid by the staging layer (`_placement`, `metnos_exec.sandbox.staged`).
"""

from __future__ import annotations

import dataclasses
import os

from ..errors import HostFault
from ..process import Slot
from ._bwrap_report import _slot_uids_unavailable, worker_is_root
from ._types import SandboxJob
from .mount_sources import StagedSources, open_source
from .staged import IdmapUnavailable, StagedPlacement, stager_for


@dataclasses.dataclass
class _Placement:
    """Where and as whom one job runs: its mount sources (fds to bind from), its slot,
    for a root worker whether it runs as the slot's own uid (else why not), and for a
    staged job the prefix bubblewrap starts under (`metnos_exec.sandbox.staged`)."""

    sources: dict[str, int]
    slot: Slot | None = None
    #: The idmapped sources of an unstaged job run as the slot's uid.
    idmapped: StagedSources | None = None
    #: A staged job's overlays, placed for the uid it runs as.
    staged: StagedPlacement | None = None
    #: The slot's uid the job runs as (``None``: the worker's).
    uid: int | None = None
    root_reason: str | None = None

    @property
    def as_slot_user(self) -> bool:
        return self.uid is not None

    @property
    def enter(self) -> tuple[str, ...]:
        return () if self.staged is None else self.staged.enter

    def close(self) -> None:
        if self.idmapped is not None:
            self.idmapped.close()
        if self.staged is not None:
            self.staged.close()


async def _placement(
    slot: Slot | None, sources: dict[str, int], *, stage: str | None = None
) -> _Placement:
    """For a root worker: the slot's uid and the job's folders idmapped for it, or the
    reason the job runs as root (no slot here, slot uids off or unavailable, a folder
    whose filesystem refuses idmapped mounts). Anyone else: the sources as opened.

    A staged job (`stage`) has its overlays mounted now, for that uid
    (`metnos_exec.sandbox.staged`): bubblewrap then starts in the staging namespace,
    which only root may enter, so it is forked as root and drops to the slot's uid there
    (``nsenter --setuid --setgid``) before it runs.
    """
    stager = None if stage is None else stager_for(stage)
    if not worker_is_root():
        if stager is None:
            return _Placement(sources, slot)
        placed = await stager.place(None, sources)
        return _Placement(placed.sources, slot, staged=placed)
    why = _slot_uids_unavailable()  # read per job: METNOS_SLOT_UIDS=off takes effect at once
    identity = None
    if why is None and slot is None:
        why = "no job slot here (slots need a writable cgroup v1 pids hierarchy)"
    elif why is None and slot is not None:
        identity = await slot.identity()
        if identity is None:
            why = slot.identity_error
    if identity is not None and stager is None:
        try:
            idmapped = StagedSources(sources, identity.uid, identity.gid, identity.userns_fd)
        except OSError as exc:
            why = f"cannot mount as the slot uid: {exc}"
        else:
            return _Placement(idmapped.fds, slot, idmapped=idmapped, uid=identity.uid)
    elif identity is not None and stager is not None:
        try:
            placed = await stager.place(identity, sources)
        except IdmapUnavailable as exc:
            why = f"cannot mount as the slot uid: {exc}"
        else:
            return _Placement(placed.sources, slot, staged=placed, uid=identity.uid)
    if stager is None:
        return _Placement(sources, slot, root_reason=why)
    placed = await stager.place(None, sources)
    return _Placement(placed.sources, slot, staged=placed, root_reason=why)


def _open_sources(job: SandboxJob, roots: tuple[str, ...]) -> dict[str, int]:
    """Open each job mount's host folder and each interpreter root (see
    `mount_sources.open_source`); an absent one is left out (it is not mounted).

    Raises:
        SymlinkedFolder: one is reached through a symlink (nothing is left open).
        HostFault: the kernel refused to open one for another reason.
    """
    fds: dict[str, int] = {}
    try:
        # A staged mount lives in the staging namespace, not here (`Mount.staged`).
        for path in (*roots, *(m.host for m in job.mounts if not m.staged)):
            if path in fds:
                continue
            try:
                fds[path] = open_source(path)
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                # Not mounted, as before: a hint naming a missing folder, or a folder the
                # worker's own uid cannot reach (the guest could not have either).
                continue
            except OSError as exc:
                raise HostFault(f"cannot open mount source {path}: {exc}") from exc
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds
