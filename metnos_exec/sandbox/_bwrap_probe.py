"""The bwrap arm's probe of bubblewrap: where it is, which version, what it supports, and
whether our sandbox can be built with it here.

`bwrap_probe` is what the arm, `metnos_exec.sandbox.select` and `status` ask. It is cached:
a positive probe for as long as the same binary (path, inode, size, mtime) is installed, a
negative one for `NEGATIVE_PROBE_TTL_S`, and a missing bubblewrap is looked for again on
every call, so installing or repairing it needs no restart of the worker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping

import msgspec

from ._types import SandboxJob
from .flags import BwrapFeatures, derive_bwrap_argv

__all__ = ("NEGATIVE_PROBE_TTL_S", "BwrapProbe", "bwrap_probe", "find_bwrap", "forget_probes")

#: How long a failed namespace probe is trusted before bubblewrap is tried again: a fixed
#: sysctl or a repaired install is picked up without restarting the worker.
NEGATIVE_PROBE_TTL_S = 30.0


class BwrapProbe(msgspec.Struct, frozen=True):
    """What one probe of bubblewrap found.

    Attributes:
        path: the bubblewrap executable, or ``None`` when none was found.
        version: parsed ``bwrap --version``; ``()`` when unknown.
        working: a sandbox with our namespace flags could be created and ran ``true``.
        error: why not, in bubblewrap's words (for people; decisions never parse it).
        bind_fd: ``bwrap --help`` lists ``--bind-fd`` (see `BwrapFeatures.bind_fd`).
    """

    path: str | None
    version: tuple[int, ...] = ()
    working: bool = False
    error: str | None = None
    bind_fd: bool = False

    @property
    def features(self) -> BwrapFeatures:
        return BwrapFeatures(version=self.version, bind_fd=self.bind_fd)


#: How long a successful ``$PATH`` search for bubblewrap is reused (the supervisor probes
#: once per job; a ``$PATH`` walk is a dozen ``stat`` calls). A missing bubblewrap is
#: looked for again on every call.
FIND_TTL_S = 2.0

_found: dict[tuple[str, str], tuple[str, float]] = {}


def find_bwrap(env: Mapping[str, str] | None = None) -> str | None:
    """Locate bubblewrap: ``$METNOS_BWRAP`` (a path, or a name looked up on ``$PATH``),
    else ``bwrap`` on ``$PATH``. A hit is reused for `FIND_TTL_S` seconds, a miss never:
    installing bubblewrap later needs no restart."""
    environ: Mapping[str, str] = os.environ if env is None else env
    wanted = environ.get("METNOS_BWRAP") or "bwrap"
    if "/" in wanted:
        return wanted if os.access(wanted, os.X_OK) else None
    path = environ.get("PATH", os.defpath)
    now = time.monotonic()
    hit = _found.get((wanted, path))
    if hit is not None and now - hit[1] < FIND_TTL_S:
        return hit[0]
    found = shutil.which(wanted, path=path)
    if found is not None:
        if len(_found) > 64:
            _found.clear()
        _found[(wanted, path)] = (found, now)
    return found


def _parse_version(text: str) -> tuple[int, ...]:
    # "bubblewrap 0.8.0"
    for word in text.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return tuple(int(p) for p in parts)
    return ()


def _probe_uncached(path: str) -> BwrapProbe:
    # A one-shot, synchronous probe: it outlives nothing, needs no die-with-parent and is
    # reaped (killed on timeout) by subprocess.run, so it does not go through run_process.
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, timeout=10, check=False, env={}
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return BwrapProbe(path=path, error=f"bwrap --version: {exc}")
    version = _parse_version(out.stdout.decode(errors="replace"))
    try:
        usage = subprocess.run(
            [path, "--help"], capture_output=True, timeout=10, check=False, env={}
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        usage = b""
    # Parsed from the usage text: distributions backport it to older versions.
    bind_fd = b"--bind-fd" in usage and b"--ro-bind-fd" in usage
    true = shutil.which("true", path="/usr/bin:/bin") or "/bin/true"
    # The very namespace set the arm uses (user, pid, ipc, uts, net, cgroup), so "working"
    # means "our sandbox can be built here", not merely "bwrap starts".
    argv = derive_bwrap_argv(
        SandboxJob(argv=(true,)), bwrap=path, features=BwrapFeatures(version=version)
    )
    try:
        run = subprocess.run(argv, capture_output=True, timeout=10, check=False, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return BwrapProbe(path=path, version=version, error=f"bwrap probe: {exc}")
    if run.returncode != 0:
        err = run.stderr.decode(errors="replace").strip().splitlines()
        reason = err[-1] if err else f"exit status {run.returncode}"
        return BwrapProbe(path=path, version=version, error=reason, bind_fd=bind_fd)
    return BwrapProbe(path=path, version=version, working=True, bind_fd=bind_fd)


_cache_lock = threading.Lock()
# key (path, inode, size, mtime_ns) -> (probe, monotonic time it was taken)
_cache: dict[tuple[str, int, int, int], tuple[BwrapProbe, float]] = {}


def bwrap_probe(env: Mapping[str, str] | None = None, *, refresh: bool = False) -> BwrapProbe:
    """Find bubblewrap and probe that it can build our sandbox, cached.

    A positive probe is cached for as long as the same binary (path, inode, size, mtime)
    is installed; a negative one for `NEGATIVE_PROBE_TTL_S`; a missing binary is looked
    for again on every call.

    Args:
        env: where ``METNOS_BWRAP`` and ``PATH`` are read; default `os.environ`.
        refresh: ignore the cache.
    """
    path = find_bwrap(env)
    if path is None:
        return BwrapProbe(path=None, error="bubblewrap (bwrap) not found")
    try:
        st = os.stat(path)
    except OSError as exc:
        return BwrapProbe(path=path, error=f"cannot stat {path}: {exc}")
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and not refresh:
            probe, taken = hit
            if probe.working or now - taken < NEGATIVE_PROBE_TTL_S:
                return probe
    probe = _probe_uncached(path)
    with _cache_lock:
        _cache[key] = (probe, now)
    return probe


def forget_probes() -> None:
    """Drop every cached probe (tests)."""
    with _cache_lock:
        _cache.clear()
    _found.clear()
