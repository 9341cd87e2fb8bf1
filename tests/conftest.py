"""Shared fixtures: both anyio backends, and the leak checks every test gets.

The pytest process makes itself a *child subreaper* (PR_SET_CHILD_SUBREAPER): any process a
test starts — even one that double-forks and calls setsid — is re-parented to us when its
parent dies instead of to init. That lets `_no_leaks` see every orphan a test leaves behind
and fail the test, rather than trusting that "we killed the process group".

Tests run side by side in pytest-xdist worker processes (`./dev test`: ``-n auto --dist
loadgroup``). Each worker is its own pytest process, so what this file makes per process
is per worker: the subreaper and the orphan check (a worker sees its own tests' children,
never another worker's), the state folder, the session fixtures (a private redis-server
each, on a free port), ``tmp_path`` (xdist gives each worker its own base). Two kinds of
test go to one worker, in turn, by an ``xdist_group`` mark (`pytest_itemcollected`
below adds it; a test may also carry one of its own):

- those that use a module-, package- or session-scoped fixture of their own module (an
  adversarial table's one run of every attempt, the wasm suite's warmed cache, the
  browser's stack): spread over workers, each worker would build it again;
- those on the session's Redis Cluster (`redis_cluster`, three redis-servers): one cluster,
  not one per worker.

A group only keeps its own tests apart. A test that must run beside no other test at all
(timing-sensitive: a sub-second budget that a busy CPU eats) is marked ``alone``:
`./dev test` leaves it out of the parallel part (``--alone=exclude``) and runs it after,
in one process (``--alone=only``); plain ``pytest`` runs everything (``include``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator

import pytest

from metnos_exec import identities
from metnos_exec.sandbox.egress import bridge

PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)
if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:  # pragma: no cover
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")

#: pids of long-lived helpers started on purpose by session fixtures (redis-server, ...).
ALLOWED_CHILDREN: set[int] = set()

#: Set to the state folder this file made, so that a pytest process started by another one
#: (an xdist worker, whose environment is its controller's) makes its own.
_OWN_STATE_ENV = "METNOS_TEST_STATE_DIR"

# Blobs, commit journals and staging mount points of the workers tests start (in this
# process or as subprocesses, which inherit it) go to a private folder, never to the
# home of whoever runs the suite. A test that needs its own passes a state dir explicitly.
# One per pytest process: xdist workers run tests side by side, each in its own folder.
if os.environ.get("METNOS_STATE_DIR", "") in ("", os.environ.get(_OWN_STATE_ENV)):
    _state = tempfile.mkdtemp(prefix="metnos-test-state-")
    os.environ["METNOS_STATE_DIR"] = os.environ[_OWN_STATE_ENV] = _state
    atexit.register(shutil.rmtree, _state, True)


def child_pids() -> set[int]:
    """Live (non-zombie) children of this process, reaping zombies on the way."""
    me = os.getpid()
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parens; fields resume after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        state, ppid = fields[0], int(fields[1])
        if ppid != me:
            continue
        if state == b"Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry), os.WNOHANG)
            continue
        found.add(int(entry))
    # The network wall's bridge helper lives for the process's life (sandbox.egress).
    return found - ALLOWED_CHILDREN - bridge.helper_pids()


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


#: Fixtures of this file whose users share one xdist worker (see the module's docstring).
_GROUPED_FIXTURES = {"redis_cluster": "redis-cluster"}
_WIDE_SCOPES = ("module", "package", "session")


def _xdist_group(item: pytest.Item) -> str | None:
    """The xdist group `item` belongs to, from the broad-scoped fixtures it uses."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    module = item.nodeid.partition(":" * 2)[0]  # the file part of the node id
    for name in info.names_closure:
        if name in _GROUPED_FIXTURES:
            return _GROUPED_FIXTURES[name]
        for fixturedef in info.name2fixturedefs.get(name, ()):
            # baseid: where the fixture is visible from; a test module's own is that module.
            if fixturedef.scope in _WIDE_SCOPES and fixturedef.baseid == module:
                return module
    return None


