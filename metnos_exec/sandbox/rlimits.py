"""The job's budgets as kernel resource limits, and the command prefixes that set them
inside the sandbox.

Pure, like `metnos_exec.sandbox.flags` (which re-exports these names): `derive_rlimits`
turns `ResourceLimits` into ``(resource, soft, hard)`` triples; `shell_limits_prefix` and
`prlimit_prefix` turn those into a prefix the guest's command runs behind, which sets them
and ``exec``s the guest. Which of them the bwrap arm uses, or whether it sets the limits
itself, is the arm's choice (`metnos_exec.sandbox.bwrap`).
"""

from __future__ import annotations

import resource
from collections.abc import Sequence

from ._types import ResourceLimits

__all__ = ("derive_rlimits", "prlimit_prefix", "shell_limits_prefix")


def derive_rlimits(limits: ResourceLimits) -> tuple[tuple[int, int, int], ...]:
    """Kernel resource limits for the guest.

    The bwrap arm applies them inside the sandbox with a prefix that ``exec``s the guest
    (`shell_limits_prefix`, else `prlimit_prefix`), so they bind from the guest's first
    instruction; or, when that cannot express them, before bubblewrap's exec (by the
    process layer), where they bind bubblewrap's own processes too.

    - ``RLIMIT_AS`` = memory budget: a big allocation fails (MemoryError / ENOMEM) instead
      of pushing the host into swap or the OOM killer.
    - No ``RLIMIT_NPROC`` here: the pids wall belongs to the process layer (a per-run pids
      cgroup, ``ProcessSpec.pids_max``; it falls back to RLIMIT_NPROC itself, computed
      above the uid's current count — a plain ``pids`` value would make bubblewrap's own
      fork fail for a non-root worker that already runs more processes than that).
    - ``RLIMIT_FSIZE`` = file size budget: the kernel sends SIGXFSZ (or EFBIG when the
      signal is ignored, as CPython does) — the disk cannot be filled by one file.
    - ``RLIMIT_NOFILE`` = open files: no fd exhaustion games.
    - ``RLIMIT_CPU``: soft at the budget (SIGXCPU, reported as ``cpu_time``), hard one
      second later (SIGKILL) for a guest that ignores SIGXCPU.
    - ``RLIMIT_CORE`` = 0: a SIGXCPU/SIGXFSZ death must not hand the guest's memory to the
      host's core handler (``core_pattern`` pipes run outside the sandbox).

    Returns:
        ``((resource, soft, hard), ...)`` in the form `ProcessSpec.rlimits` takes.
    """
    out: list[tuple[int, int, int]] = []
    if limits.memory_bytes is not None:
        out.append((resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes))
    if limits.file_size_bytes is not None:
        out.append((resource.RLIMIT_FSIZE, limits.file_size_bytes, limits.file_size_bytes))
    if limits.open_files is not None:
        out.append((resource.RLIMIT_NOFILE, limits.open_files, limits.open_files))
    if limits.cpu_time_s is not None:
        out.append((resource.RLIMIT_CPU, limits.cpu_time_s, limits.cpu_time_s + 1))
    out.append((resource.RLIMIT_CORE, 0, 0))
    return tuple(out)


# prlimit(1) option for each resource we set (util-linux names).
_PRLIMIT_OPTIONS: dict[int, str] = {
    resource.RLIMIT_AS: "--as",
    resource.RLIMIT_CORE: "--core",
    resource.RLIMIT_CPU: "--cpu",
    resource.RLIMIT_DATA: "--data",
    resource.RLIMIT_FSIZE: "--fsize",
    resource.RLIMIT_MEMLOCK: "--memlock",
    resource.RLIMIT_NOFILE: "--nofile",
    resource.RLIMIT_NPROC: "--nproc",
    resource.RLIMIT_STACK: "--stack",
}


