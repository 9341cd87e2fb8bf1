"""No test, benchmark or example aims at an address outside loopback (issue 15 #17).

The suite runs on machines whose traffic is watched: a row that connects to a public DNS
server "to show the sandbox blocks it" sends real packets the moment an arm falls back,
and a private-range address is somebody's host. Every IPv4 and IPv6 literal in
``tests/``, ``bench/`` and ``examples/`` must be loopback (``127.0.0.0/8``, ``::1``); the
unspecified address (all zeros, IPv4 or IPv6) only where a socket is bound, never as a target;
anything else only as an entry of `EXCEPTIONS`, with the reason.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("tests", "bench", "examples")

#: ``(path relative to the repository, address): why it is no target``. Empty: keep it so.
EXCEPTIONS: dict[tuple[str, str], str] = {}
#: Files whose non-loopback literals are data, never a target, and why that holds (each
#: reason is checked by `test_data_only_files_cannot_send`).
DATA_ONLY: dict[str, str] = {
    "tests/sandbox/egress/test_policy.py": "classification data for the pure decision "
    "function (`policy.authorize`, with a resolver the test controls): the file makes "
    "no socket",
    "tests/tools/test_mcp_spec.py": "hosts fed to the MCP server's pure bind rule "
    "(`needs_token`, `check_http_bind`): nothing is bound or connected",
    "tests/sandbox/egress/test_wall_bwrap.py": "answers of the test's own resolver that "
    "the wall must refuse before any connect: tests/sandbox/egress/conftest.py refuses, "
    "and fails the test on, any upstream connection to an address outside loopback",
}

# A dotted quad that is not part of a longer dotted or word token (1.2.3.4.5, v1.2.3.4).
_V4 = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?![\w.]*\d)")
# An IPv6 literal where code or a URL names a host: quoted (like "::1") or in brackets
# after a scheme or an @ (http://[...]:80). Python slices (x[::2]) and clock times
# (10:18:54) are neither.
_V6 = re.compile(r"""(?:(?<=["'])|(?<=//\[)|(?<=@\[))([0-9A-Fa-f:]*:[0-9A-Fa-f:.]*)(?=["'\]%])""")
#: Words on a line that binds or listens: the unspecified address is allowed there.
_BINDS = re.compile(r"bind|listen|INADDR_ANY|in6addr_any", re.IGNORECASE)


def offending(text: str) -> list[tuple[int, str]]:
    """``(line number, address)`` for each literal that is neither loopback nor a bind."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        if "version" in line.lower():
            continue  # version strings (1.2.3.4) are no addresses
        for m in [*_V4.finditer(line), *_V6.finditer(line)]:
            raw = m.group(1)
            try:
                addr = ipaddress.ip_address(raw)
            except ValueError:
                continue  # not an address at all (a time, an octet out of range)
            if addr.is_loopback:
                continue
            if addr.is_unspecified and _BINDS.search(line):
                continue
            found.append((n, raw))
    return found


def _files() -> list[Path]:
    out = []
    for folder in FOLDERS:
        for p in sorted((ROOT / folder).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".wasm"):
                out.append(p)
    return out


def test_no_address_outside_loopback() -> None:
    files = _files()
    assert len(files) > 50, files  # the scan sees the tree (not an empty glob)
    bad = []
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary data: no source names an address there
        rel = str(p.relative_to(ROOT))
        for n, addr in offending(text):
            if (rel, addr) not in EXCEPTIONS and rel not in DATA_ONLY:
                bad.append(f"{rel}:{n}: {addr}")
    assert not bad, "addresses outside loopback (use 127.0.0.x or ::1):\n" + "\n".join(bad)


def test_data_only_files_cannot_send() -> None:
    policy = (ROOT / "tests/sandbox/egress/test_policy.py").read_text()
    assert "import socket" not in policy and ".connect(" not in policy
    guard = (ROOT / "tests/sandbox/egress/conftest.py").read_text()
    assert "autouse=True" in guard and 'setattr(JobTraffic, "connect"' in guard
    assert set(DATA_ONLY) <= {str(p.relative_to(ROOT)) for p in _files()}


# The detector's own cases. The addresses are built, not written, so that this file
# passes its own scan without an exception.
_PUBLIC = ".".join(["8"] * 4)
_PRIVATE = ".".join(("10", "0", "0", "7"))
_V6_DOC = "2001:db8" + "::1"
_ANY4, _ANY6 = ".".join("0" * 4), ":" * 2


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        (f's.connect(("{_PUBLIC}", 53))', [_PUBLIC]),
        (f"u.sendto(b'x', ('{_PRIVATE}', 9))", [_PRIVATE]),
        (f's.connect(("{_V6_DOC}", 80))', [_V6_DOC]),
        (f"curl http://[{_V6_DOC}]:80/", [_V6_DOC]),
        (f's.connect(("{_ANY4}", 80))', [_ANY4]),
        (f's.connect(("{_ANY6}", 80))', [_ANY6]),
        ('s.bind(("0.0.0.0", 0))', []),
        ('s.bind(("::", 0))', []),
        ('s.connect(("127.0.0.2", 80)); t.connect(("::1", 80))', []),
        ("x = y[::2]; t = '10:18:54'", []),
        ("| 10:18:54 | asyncio | 1.0 |", []),
        (f"pinned version {_PUBLIC}", []),
        (f"v{_PUBLIC} 1.2.3.4.5", []),
    ],
)
def test_the_detector(line: str, flagged: list[str]) -> None:
    assert [addr for _, addr in offending(line)] == flagged
