"""Whether overlay staging works on this host, and how the staging namespace's helper is
started: what `status` reports, and what the staging layer starts its helper with.

A staged job's bubblewrap starts inside the staging helper's namespaces (`staged`), under
``nsenter``; the helper is the staging layer's script (``metnos_exec/undo/_nshelper.py``,
standard library only, run by path: nothing of `metnos_exec.undo` is imported here). It
answers one hello once its probe overlay worked (or failed), which is all `probe_staging`
reads; `metnos_exec.undo.overlay` starts the same helper the same way and then talks to
it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final

__all__ = (
    "HELLO_TIMEOUT_S",
    "MAX_MSG",
    "NSENTER_SEARCH",
    "find_nsenter",
    "probe_staging",
    "spawn_helper",
)

#: Where nsenter (util-linux) is looked for: system folders only.
NSENTER_SEARCH: Final = "/usr/bin:/bin:/usr/sbin:/sbin"
#: How long the helper may take to say hello (its probe overlay mounted and written).
HELLO_TIMEOUT_S: Final = 15.0
#: The largest message the helper sends or takes.
MAX_MSG: Final = 65536
_HELPER: Final = Path(__file__).parent.parent / "undo" / "_nshelper.py"


def find_nsenter() -> str | None:
    return shutil.which("nsenter", path=NSENTER_SEARCH)


def spawn_helper(base: Path, fd: int) -> subprocess.Popen[bytes]:
    # A plain child in our session: the orphan sweep leaves it alone (see
    # process.reap_orphans), and it exits when our end of the socket closes (so no
    # parent-death signal, which would tie it to whichever thread spawned it).
    return subprocess.Popen(
        [sys.executable, "-I", "-S", str(_HELPER), str(base), str(fd)],
        pass_fds=(fd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={},
    )


def probe_staging() -> str:
    """Whether overlay staging works here, for ``status``: start a helper (it mounts and
    writes through a probe overlay), read its answer, stop it. Blocking (~20 ms).

    Returns:
        ``"available"`` (root: any owner), ``"available (user namespace: ...)"``, or
        ``"unavailable: <reason>"``.
    """
    if find_nsenter() is None:
        return "unavailable: nsenter (util-linux) not found"
    with tempfile.TemporaryDirectory(prefix="metnos-stage-probe-") as base:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                proc = spawn_helper(Path(base), theirs.fileno())
            except OSError as exc:
                return f"unavailable: cannot start the staging helper: {exc}"
            finally:
                theirs.close()
            try:
                ours.settimeout(HELLO_TIMEOUT_S)
                hello = json.loads(ours.recv(MAX_MSG) or b"{}")
            except (OSError, ValueError) as exc:
                hello = {"ok": False, "error": f"no answer: {exc}"}
        finally:
            ours.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if not hello.get("ok"):
        return f"unavailable: {hello.get('error', 'the helper exited')}"
    if hello.get("userns"):
        return "available (user namespace: only folders the worker's uid and gid own)"
    return "available"