def pytest_itemcollected(item: pytest.Item) -> None:
    # At collection, before xdist reads the marks (--dist loadgroup: its
    # pytest_collection_modifyitems).
    if item.get_closest_marker("xdist_group") is None:
        group = _xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--alone",
        choices=("include", "exclude", "only"),
        default="include",
        help="tests marked `alone` (timing-sensitive): run them with the others (include, "
        "the default), leave them out (exclude: `./dev test`'s parallel part), or run "
        "only them (only: its second part, in one process)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--alone`: keep or leave out the tests marked `alone`. Then, in an xdist worker
    under ``--dist loadgroup``: the group as the node id's ``@NAME`` suffix, which is what
    the scheduler reads. pytest-xdist 3.8 writes it to ``item._nodeid``, which pytest 9 no
    longer reads (its node id is ``item._id``): without this, every group would be spread
    over the workers like any test."""
    mode = config.getoption("alone")
    if mode != "include":
        only = mode == "only"
        keep = [i for i in items if (i.get_closest_marker("alone") is not None) == only]
        if len(keep) != len(items):
            kept = {id(i) for i in keep}
            config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
            items[:] = keep
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):
            if hasattr(item, "_id"):  # pytest >= 9
                from _pytest.nodeid import NodeId

                item._id = NodeId.parse(item.nodeid + suffix)
            else:
                item._nodeid = item.nodeid + suffix


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    fds_before = open_fds()
    yield
    deadline = time.monotonic() + 5.0
    left = child_pids()
    while left and time.monotonic() < deadline:
        time.sleep(0.02)  # polling with a deadline: processes take a moment to be reaped
        left = child_pids()
    if left:
        cmdlines = {}
        for pid in left:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdlines[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmdlines[pid] = "?"
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"test left child processes behind: {cmdlines}")
    # A root worker's job slots hold their uid's lock and user namespace for the process's
    # life (metnos_exec.identities), taken by whichever test first used the slot.
    leaked = open_fds() - fds_before - identities.held_fds() - bridge.held_fds()
    # An fd can be transiently open (e.g. the /proc listing above); check twice.
    if leaked:
        leaked = {fd for fd in leaked if fd in open_fds()}
    if leaked and not request.node.get_closest_marker("allow_fd_leak"):
        targets = {}
        for fd in leaked:
            try:
                targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                targets[fd] = "?"
        pytest.fail(f"test leaked file descriptors: {targets}")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on both backends."""
    return str(request.param)


def need(available: bool, reason: str) -> None:
    """Skip the calling test when a system component is missing, with the reason.

    In CI (`METNOS_REQUIRE_ALL=1`, set by `.ci/run`) nothing may skip for a missing
    component: the skip becomes a failure.
    """
    if available:
        return
    if os.environ.get("METNOS_REQUIRE_ALL") == "1":
        pytest.fail(f"required component missing in CI: {reason}")
    pytest.skip(reason)


def need_privileged(available: bool, reason: str) -> None:
    """Skip the calling test when what it needs is root's (cgroups it may create, a root
    worker's slot uids, a root-owned file to plant), with the reason.

    Run as an unprivileged user that is the expected answer, even in CI (`.ci/run` runs
    those tests as root too); run as root, a missing piece is a missing component, and
    `need` makes it a failure under ``METNOS_REQUIRE_ALL=1``.
    """
    if available:
        return
    if os.geteuid() != 0:
        pytest.skip(f"{reason} (needs root)")
    need(False, reason)


@contextlib.contextmanager
def free_descriptors(count: int) -> Iterator[None]:
    """This process may open `count` more descriptors inside the block: its soft
    RLIMIT_NOFILE raised (a login session's is 1024), up to the hard limit (as root, the
    hard limit too), and put back after. Skips with the reason when the hard limit is too
    low and cannot be raised (an unprivileged user: ``ulimit -Hn``).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(open_fds()) + count
    if soft >= want:
        yield
        return
    if hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        except (ValueError, OSError):
            need_privileged(
                False, f"{count} free descriptors past a hard open-file limit of {hard}"
            )
    else:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def need_import(module: str, extra: str) -> None:
    """`need` for an optional dependency: `module`, from the `extra` of metnos-exec."""
    try:
        importlib.import_module(module)
    except ImportError:
        need(False, f"{module} is not installed (pip install 'metnos-exec[{extra}]')")


@pytest.fixture(params=["bwrap", "direct"])
def native_arm(request: pytest.FixtureRequest) -> object:
    """The bubblewrap arm (where it works: else skipped, a failure in CI) and the direct
    arm, for tests that must hold on both native arms."""
    from metnos_exec.sandbox.bwrap import BwrapSandbox, bwrap_probe
    from metnos_exec.sandbox.direct import DirectSandbox

    if request.param == "direct":
        return DirectSandbox()
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    return BwrapSandbox()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A private redis-server on a free loopback port for the whole session (never the
    shared one on 6379). Tests keep apart by key prefix, not by flushing."""
    from tests.helpers.redis_server import RedisServer, redis_server_path

    need(
        redis_server_path() is not None, "redis-server is not installed (apt install redis-server)"
    )
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    assert server.proc is not None
    ALLOWED_CHILDREN.add(server.proc.pid)
    try:
        yield server
    finally:
        ALLOWED_CHILDREN.discard(server.proc.pid)
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A private Redis Cluster (three primaries, no replicas) on loopback ports for the
    whole session (`tests.helpers.redis_cluster`). Tests keep apart by key prefix."""
    from tests.helpers.redis_cluster import LocalCluster, redis_cli_path
    from tests.helpers.redis_server import redis_server_path

    need(
        redis_server_path() is not None and redis_cli_path() is not None,
        "redis-server and redis-cli are not installed (apt install redis-server)",
    )
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        ALLOWED_CHILDREN.update(cluster.pids)
        yield cluster
    finally:
        ALLOWED_CHILDREN.difference_update(cluster.pids)
        cluster.stop()