def prlimit_prefix(rlimits: Sequence[tuple[int, int, int]], prlimit: str) -> tuple[str, ...]:
    """A command prefix that applies `rlimits` inside the sandbox, then execs the guest.

    ``prlimit --as=S:H ... -- <guest argv>``: util-linux's prlimit sets its own limits
    (exact byte values, soft and hard) and ``execvp``s the guest, so the limits bind from
    the guest's first instruction, as `derive_rlimits` promises. Why not set them before
    bubblewrap starts: that needs code between fork and exec in the worker, which makes
    CPython fork the whole worker instead of vfork-ing (milliseconds per job). What changes:
    bubblewrap's own two processes no longer carry the limits (they run none of the job's
    code). A command that cannot be executed exits 127 (not found) or 126, as in a shell.

    Args:
        rlimits: ``(resource, soft, hard)`` triples, as `derive_rlimits` returns them.
        prlimit: path of the prlimit executable *as the guest sees it* (a system path).

    Returns:
        ``(prlimit, "--as=...", ..., "--")``; ``()`` when `rlimits` is empty.

    Raises:
        ValueError: a resource prlimit(1) has no option for.
    """
    if not rlimits:
        return ()

    def value(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else str(v)

    out = [prlimit]
    for res, soft, hard in rlimits:
        option = _PRLIMIT_OPTIONS.get(res)
        if option is None:
            raise ValueError(f"no prlimit(1) option for resource {res}")
        out.append(f"{option}={value(soft)}:{value(hard)}")
    out.append("--")
    return tuple(out)


# POSIX-mode ``ulimit`` option and unit for each resource dash, bash (as sh) and busybox
# ash agree on. Others (RLIMIT_NPROC is -p in dash, -u in bash) go through prlimit(1).
_ULIMIT_OPTIONS: dict[int, tuple[str, int]] = {
    resource.RLIMIT_AS: ("-v", 1024),
    resource.RLIMIT_CORE: ("-c", 512),
    resource.RLIMIT_CPU: ("-t", 1),
    resource.RLIMIT_FSIZE: ("-f", 512),
    resource.RLIMIT_NOFILE: ("-n", 1),
}


def shell_limits_prefix(rlimits: Sequence[tuple[int, int, int]], sh: str) -> tuple[str, ...] | None:
    """Like `prlimit_prefix`, with the shell's ``ulimit`` builtin, then ``exec``.

    ``sh -c 'ulimit -v N && ... && exec "$@"' sh <guest argv>``: one exec of a shell that
    needs only libc (dash starts ~0.3 ms faster than prlimit(1), which also loads
    libsmartcols). ``ulimit`` counts in units (KiB, 512-byte blocks), so this is used only
    when every limit is an exact multiple of its unit; otherwise, or for a resource the
    shells name differently, the answer is ``None`` (use `prlimit_prefix`).

    Args:
        rlimits: ``(resource, soft, hard)`` triples, as `derive_rlimits` returns them.
        sh: path of a POSIX shell (dash, bash or busybox ash) *as the guest sees it*.

    Returns:
        The prefix; ``()`` when `rlimits` is empty; ``None`` when not exactly expressible.
    """
    if not rlimits:
        return ()
    inf = resource.RLIM_INFINITY
    steps: list[str] = []
    for res, soft, hard in rlimits:
        spec = _ULIMIT_OPTIONS.get(res)
        if spec is None:
            return None
        option, unit = spec
        values = []
        for v in (soft, hard):
            if v == inf:
                values.append("unlimited")
            elif v % unit:
                return None
            else:
                values.append(str(v // unit))
        if values[0] == values[1]:
            steps.append(f"ulimit {option} {values[0]}")  # soft and hard at once
        else:
            # Soft first (it must stay <= the current hard), then the hard one (>= soft).
            steps.append(f"ulimit -S {option} {values[0]} && ulimit -H {option} {values[1]}")
    # Values are integers we formatted: nothing of the job reaches the script text.
    script = " && ".join([*steps, 'exec "$@"'])
    return (sh, "-c", script, "sh")
