"""A root worker's per-slot uid switch (`metnos_exec.identities`), and its setting.

Issue 15, item 2: a root worker started from a login or ``su``/``runuser`` session has
supplementary groups, and the switch back to root, which restores them, passed the group
list to an untyped variadic ``syscall()``: its address went in as a C ``int``, cut to 32
bits (``EFAULT``), and the worker died at its first job (exit 70). The switch is run
here in a child process (glibc's ``setgroups`` changes every thread of the caller) with
no, one and many groups and a primary gid that is not 0; the real worker process with
supplementary groups is in ``tests/test_worker_process.py``.

Item 3: a malformed ``METNOS_SLOT_UIDS`` started the worker anyway, every job as host
root; it now refuses to start (``E_CONFIG``), like a bad ``METNOS_REQUIRE_SANDBOX``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from metnos_exec.errors import BadConfig
from metnos_exec.identities import (
    DEFAULT_SLOT_UIDS,
    SLOT_UIDS_ENV,
    slot_uid_range,
    slot_uids_unavailable,
)

from .conftest import need_privileged

AS_ROOT = os.geteuid() == 0

#: Run in a child: take a slot identity, switch a thread to it and back, and report the
#: thread's ids before, inside and after (from /proc/thread-self, the kernel's view).
_SWITCH = textwrap.dedent(
    """
    import json, os, sys, threading
    from metnos_exec.identities import allocate, switched

    groups, gid = json.loads(sys.argv[1])
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)

    def ids():
        with open("/proc/thread-self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {k: [int(x) for x in fields[k].split()] for k in ("Uid", "Gid", "Groups")}

    identity = allocate()
    seen = {"slot": identity.uid}

    def run():
        try:
            seen["before"] = ids()
            with switched(identity):
                seen["inside"] = ids()
            seen["after"] = ids()
        except BaseException as exc:
            seen["error"] = repr(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    seen["main"] = ids()  # never switched: what the rest of the worker runs as
    identity.close()
    print(json.dumps(seen))
    """
)


def _switch_in_child(groups: list[int], gid: int) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _SWITCH, json.dumps([groups, gid])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    seen: dict[str, object] = json.loads(out.stdout)
    return seen


@pytest.mark.parametrize(
    ("groups", "gid"),
    [
        pytest.param([], 0, id="no groups (bare root)"),
        pytest.param([4], 0, id="one group"),
        pytest.param([4, 27, *range(3000, 3062)], 0, id="64 groups"),
        pytest.param([4, 24], 4, id="primary gid not 0 (runuser -G)"),
    ],
)
def test_a_slot_switch_comes_back_with_the_threads_own_groups_and_gid(
    groups: list[int], gid: int
) -> None:
    need_privileged(AS_ROOT, "slot uids are a root worker's")
    need_privileged(slot_uids_unavailable() is None, f"no slot uids: {slot_uids_unavailable()}")
    seen = _switch_in_child(groups, gid)
    assert "error" not in seen, seen
    slot = seen["slot"]
    kernel_groups = sorted(set(groups))
    before = {"Uid": [0, 0, 0, 0], "Gid": [gid] * 4, "Groups": kernel_groups}
    assert seen["before"] == before == seen["main"], seen
    # Inside: the slot's uid and gid (saved uid 0: the way back), no group of root's.
    assert seen["inside"] == {
        "Uid": [slot, slot, 0, slot],
        "Gid": [slot, slot, 0, slot],
        "Groups": [],
    }, seen
    # After: exactly what the thread had, not "root with no groups" nor gid 0.
    assert seen["after"] == before, seen


# --- METNOS_SLOT_UIDS --------------------------------------------------------------------

#: Values that are not a range of slot uids. Each would leave a root worker's jobs as host
#: root (or, for a range holding uid 0, give a slot root's own uid).
MALFORMED = [
    pytest.param("abc", id="not a number"),
    pytest.param("1879048192", id="no count"),
    pytest.param("1879048192:", id="empty count"),
    pytest.param(":65536", id="empty base"),
    pytest.param(":", id="only a colon"),
    pytest.param("1879048192:abc", id="count not a number"),
    pytest.param("-5:10", id="negative base"),
    pytest.param("1879048192:-1", id="negative count"),
    pytest.param("1879048192:0", id="zero count"),
    pytest.param("0:65536", id="holds uid 0"),
    pytest.param("999:10", id="below 1000 (system uids)"),
    pytest.param("4294967285:10", id="past the last uid"),
    pytest.param("4294967295:1", id="(uid_t)-1"),
    pytest.param("99999999999999999999:1", id="overflow"),
    pytest.param("1879048192:65536:1", id="three fields"),
    pytest.param("1_879_048_192:65536", id="underscores"),
    pytest.param("1879048192.5:65536", id="not whole"),
    pytest.param("0", id="0 (not an off spelling)"),
    pytest.param("no", id="no (not an off spelling)"),
    pytest.param("of", id="typo of off"),
]


@pytest.mark.parametrize("value", MALFORMED)
def test_a_malformed_slot_uid_range_is_refused(value: str) -> None:
    with pytest.raises(BadConfig, match=SLOT_UIDS_ENV) as err:
        slot_uid_range({SLOT_UIDS_ENV: value})
    assert err.value.code == "E_CONFIG"
    assert "off" in err.value.message  # says how to turn them off on purpose


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", DEFAULT_SLOT_UIDS),
        ("  ", DEFAULT_SLOT_UIDS),
        ("off", None),
        (" OFF ", None),
        ("1879048192:65536", (1879048192, 65536)),
        ("0x70000000:0x100", (0x70000000, 256)),
        (" 200000:1 ", (200000, 1)),
        ("1000:10", (1000, 10)),
        ("4294967284:10", (4294967284, 10)),
        ("01000:10", (1000, 10)),  # leading zeros: still decimal
    ],
)
def test_a_well_formed_slot_uid_setting_is_read(
    value: str, expected: tuple[int, int] | None
) -> None:
    assert slot_uid_range({SLOT_UIDS_ENV: value}) == expected
    assert slot_uid_range({}) == DEFAULT_SLOT_UIDS  # unset: the default


@pytest.mark.parametrize("value", MALFORMED[:4])
def test_the_worker_checks_the_slot_uid_setting_before_it_serves(value: str) -> None:
    from metnos_exec.worker import check_worker_config

    with pytest.raises(BadConfig, match=SLOT_UIDS_ENV):
        check_worker_config(environ={SLOT_UIDS_ENV: value})
    check_worker_config(environ={SLOT_UIDS_ENV: "off"})
    check_worker_config(environ={SLOT_UIDS_ENV: "5000:10"})


@pytest.mark.parametrize("value", [p.values[0] for p in MALFORMED[::3]])
def test_run_worker_refuses_a_malformed_slot_uid_range_before_serving(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from metnos_exec.worker import run_worker

    monkeypatch.setenv(SLOT_UIDS_ENV, value)
    queue = tmp_path / "q.db"
    with pytest.raises(BadConfig, match=SLOT_UIDS_ENV):
        run_worker(f"sqlite:///{queue}", tmp_path, burst=True, configure_logs=False)
    assert not queue.exists()  # refused before it opened the store


@pytest.mark.anyio
async def test_serve_refuses_a_malformed_slot_uid_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from metnos_exec.brokers import open_broker
    from metnos_exec.manifest import ExecutorRegistry
    from metnos_exec.worker import serve

    registry = ExecutorRegistry.load(tmp_path)
    monkeypatch.setenv(SLOT_UIDS_ENV, "abc")
    async with open_broker("memory://") as broker:
        with pytest.raises(BadConfig, match=SLOT_UIDS_ENV):
            await serve(broker, registry, burst=True, handle_signals=False, worker_id="w")
    monkeypatch.setenv(SLOT_UIDS_ENV, "off")
    async with open_broker("memory://") as broker:
        await serve(broker, registry, burst=True, handle_signals=False, worker_id="w")


# --- every libc call typed ---------------------------------------------------------------


def test_no_libc_call_in_the_package_goes_through_an_untyped_function() -> None:
    # The class of the defect: a ctypes function called without argument types passes
    # each Python int as a C int (a pointer so passed is cut to 32 bits). Every libc call
    # of the package is a typed prototype (`metnos_exec._libc`, or CFUNCTYPE in the
    # scripts run by path); none is an attribute call on a CDLL object.
    import re
    from pathlib import Path

    import metnos_exec

    root = Path(metnos_exec.__file__).parent
    untyped: list[str] = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        names = set(re.findall(r"(\w+)\s*=\s*ctypes\.CDLL\(", text))
        calls = [rf"\b{re.escape(n)}\.(?!argtypes|restype)\w+\s*\(" for n in names]
        calls.append(r"CDLL\([^)]*\)\.\w+\s*\(")  # ctypes.CDLL(None).fn(...)
        for pattern in calls:
            untyped += [
                f"{path.relative_to(root)}: {m.group(0)}" for m in re.finditer(pattern, text)
            ]
    assert untyped == []
    assert (root / "_libc.py").exists()
