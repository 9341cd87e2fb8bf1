"""The worker's side of the staging namespace: the helper process and how to talk to it.

Why a helper process, and why bubblewrap runs under ``nsenter`` (measured on kernel 6.18
with bubblewrap 0.8.0, which has no ``--overlay``):

- an unprivileged overlay needs a user and mount namespace of its own, and a thread of a
  multithreaded process (the worker) may not enter a new user namespace: only a
  single-threaded process can make one, hence `_nshelper` (started once per worker);
- bubblewrap's ``--bind-fd`` resolves the fd to a *path* and binds that, so a detached
  mount (``fsmount``) cannot be handed to it, and an overlay made in another mount
  namespace cannot be bound from ours (the kernel refuses cross-namespace binds);
- so bubblewrap itself starts inside the helper's namespaces (``nsenter``, one exec of
  ~0.9 ms), where the overlays are mounted below ``BASE`` and bound like any folder.

Each job gets its own tmpfs (``size`` = the job's disk budget, ``nr_inodes`` bounded too)
holding every overlay's upper and work folders: the budget holds *while the job runs*, and
staged bytes are RAM (they also count against the job's memory cgroup). The worker keeps
an fd on that tmpfs, so it can read the upper folders from its own namespace after the
job, until it releases it.

An unprivileged helper maps only its own uid and gid: files owned by anyone else appear as
the overflow id and copying them up fails (``EOVERFLOW``), so `Staging` stages only roots
owned by the worker's uid and gid (deeper files of other owners stay read-only to the
job). A root helper needs no user namespace, and any owner works.

A root worker's job runs as its slot's own host uid (`metnos_exec.identities`), which may
not enter the helper's namespace (``setns`` needs CAP_SYS_ADMIN there). So bubblewrap is
started by ``nsenter`` as root, which enters the namespace and only then drops to the
slot's uid and gid (``--setuid``/``--setgid``, supplementary groups cleared), before it
execs bubblewrap: the same one exec as before. What the job sees must then be the
slot's: an overlay mount itself cannot be idmapped (overlayfs refuses, ``EINVAL``), but
its layers can. The worker makes an idmapped clone of each writable folder (root's files
shown as the slot's) and hands it over; the helper attaches it where only root may go
and mounts the overlay with it as the lower layer. The upper layer stays a plain folder
of the job's tmpfs (overlayfs creates its work folder there as root, which an idmapped
upper would have to map): what the job creates is owned by the slot's uid *there*, and
the commit never carries an owner from the upper layer over (`metnos_exec.undo.journal`). The
job's other folders (read-only hints, the executor's folder, the interpreter's prefix)
are idmapped clones too, attached by the helper below the job's folder, which only the
slot's group may enter. For bubblewrap, as the slot's uid, to reach all of them by path,
a root worker's base folder is under ``/run/metnos-exec/stage`` (every folder on the way
passable), not in its state folder (often under ``/root``).
"""

from __future__ import annotations

import array
import contextlib
import functools
import json
import os
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread

from ..errors import HostFault
from ..identities import RUN_DIR, private_dir
from ..sandbox.staged import IdmapUnavailable
from ..sandbox.staging_probe import HELLO_TIMEOUT_S as _HELLO_TIMEOUT_S
from ..sandbox.staging_probe import MAX_MSG as _MAX_MSG
from ..sandbox.staging_probe import NSENTER_SEARCH, find_nsenter, probe_staging
from ..sandbox.staging_probe import spawn_helper as _spawn_helper

__all__ = (
    "NSENTER_SEARCH",
    "RUN_STAGE_DIR",
    "HelperGone",
    "OverlayNamespace",
    "StagingUnavailable",
    "find_nsenter",
    "probe_staging",
)

#: How long one staging request may take (two mounts; normally well under 1 ms).
_REQUEST_TIMEOUT_S: Final = 10.0
#: File descriptors one message may carry (SCM_MAX_FD).
_MAX_FDS: Final = 253
#: Where a root worker's staging helpers have their base folders (see the module doc).
RUN_STAGE_DIR: Final = os.path.join(RUN_DIR, "stage")


class StagingUnavailable(Exception):
    """Staging cannot work here (the reason is for people and for ``no_staging``)."""


