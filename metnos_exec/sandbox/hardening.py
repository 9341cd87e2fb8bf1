"""The kernel mechanisms the bwrap arm adds to bubblewrap's namespaces, and what they hold.

Two, each decided once per worker from what the kernel offers (`host_hardening`):

* the seccomp filter (`.seccomp`): loaded by bubblewrap itself (``--seccomp FD``) just
  before it execs the guest; the program comes through a pipe, one per job;
* landlock (`.landlock`): applied by the guest's first process to itself, before the
  executor's code, through the argv wrapper `guest_job`.

`annotate` adds to the containment report what they hold, and, where one is missing, the
axis that no longer holds says ``partial`` with the reason:

* seccomp, network axis: Unix sockets refused; without it ``partial`` (a host socket
  inside a mounted folder is reachable);
* seccomp, user axis: kernel keyrings refused; without it ``partial`` (the worker's
  keyrings are shared with jobs);
* seccomp, files axis: setuid/setgid bits refused; without it ``partial`` when the job
  has a writable folder (a setuid file can be planted for the host);
* seccomp, process tree: ptrace and new namespaces refused; without it the pid namespace
  still holds;
* landlock, files axis: the read and write roots enforced a second time; without it the
  reason says so (the mounts still hold).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import msgspec

from ._types import AxisVerdict, ContainmentReport, SandboxJob
from .landlock import landlock_rules, landlock_support, wrap_argv
from .seccomp import compile_program, seccomp_support

__all__ = ("Hardening", "annotate", "guest_job", "host_hardening", "seccomp_fd")


class Hardening(msgspec.Struct, frozen=True):
    """What the bwrap arm adds on this host.

    Attributes:
        seccomp_arch: the architecture whose filter is loaded; ``None``: no filter.
        seccomp: a phrase for reports: the filter, or why there is none.
        landlock_abi: the kernel's landlock ABI; ``None``: landlock is not applied.
        landlock: a phrase for reports: the ABI, or why landlock is not applied.
        landlock_python: the interpreter that runs the in-guest step.
        ctypes_path: its ``_ctypes`` extension (``""``: the step imports it).
    """

    seccomp_arch: str | None
    seccomp: str
    landlock_abi: int | None
    landlock: str
    landlock_python: str | None = None
    ctypes_path: str = ""

    @property
    def seccomp_active(self) -> bool:
        return self.seccomp_arch is not None

    @property
    def landlock_active(self) -> bool:
        return self.landlock_abi is not None and self.landlock_python is not None


@functools.cache
def host_hardening() -> Hardening:
    """What the kernel and the worker's interpreter offer, decided once per process."""
    arch, seccomp = seccomp_support()
    landlock = landlock_support()
    return Hardening(
        seccomp_arch=arch,
        seccomp=seccomp,
        landlock_abi=landlock.abi,
        landlock=landlock.phrase,
        landlock_python=landlock.python,
        ctypes_path=landlock.ctypes_path,
    )


def seccomp_fd(hardening: Hardening) -> int | None:
    """A pipe's read end holding the filter, for bubblewrap's ``--seccomp`` (which reads
    it to the end and closes it); ``None`` without a filter. The caller closes its copy.

    One pipe a job: bubblewrap reads from the descriptor's offset, so a shared file would
    be empty for the second job. The program (~2 KiB) fits in the pipe's buffer.
    """
    if hardening.seccomp_arch is None:
        return None
    program = compile_program(hardening.seccomp_arch)
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        os.write(write_end, program)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return read_end


def guest_job(
    job: SandboxJob,
    hardening: Hardening,
    *,
    interpreter_roots: Sequence[str],
    exists: Callable[[str], bool] = os.path.exists,
    readlink: Callable[[str], str | None] = lambda _path: None,
    isdir: Callable[[str], bool] = os.path.isdir,
) -> SandboxJob:
    """`job` behind the in-guest landlock step when landlock is applied here (its argv
    wrapped, the step's variables added to its environment); else `job` itself."""
    if hardening.landlock_abi is None or hardening.landlock_python is None:
        return job
    rules = landlock_rules(
        job, interpreter_roots=interpreter_roots, exists=exists, readlink=readlink, isdir=isdir
    )
    argv, env = wrap_argv(
        job.argv, rules, python=hardening.landlock_python, ctypes_path=hardening.ctypes_path
    )
    return msgspec.structs.replace(job, argv=argv, env={**job.env, **env})


def _add(verdict: AxisVerdict, note: str, *, weakens: bool = False) -> AxisVerdict:
    state = "partial" if weakens and verdict.state == "kept" else verdict.state
    return AxisVerdict(state, f"{verdict.reason}; {note}")


def annotate(report: ContainmentReport, job: SandboxJob, hardening: Hardening) -> ContainmentReport:
    """`report` with what the mechanisms hold, or what their absence opens (module table)."""
    files, network, tree, user = report.files, report.network, report.process_tree, report.user
    if hardening.seccomp_active:
        files = _add(files, "setuid/setgid bits refused (seccomp)")
        network = _add(network, "Unix sockets refused (seccomp)")
        tree = _add(
            tree,
            "ptrace and new namespaces refused (seccomp); the init's memory masked",
        )
        user = _add(user, "kernel keyrings refused (seccomp)")
    else:
        why = f"no seccomp filter: {hardening.seccomp}"
        network = _add(
            network,
            f"a host Unix socket inside a mounted folder is reachable ({why})",
            weakens=True,
        )
        user = _add(
            user, f"the worker's kernel keyrings are shared with jobs ({why})", weakens=True
        )
        if not hardening.landlock_active:
            # Tested (tests/sandbox/test_bwrap_escapes.py): the guest, as the init's uid,
            # attached to bubblewrap's init with ptrace and stopped it (the job then
            # hung until its timeout); landlock would scope ptrace to the guest's domain.
            tree = _add(
                tree,
                f"the guest can ptrace bubblewrap's init, the sandbox's pid 1, and stop or "
                f"rewrite it ({why}; no landlock either)",
                weakens=True,
            )
        if any(m.writable for m in job.mounts):
            files = _add(
                files, f"a setuid/setgid file can be planted for the host ({why})", weakens=True
            )
    if hardening.landlock_active:
        files = _add(files, f"{hardening.landlock} enforces the same read and write roots")
    else:
        files = _add(files, hardening.landlock)
    return msgspec.structs.replace(
        report, files=files, network=network, process_tree=tree, user=user
    )
