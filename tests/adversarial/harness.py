"""The adversarial suite's harness: attempts as tiny executors, run by a real worker.

An `Attempt` is one row of the table in `tests.adversarial.attempts`: an id
(``files.symlink_swap_hint``), the axis of the containment report it attacks, the
mechanism expected to stop it, and a script. The harness writes each attempt as an
executor folder (``manifest.toml`` + ``main.py``, or a ``.wat`` module) into a fresh
executors root, starts a real ``metnos-exec worker`` process on a SQLite queue (the
product path: broker, worker, planning from the manifest, the arm the worker picks),
submits every attempt of a phase, waits for their results, runs the next phase, and
stops the worker with SIGTERM. Everything then is asserted per row (`judge`):

1. the attempt is *stopped*: its script reports ``escaped: false`` and no host-side check
   (`Attempt.host_check`) finds evidence, or the job ended with one of the row's
   expected codes (the wall that stopped it: ``E_MEMORY``, ``E_TIMEOUT``, ...);
2. where it gets through, and only where the row says it may (`Attempt.through`), the
   report's axis for it is ``partial`` or ``not_kept`` with the row's reason in it;
   a report saying ``kept`` for an axis whose attempt got through fails the row, always.

No job's input may surface as a host fault: a dead-lettered attempt fails its row.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.messages import Job, Result

Axis = Literal["files", "network", "process_tree", "user", "resources"]
#: Where an attempt may get through (then its axis must say so): nowhere, only with a
#: root worker, only with an unprivileged one, or on every worker (a control).
Through = Literal["never", "root", "unprivileged", "always"]

IS_ROOT = os.geteuid() == 0

#: The report's ``sandbox`` for each arm the harness runs: a row's result must say it.
ARM_REPORTED = {"bwrap": "bwrap", "direct": "none", "wasm": "wasm"}

# What every Python attempt starts with: its context (paths, ports, the worker's pid) as
# CTX, a way to report, and raw system calls by name (x86_64 and aarch64 numbers).
PREAMBLE = r'''
import ctypes, errno, json, os, socket, struct, sys
ARGS = json.load(sys.stdin)
CTX = json.loads(ARGS["ctx"])
HOME = CTX["home"]
NAME = os.path.basename(os.path.dirname(os.path.abspath(__file__)))
OWN = os.path.join(HOME, "w", NAME)  # the attempt's own folder ("{own}" in its hints)
libc = ctypes.CDLL(None, use_errno=True)
_NR = {
    "x86_64": dict(ptrace=101, process_vm_readv=310, process_vm_writev=311, keyctl=250,
        add_key=248, request_key=249, bpf=321, perf_event_open=298, userfaultfd=323,
        io_uring_setup=425, kexec_load=246, kexec_file_load=320, init_module=175,
        finit_module=313, delete_module=176, pivot_root=155, unshare=272, setns=308,
        mount=165, umount2=166, open_by_handle_at=304, name_to_handle_at=303,
        pidfd_open=434, pidfd_getfd=438, chroot=161, fchmodat2=452, open_tree=428,
        fsopen=430, move_mount=429, clone3=435, mknodat=259, fchmodat=268, chmod=90,
        fchmod=91, sethostname=170, swapon=167, acct=163, reboot=169, settimeofday=164,
        syslog=103, iopl=172, ioperm=173, quotactl=179, setuid=105, lookup_dcookie=212,
        fanotify_init=300, personality=135, mbind=237, memfd_secret=447),
    "aarch64": dict(ptrace=117, process_vm_readv=270, process_vm_writev=271, keyctl=219,
        add_key=217, request_key=218, bpf=280, perf_event_open=241, userfaultfd=282,
        io_uring_setup=425, kexec_load=104, kexec_file_load=294, init_module=105,
        finit_module=273, delete_module=106, pivot_root=41, unshare=97, setns=268,
        mount=40, umount2=39, open_by_handle_at=265, name_to_handle_at=264,
        pidfd_open=434, pidfd_getfd=438, chroot=51, fchmodat2=452, open_tree=428,
        fsopen=430, move_mount=429, clone3=435, mknodat=33, fchmodat=53, chmod=None,
        fchmod=52, sethostname=161, swapon=224, acct=89, reboot=142, settimeofday=170,
        syslog=116, iopl=None, ioperm=None, quotactl=60, setuid=146, lookup_dcookie=18,
        fanotify_init=262, personality=92, mbind=235, memfd_secret=447),
}[os.uname().machine]
libc.syscall.restype = ctypes.c_long


def sc(name, *args):
    """A raw system call: (return value, errno name or None)."""
    nr = _NR[name]
    if nr is None:
        return -1, "ENOSYS"
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    r = libc.syscall(ctypes.c_long(nr), *conv)
    return r, (errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno())) if r < 0 else None)


def en(exc):
    return errno.errorcode.get(exc.errno, str(exc.errno)) if isinstance(exc, OSError) else repr(exc)


def done(escaped, **detail):
    print(json.dumps({"escaped": bool(escaped), **detail}, default=str), flush=True)
    sys.exit(0)


def attempt(fn):
    """fn() -> 'ok' or the errno's name."""
    try:
        fn()
        return "ok"
    except OSError as exc:
        return en(exc)