class HelperGone(HostFault):
    """The staging helper exited (or was killed): a new one may be started."""


def _run_base() -> Path:
    """A fresh base folder under `RUN_STAGE_DIR` for a root worker's helper (0711, like
    every folder on the way), after removing those of workers that are gone."""
    private_dir(RUN_DIR, 0o711)
    private_dir(RUN_STAGE_DIR, 0o711)
    for name in os.listdir(RUN_STAGE_DIR):
        pid, sep, _ = name.partition("-")
        if sep and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            # Empty on the host (the helper's tmpfs covered it in its namespace only):
            # rmdir, which refuses anything else.
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(RUN_STAGE_DIR, name))
    base = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=RUN_STAGE_DIR))
    os.chmod(base, 0o711)
    return base


class OverlayNamespace:
    """One staging helper process and its namespaces.

    Args:
        base: a folder (created when missing) the helper covers with its own tmpfs and
            mounts the overlays below; nothing is ever written there on the host.
            ``None``: a fresh one under `RUN_STAGE_DIR` (a root worker: see the module
            doc), made at the first `start` and kept for a helper started again (the
            paths of jobs already prepared lead there), removed by `aclose(final=True)`.
    """

    def __init__(self, base: str | os.PathLike[str] | None) -> None:
        self._own_base = base is None
        self.base = Path(base).absolute() if base is not None else Path(RUN_STAGE_DIR)
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._lock = anyio.Lock()
        self._nsenter: str | None = None
        self.userns = False

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._sock is not None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def enter(self, uid: int | None = None, gid: int | None = None) -> tuple[str, ...]:
        """The command prefix that runs the next program inside the helper's namespaces
        (as `uid` and `gid` once inside, with no supplementary groups, when given: a
        root worker's slot; nsenter exits with an error, and runs nothing, when it
        cannot drop to them)."""
        assert self._nsenter is not None and self._proc is not None
        prefix = [self._nsenter, "-t", str(self._proc.pid), "-m"]
        if self.userns:
            # Into the user namespace first (it grants the right to enter the mount one),
            # keeping our own uid and gid (mapped to themselves there).
            prefix[3:3] = ["-U", "--preserve-credentials"]
        if uid is not None and gid is not None:
            prefix += ["-S", str(uid), "-G", str(gid)]
        return (*prefix, "--")

    @property
    def xattr_prefix(self) -> str:
        return "user." if self.userns else "trusted."

    async def start(self) -> None:
        """Start the helper and wait for its probe overlay to work.

        Raises:
            StagingUnavailable: no nsenter, or the helper could not make an overlay.
        """
        if self.running:
            return
        await self.aclose()
        nsenter = find_nsenter()
        if nsenter is None:
            raise StagingUnavailable("nsenter (util-linux) not found")
        self._nsenter = nsenter
        if self._own_base and self.base == Path(RUN_STAGE_DIR):
            try:
                self.base = await anyio.to_thread.run_sync(_run_base)
            except OSError as exc:
                raise StagingUnavailable(f"cannot make a base folder for staging: {exc}") from exc
        else:
            self.base.mkdir(mode=0o700, parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = await anyio.to_thread.run_sync(_spawn_helper, self.base, theirs.fileno())
        except OSError as exc:
            ours.close()
            raise StagingUnavailable(f"cannot start the staging helper: {exc}") from exc
        finally:
            theirs.close()
        self._sock = ours
        try:
            with anyio.fail_after(_HELLO_TIMEOUT_S):
                hello = await self._recv()
        except (TimeoutError, HostFault) as exc:
            await self.aclose()
            raise StagingUnavailable(f"the staging helper did not answer: {exc}") from exc
        if not hello[0].get("ok"):
            await self.aclose()
            raise StagingUnavailable(str(hello[0].get("error", "unknown error")))
        self.userns = bool(hello[0].get("userns"))

    async def stage(
        self,
        job_id: str,
        roots: list[tuple[str, int, int]],
        *,
        size: int,
        inodes: int,
        lowers: Sequence[int] = (),
        sources: Sequence[int] = (),
        gid: int | None = None,
    ) -> tuple[int, list[int]]:
        """Mount the job's tmpfs and overlays (``u<i>`` and ``w<i>`` per root in the tmpfs;
        the overlays at ``base/job_id/<i>``).

        Args:
            lowers: one detached mount per root (an idmapped clone, `idmapped_clone`):
                the overlays' lower layers, instead of the roots opened by path.
            sources: detached mounts attached below the job's folder, for bubblewrap to
                bind from.
            gid: the group that may enter the job's folder (a slot's), else only root.

        Returns:
            An fd on the tmpfs, and an ``O_PATH`` fd on each attached source (in order).

        Raises:
            IdmapUnavailable: the helper could not use an idmapped mount (nothing mounted).
            HostFault: the helper refused (a root changed, a mount failed) or died.
        """
        request = {
            "op": "stage",
            "id": job_id,
            "size": size,
            "inodes": inodes,
            "roots": [{"path": p, "dev": d, "ino": i} for p, d, i in roots],
            "lowers": len(lowers),
            "sources": len(sources),
            "gid": gid,
        }
        fds_out = (*lowers, *sources)
        if len(fds_out) > _MAX_FDS:
            raise HostFault(f"a staged job with {len(fds_out)} mounts (at most {_MAX_FDS})")
        async with self._lock:
            # Shielded: a reply abandoned half-way (a cancelled job) would be read as the
            # answer to the next request. Bounded: a helper that hangs is replaced.
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(_REQUEST_TIMEOUT_S) as waited:
                    self._send(request, fds_out)
                    reply, fds = await self._recv()
                if waited.cancelled_caught:
                    await self.aclose()
                    raise HostFault(
                        f"the staging helper did not answer within {_REQUEST_TIMEOUT_S:g} s"
                    )
        if not reply.get("ok") or len(fds) != 1 + len(sources):
            for fd in fds:
                os.close(fd)
            error = reply.get("error", f"{len(fds)} fds in the reply")
            if reply.get("idmap"):
                raise IdmapUnavailable(f"the staging helper refused an idmapped mount: {error}")
            raise HostFault(f"staging failed: {error}")
        return fds[0], fds[1:]

    def release(self, job_id: str) -> None:
        """Unmount what `stage` made (the helper does it; nobody waits)."""
        if self.running:
            # A helper that is gone took its mounts with it.
            with contextlib.suppress(HostFault):
                self._send({"op": "release", "id": job_id})

    def overlay_path(self, job_id: str, index: int) -> str:
        return str(self.base / job_id / str(index))

    async def aclose(self, *, final: bool = False) -> None:
        """Stop the helper (its namespace and every mount in it go with it); `final`:
        the base folder too, when this made it."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()  # the helper reads end of file and exits
        proc, self._proc = self._proc, None
        if proc is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(functools.partial(proc.wait, 5.0))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    await anyio.to_thread.run_sync(proc.wait)
        if final and self._own_base and self.base != Path(RUN_STAGE_DIR):
            # Empty on the host once the helper is gone (rmdir refuses anything else).
            with contextlib.suppress(OSError):
                self.base.rmdir()
            self.base = Path(RUN_STAGE_DIR)

    # --- plumbing ----------------------------------------------------------------------

    def _send(self, doc: dict[str, Any], fds: Sequence[int] = ()) -> None:
        if self._sock is None:
            raise HelperGone("the staging helper is not running")
        data = json.dumps(doc).encode()
        try:
            if fds:
                self._sock.sendmsg(
                    [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                )
            else:
                self._sock.send(data)
        except OSError as exc:
            raise HelperGone(f"the staging helper is gone: {exc}") from exc

    async def _recv(self) -> tuple[dict[str, Any], list[int]]:
        sock = self._sock
        if sock is None:
            raise HelperGone("the staging helper is not running")
        sock.setblocking(False)
        while True:
            try:
                data, ancdata, _flags, _addr = sock.recvmsg(
                    _MAX_MSG, socket.CMSG_SPACE(array.array("i").itemsize * _MAX_FDS)
                )
                break
            except BlockingIOError:
                await anyio.wait_readable(sock)
            except OSError as exc:  # ECONNRESET: it died with our request unread
                raise HelperGone(f"the staging helper is gone: {exc}") from exc
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if not data:
            for fd in fds:
                os.close(fd)
            raise HelperGone("the staging helper exited")
        return json.loads(data), fds
