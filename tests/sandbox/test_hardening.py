"""`hardening.annotate`: what the report says with and without each mechanism (no bwrap)."""

from __future__ import annotations

import os

from metnos_exec.sandbox._types import AxisVerdict, ContainmentReport, Mount, SandboxJob
from metnos_exec.sandbox.hardening import Hardening, annotate, seccomp_fd
from metnos_exec.sandbox.seccomp import compile_program

KEPT = AxisVerdict("kept", "walls")
BASE = ContainmentReport(
    sandbox="bwrap",
    files=KEPT,
    network=KEPT,
    process_tree=KEPT,
    user=KEPT,
    resources=KEPT,
)
ON = Hardening(
    seccomp_arch="x86_64",
    seccomp="filter",
    landlock_abi=7,
    landlock="landlock ABI 7",
    landlock_python="/usr/bin/python3",
)
OFF = Hardening(
    seccomp_arch=None, seccomp="no filter here", landlock_abi=None, landlock="no landlock here"
)
READ_ONLY = SandboxJob(argv=("/bin/true",), mounts=(Mount("/a", "/a"),))
WRITABLE = SandboxJob(argv=("/bin/true",), mounts=(Mount("/a", "/a", writable=True),))


def test_active_mechanisms_are_named_and_keep_every_axis() -> None:
    got = annotate(BASE, WRITABLE, ON)
    assert [v.state for v in (got.files, got.network, got.process_tree, got.user)] == ["kept"] * 4
    assert got.network.reason == "walls; Unix sockets refused (seccomp)"
    assert got.user.reason == "walls; kernel keyrings refused (seccomp)"
    assert got.files.reason == (
        "walls; setuid/setgid bits refused (seccomp); "
        "landlock ABI 7 enforces the same read and write roots"
    )
    assert got.resources == KEPT


def test_without_seccomp_the_axes_it_holds_say_partial_with_the_reason() -> None:
    got = annotate(BASE, WRITABLE, OFF)
    assert got.network.state == got.user.state == got.files.state == "partial"
    assert "Unix socket inside a mounted folder is reachable" in got.network.reason
    assert "no filter here" in got.network.reason
    assert "keyrings are shared" in got.user.reason
    assert "setuid/setgid file can be planted" in got.files.reason
    assert got.files.reason.endswith("no landlock here")
    # Without seccomp and landlock the guest can ptrace bubblewrap's init (tested for
    # real in test_bwrap_escapes.py): the tree is no longer `kept`.
    assert got.process_tree.state == "partial"
    assert "ptrace bubblewrap's init" in got.process_tree.reason
    # No writable folder: nothing to plant a setuid file in.
    assert annotate(BASE, READ_ONLY, OFF).files.state == "kept"


def test_a_wall_already_down_stays_down() -> None:
    granted = AxisVerdict("not_kept", "network capability granted")
    got = annotate(
        ContainmentReport(
            sandbox="bwrap",
            files=KEPT,
            network=granted,
            process_tree=KEPT,
            user=KEPT,
            resources=KEPT,
        ),
        READ_ONLY,
        OFF,
    )
    assert got.network.state == "not_kept"
    assert got.network.reason.startswith("network capability granted; ")


def test_the_seccomp_pipe_holds_exactly_the_program() -> None:
    fd = seccomp_fd(ON)
    assert fd is not None
    try:
        assert os.read(fd, 1 << 16) == compile_program("x86_64")
        assert os.read(fd, 1) == b""  # the write end is closed: bubblewrap sees EOF
    finally:
        os.close(fd)
    assert seccomp_fd(OFF) is None