'''

MANIFEST = """\
name = "{name}"
version = "1"
runtime = "{runtime}"
entry = "{entry}"
[args.ctx]
type = "string"
format = "text"
default = "{{}}"
{path_arg}[limits]
{limits}
{caps}
"""


@dataclass(frozen=True)
class Attempt:
    """One row: an escape attempt and what must become of it.

    Attributes:
        id: ``axis-ish.what`` (``files.symlink_swap_hint``), unique.
        axis: the containment axis the attempt attacks.
        mechanism: what should stop it (``seccomp``, ``mount namespace``, ``staging``...).
        script: the executor's code after `PREAMBLE` (``runtime = "python"``), or a WAT
            module (``runtime = "wasm"``).
        caps: ``(capability, hints)`` pairs for the manifest.
        limits: the manifest's ``[limits]`` table.
        phase: attempts run phase by phase (a later phase sees what an earlier left).
        through: where it may get through; then `reason` must be in the axis's reason.
        reason: the words the axis's reason must hold when the attempt got through.
        stopped_by: error codes that mean the wall stopped it (the job did not finish).
        host_check: evidence of an escape found on the host after the run, or ``None``.
        setup: prepares the host before the worker starts (files, sockets, listeners).
        needs_root: set-up only root can do (a file of another user): skipped otherwise.
        runtime: ``python`` or ``wasm``.
        path_arg: the job's ``path`` argument (``format = "path"``: vetted), if any.
    """

    id: str
    axis: Axis
    mechanism: str
    script: str
    caps: tuple[tuple[str, tuple[str, ...]], ...] = ()
    limits: dict[str, Any] = field(default_factory=dict)
    phase: int = 1
    through: Through = "never"
    reason: str = ""
    stopped_by: frozenset[str] = frozenset()
    host_check: Callable[[World, Result | None], str | None] | None = None
    setup: Callable[[World], None] | None = None
    needs_root: bool = False
    runtime: Literal["python", "wasm"] = "python"
    path_arg: str = ""

    @property
    def name(self) -> str:
        return self.id.replace(".", "_")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _loopback(host: str) -> str:
    """`host`, when it is a loopback address: no row may aim anywhere else (the attempts
    run on every arm, and an arm that let them out would send real packets)."""
    import ipaddress

    assert ipaddress.ip_address(host).is_loopback, f"{host} is not a loopback address"
    return host


@dataclass
class World:
    """The host the attempts run against: a home with secrets, listeners, a canary."""

    root: Path
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    ctx: dict[str, Any] = field(default_factory=dict)
    listeners: dict[str, socket.socket] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    canary: subprocess.Popen[bytes] | None = None
    cleanup: list[Path] = field(default_factory=list)
    on_close: list[Callable[[], object]] = field(default_factory=list)

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def executors(self) -> Path:
        # Inside the home, where an operator keeps them: an executor whose hint covers
        # ~/.metnos tries to rewrite another (files.later_executor_rewritten).
        return self.home / ".metnos" / "executors"

    @property
    def state(self) -> Path:
        # Where an operator may keep it, next to the executors (see files.state_dir_*).
        return self.home / ".metnos" / "state"

    @property
    def db(self) -> Path:
        return self.root / "queue" / "q.db"

    def listen_tcp(self, key: str, host: str = "127.0.0.1") -> int:
        """A TCP listener of the host on `host` (loopback only: see `_loopback`)."""
        addr = _loopback(host)
        s = socket.socket(_family(host), socket.SOCK_STREAM)
        s.bind((addr, 0))
        s.listen(16)
        s.setblocking(False)
        self.listeners[key] = s
        port: int = s.getsockname()[1]
        return port

    def listen_udp(self, key: str, host: str = "127.0.0.1") -> int:
        """A UDP socket of the host on `host`; `received` counts what reached it."""
        addr = _loopback(host)
        s = socket.socket(_family(host), socket.SOCK_DGRAM)
        s.bind((addr, 0))
        s.setblocking(False)
        self.listeners[key] = s
        port: int = s.getsockname()[1]
        return port

    def received(self, key: str) -> int:
        """Datagrams that reached UDP socket `key` (read and dropped here)."""
        n = 0
        while True:
            try:
                self.listeners[key].recv(65536)
            except BlockingIOError:
                return n
            n += 1

    def listen_unix(self, key: str, path: str) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.listen(16)
        s.setblocking(False)
        self.listeners[key] = s

    def accepted(self, key: str) -> int:
        """Connections that reached listener `key` (accepted and closed here)."""
        n = 0
        while True:
            try:
                conn, _ = self.listeners[key].accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    def close(self) -> None:
        for s in self.listeners.values():
            s.close()
        self.listeners.clear()
        for p in self.cleanup:
            p.unlink(missing_ok=True)
        self.cleanup.clear()
        for undo in self.on_close:
            undo()
        self.on_close.clear()
        if self.canary is not None:
            if self.canary.poll() is None:
                self.canary.kill()
            self.canary.wait()


@dataclass
class Run:
    """What one worker made of the attempts."""

    results: dict[str, Result | None]
    evidence: dict[str, str | None]
    dead: dict[str, str]
    world: World
    privileged: bool
    arm: str
    backend: str
    worker_log: Path
    worker_exit: int
    seconds: float
    survivors: list[str]


def write_executor(world: World, a: Attempt) -> None:
    folder = world.executors / a.name
    folder.mkdir(parents=True)
    # "{own}" in a hint: the attempt's own folder, ~/w/<name> (made here), so that
    # attempts running side by side never write to the same place.
    own = world.home / "w" / a.name
    own.mkdir(parents=True)

    def hint(h: str) -> str:
        h = h.replace("{own}", f"~/w/{a.name}")
        for key, value in world.ctx.items():
            h = h.replace("{ctx:" + key + "}", str(value))
        return h

    caps = "\n".join(
        f'[[capabilities]]\nname = "{cap}"\nhints = {json.dumps([hint(h) for h in hints])}'
        for cap, hints in a.caps
    )
    limits = {"timeout_s": 20, **a.limits}
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in limits.items())
    if a.runtime == "wasm":
        entry = "main.wat"
        (folder / entry).write_text(a.script)
    else:
        entry = "main.py"
        (folder / entry).write_text(PREAMBLE + textwrap.dedent(a.script))
    (folder / "manifest.toml").write_text(
        MANIFEST.format(
            name=a.name,
            runtime=a.runtime,
            entry=entry,
            limits=lines,
            caps=caps,
            path_arg='[args.path]\ntype = "string"\nformat = "path"\n' if a.path_arg else "",
        )
    )


def _as_a_service(pid: int) -> None:
    """The worker's open-file limit as a service manager gives it (systemd: a soft limit
    of 1,024 below a higher hard one), whoever runs the suite; set as it starts (it opens
    a few dozen files before it serves)."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (min(1024, hard), hard))


def _processes_with(token: str) -> list[str]:
    """Every process on the host whose command line holds `token` (orphans of a job)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if token in cmd:
            found.append(f"{entry}: {cmd}")
    return found


def run_attempts(
    world: World,
    attempts: Sequence[Attempt],
    *,
    backend: str,
    sandbox: Literal["bwrap", "direct", "wasm"],
    concurrency: int = 4,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> Run:
    """Write `attempts` as executors, serve them with one real worker, phase by phase."""
    started = time.monotonic()
    world.executors.mkdir(parents=True, exist_ok=True)
    world.db.parent.mkdir(parents=True, exist_ok=True)
    for a in attempts:
        ready = a.setup is not None and (IS_ROOT or not a.needs_root)
        # A hint naming what the set-up makes ("{ctx:KEY}": a listener's port) needs the
        # set-up first; the others set up in the folders write_executor makes.
        early = "{ctx:" in repr(a.caps)
        if ready and early:
            a.setup(world)  # type: ignore[misc]
        write_executor(world, a)
        if ready and not early:
            a.setup(world)  # type: ignore[misc]
    log = world.root / "worker.jsonl"
    worker_env = {k: v for k, v in os.environ.items() if not k.startswith(("METNOS_", "PYTEST_"))}
    worker_env.update(
        HOME=str(world.home),
        METNOS_STATE_DIR=str(world.state),
        # Secrets a job must never see (user.env_secrets).
        METNOS_ADV_SECRET=f"secret-{world.token}",
        AWS_SECRET_ACCESS_KEY=f"aws-{world.token}",
        **(env or {}),
    )
    if os.environ.get("METNOS_TEST_WARM") == "1":
        # The warm pass (issue 22): every job that can run in a warm bwrap sandbox does,
        # the first of its executor too (`sandbox._bwrap_warm.WarmPools.eager`).
        worker_env.update(METNOS_WARM_SANDBOXES="1", METNOS_WARM_EAGER="1")
    if sandbox == "direct":
        worker_env["METNOS_SANDBOX"] = "off"
    else:
        # The arm the rows are about, or nothing: a worker that fell back to the direct
        # arm (bubblewrap broken, a probe gone wrong) would run every attempt unconfined,
        # network rows included. Required, a degraded job is refused before it runs.
        worker_env["METNOS_REQUIRE_SANDBOX"] = "always"
    # A canary the attempts try to kill: a host process of the worker's own uid.
    world.canary = subprocess.Popen(
        ["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    argv = [
        sys.executable,
        "-m",
        "metnos_exec",
        "worker",
        "--broker",
        f"sqlite:///{world.db}",
        "--executors",
        str(world.executors),
        "--worker-id",
        f"adv-{sandbox}-{backend}",
        "--log-file",
        str(log),
        "--backend",
        backend,
        "--concurrency",
        str(concurrency),
        "--grace",
        "5",
    ]
    proc = subprocess.Popen(
        argv,
        env=worker_env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _as_a_service(proc.pid)
    results: dict[str, Result | None] = {}
    dead: dict[str, str] = {}
    try:
        world.ctx.update(
            home=str(world.home),
            token=world.token,
            worker_pid=proc.pid,
            canary_pid=world.canary.pid,
            pytest_pid=os.getpid(),
            db=str(world.db),
            state=str(world.state),
        )
        ctx = json.dumps(world.ctx)
        phases = sorted({a.phase for a in attempts})

        async def serve_phases() -> None:
            async with SQLiteBroker(world.db) as broker:
                for phase in phases:
                    batch = [a for a in attempts if a.phase == phase]
                    jobs = [
                        Job(
                            executor=a.name,
                            args={"ctx": ctx, **({"path": a.path_arg} if a.path_arg else {})},
                            max_attempts=1,
                        )
                        for a in batch
                    ]
                    receipts = await broker.submit_many(jobs)
                    ids = {a.id: r.job_id for a, r in zip(batch, receipts, strict=True)}
                    deadline = time.monotonic() + timeout
                    for aid, jid in ids.items():
                        while True:
                            got = await broker.get_result(jid)
                            if got is not None:
                                results[aid] = got
                                break
                            letters = {d.job_id: d for d in await broker.dead_letters(limit=500)}
                            if jid in letters:
                                results[aid] = None
                                dead[aid] = (
                                    f"{letters[jid].error.code}: {letters[jid].error.message}"
                                )
                                break
                            assert proc.poll() is None, _worker_died(proc)
                            assert time.monotonic() < deadline, f"{aid}: no result in {timeout} s"
                            await anyio.sleep(0.05)  # polling the queue with a deadline

        anyio.run(serve_phases, backend=backend)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            stderr = proc.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            stderr = proc.communicate()[1]
    assert proc.returncode == 0, _worker_died(proc, stderr)
    # Whatever a job left behind is gone once its result is in: killed with its sandbox.
    survivors = _processes_with(world.token)
    # The host-side checks, while the canary and the listeners are still there.
    evidence = {
        a.id: a.host_check(world, results[a.id])
        for a in attempts
        if a.host_check is not None and results.get(a.id) is not None
    }
    world.close()
    return Run(
        evidence=evidence,
        results=results,
        dead=dead,
        world=world,
        privileged=IS_ROOT,
        arm=sandbox,
        backend=backend,
        worker_log=log,
        worker_exit=proc.returncode,
        seconds=time.monotonic() - started,
        survivors=survivors,
    )


def _worker_died(proc: subprocess.Popen[bytes], stderr: bytes | None = None) -> str:
    if stderr is None and proc.poll() is not None and proc.stderr is not None:
        stderr = proc.stderr.read()
    return f"the worker exited ({proc.returncode}): {(stderr or b'').decode()[-3000:]}"


# --- judging one row --------------------------------------------------------------------


def outcome_of(run: Run, a: Attempt) -> tuple[bool, str]:
    """(got through?, what happened) for row `a`; fails on what no row may see."""
    result = run.results.get(a.id, "missing")
    assert result != "missing", f"{a.id}: not run"
    if a.id in run.dead:
        raise AssertionError(f"{a.id}: dead-lettered (a job's input became {run.dead[a.id]})")
    assert isinstance(result, Result)
    if result.containment is not None:
        assert result.containment.sandbox == ARM_REPORTED[run.arm], (
            f"{a.id}: a row of the {run.arm} arm ran on {result.containment.sandbox!r}"
        )
    evidence = run.evidence.get(a.id)
    said = result.output if isinstance(result.output, dict) else None
    if evidence is not None:
        return True, f"host evidence: {evidence}; output: {result.output!r:.500}"
    if result.status == "succeeded" and said is not None and "escaped" in said:
        return bool(said["escaped"]), json.dumps(said)[:1500]
    code = result.error.code if result.error is not None else None
    assert code != "E_HOST_FAULT", f"{a.id}: the job's doing became a host fault: {result.error}"
    assert code in a.stopped_by, (
        f"{a.id}: ended {result.status} with {code} ({result.error}), not one of the row's "
        f"walls {sorted(a.stopped_by)}; stderr: {result.stderr[-1500:]}"
    )
    return False, f"stopped: {code}"


def may_get_through(a: Attempt, privileged: bool) -> bool:
    return a.through == "always" or a.through == ("root" if privileged else "unprivileged")


def judge(run: Run, a: Attempt) -> None:
    """The row's assertions (see the module docstring)."""
    if a.needs_root and not run.privileged:
        import pytest

        pytest.skip("planting another user's file needs root (needs root)")
    through, what = outcome_of(run, a)
    result = run.results[a.id]
    assert result is not None
    if not through:
        return
    report = result.containment
    assert report is not None, f"{a.id} got through and its result has no report: {what}"
    verdict = getattr(report, a.axis)
    assert verdict.state != "kept", (
        f"{a.id} got through ({what}) while the report says {a.axis} kept: {verdict.reason}"
    )
    assert may_get_through(a, run.privileged), (
        f"{a.id} got through on a {'root' if run.privileged else 'unprivileged'} worker: "
        f"{what} ({a.axis}: {verdict.state}, {verdict.reason})"
    )
    assert a.reason.lower() in verdict.reason.lower(), (
        f"{a.id} got through, {a.axis} says {verdict.state} but not why: {verdict.reason!r} "
        f"lacks {a.reason!r}"
    )


@contextlib.contextmanager
def world_at(root: Path) -> Iterator[World]:
    w = World(root)
    w.home.mkdir(parents=True)
    try:
        yield w
    finally:
        w.close()
