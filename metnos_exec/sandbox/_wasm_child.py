"""The wasm arm's guest process: one job's module load (or compile) and run, killable.

Private to the wasm arm, which starts one per job (`run_process`: from the long-lived
spawner thread, with a parent-death signal, its own session and rlimits) as
``python -I <this file>``. Guests used to run on a thread of the worker: one blocked in a
host call (a FIFO open) could only be abandoned, and resumed when the call returned,
writing into its preopens after its job's result was stored (issue 15, item 1); a
pathological module compiled for a minute on the worker's CPU (item 10). In a process of
its own, both end with the process: nothing of a job runs after its result.

The script imports the standard library and wasmtime only, never the `metnos_exec`
package (~200 ms of imports per job): `_wasm_guest` (the module's load and the guest's
run, and what the arm and `_wasm_engine` share with this process: engine flags, the WASI
p1 function list, the complexity bound, the cache key and file checks) and `_wasm_poll`
are loaded from this folder. This file owns the job's protocol: the request, the result
pipe, the phases and the watchdog, and a spare's wait for its job.

Protocol. stdin: one JSON line (the request), then the guest's stdin bytes. The guest's
stdout and stderr are this process's own (the arm drains and caps them). On the fd named
``result_fd`` the process writes ``L\\n`` once the module is loaded and linked, then one
JSON line, its verdict (``exit`` and usage, ``denied`` or ``fault``); each line is a single
``write`` under ``PIPE_BUF``, so a line is whole or absent. A watchdog thread ends the
process at the wall deadline plus `WATCHDOG_SLACK_S` with a ``timeout`` verdict naming the
phase (``load`` or ``run``): a compile or a host call has no epoch check to stop it. A
guest within its fuel is stopped by the epoch deadline callback before that.

A spare (``python -I -S <this file> <wasmtime folder> --spare <json>``, the JSON naming
its socket, its result fd, and the cache key and folder of the module to load ahead)
reads its job from the socket instead: one byte carrying the preopen descriptors, then
the request line (``mounts`` instead of fds, ``nofile``) and the guest's stdin, to end
of stream. See `_spare`.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Final

#: Seconds past the wall deadline after which the watchdog ends the process: the epoch
#: callback stops a guest in wasm code within a tick, so only a compile or a guest
#: blocked in a host call is still there.
WATCHDOG_SLACK_S: Final = 0.25


class _Verdict:
    """The one verdict line: the first to `give` it (the guest's end or the watchdog)
    writes it; the process exits right after."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self.given = False

    def line(self, text: bytes) -> None:
        with self.lock:
            if not self.given:
                os.write(self.fd, text)

    def give(self, verdict: dict[str, Any]) -> None:
        # One write under PIPE_BUF: messages (which may quote a module's import names)
        # are cut so that the line stays whole JSON.
        for k in ("denied", "fault"):
            if k in verdict:
                verdict[k] = str(verdict[k])[:2000]
        data = (json.dumps(verdict) + "\n").encode()
        with self.lock:
            if self.given:
                return
            self.given = True
            os.write(self.fd, data)


def _watchdog(verdict: _Verdict, deadline: float, phase: list[str]) -> None:
    left = deadline + WATCHDOG_SLACK_S - time.monotonic()
    if left > 0:
        time.sleep(left)
    verdict.give({"exit": {"type": "timeout"}, "stopped_in": phase[0]})
    os._exit(0)


def _run(
    wt: ModuleType,
    req: dict[str, Any],
    stdin: bytes,
    verdict: _Verdict,
    ahead: Any = None,
) -> dict[str, Any]:
    """The job in its two phases, under the watchdog: ``load`` (the module, from `ahead`
    when a spare loaded it, else from the disk cache or compiled, and linked), then
    ``L`` on the result pipe and ``run`` (`_wasm_guest.run_guest`)."""
    import _wasm_guest as guest  # type: ignore[import-not-found]

    phase = ["load"]
    deadline = float(req["deadline"])
    threading.Thread(target=_watchdog, args=(verdict, deadline, phase), daemon=True).start()
    if ahead is None:
        engine, linker = guest.prepare(wt)
    else:
        engine, linker = ahead.engine, ahead.linker
    t_load = time.monotonic()
    if ahead is not None and ahead.key is not None and ahead.key == req["key"]:
        module, pre, how = ahead.module, ahead.pre, "disk"
    else:
        module, how = guest.load(wt, engine, req)
        pre = guest.link(wt, linker, module, Path(req["source"]).name)
    loaded = {"how": how, "load_s": round(time.monotonic() - t_load, 6)}
    if req.get("compile_only"):
        return {"loaded": loaded}
    verdict.line(b"L\n")
    phase[0] = "run"
    out: dict[str, Any] = guest.run_guest(wt, engine, module, pre, req, stdin, deadline, loaded)
    return out


def main() -> None:
    """Read the request, load, run, give the verdict, exit without tearing down.

    Started as ``python -I -S <this file> <folder of the wasmtime package>``: without
    ``site`` the interpreter starts in half the CPU time (~12 ms against ~25 ms here), so
    wasmtime's folder is put on the path by hand."""
    spare = len(sys.argv) > 3 and sys.argv[2] == "--spare"
    if spare:
        # Before this folder goes on the path: the arm's `select` module is in it, and
        # `socket` imports the standard library's.
        import socket  # noqa: F401
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if len(sys.argv) > 1:
        sys.path.append(sys.argv[1])
    if spare:
        _spare(json.loads(sys.argv[3]))
        return
    from _wasm_guest import Refused

    raw = sys.stdin.buffer.read()
    head, _, stdin = raw.partition(b"\n")
    req = json.loads(head)
    verdict = _Verdict(int(req["result_fd"]))
    try:
        import wasmtime as wt

        out = _run(wt, req, stdin, verdict)
    except Refused as exc:
        out = {"denied": str(exc)}
    except OSError as exc:
        out = {"fault": str(exc)}
    except Exception as exc:  # the harness broke: said to the arm as a host fault
        out = {"fault": f"{type(exc).__name__}: {exc}"}
    verdict.give(out)
    # Exit at once: the guest's stdio is written, and tearing wasmtime down (or waiting
    # for its I/O threads) is work for no one.
    os._exit(0)


def _receive(sock_fd: int) -> tuple[dict[str, Any], bytes, list[int]]:
    """A spare's job: one byte carrying the preopen folders' descriptors (SCM_RIGHTS),
    then the request line and the guest's stdin, to end of stream."""
    import socket

    sock = socket.socket(fileno=sock_fd)
    _msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 4096)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    sock.close()
    head, _, stdin = b"".join(chunks).partition(b"\n")
    return json.loads(head), stdin, fds


def _spare(start: dict[str, Any]) -> None:
    """A spare: make ready what no job can observe, wait for one job, serve it, exit.

    Started by the arm's spare pool (`run_process`, like a job's process) before any job
    exists. Once the job arrives: its RLIMIT_NOFILE is set (this process lowers its own
    limit: the job's bound, as a fresh process has it from its start), its preopens are
    the descriptors received, and from here it is `_run` as for a fresh process, the wall
    deadline and the watchdog included. Never reused: it exits after its verdict."""
    from _wasm_guest import Ahead, Refused

    verdict = _Verdict(int(start["result_fd"]))
    try:
        import wasmtime as wt

        ahead = Ahead(wt, start.get("key"), start.get("cache_dir"))
        req, stdin, fds = _receive(int(start["sock_fd"]))
        mounts = req.pop("mounts")
        if len(fds) != len(mounts):
            raise OSError(f"spare: {len(fds)} preopen descriptors for {len(mounts)} mounts")
        req["preopens"] = [
            [fd, guest, writable] for fd, (guest, writable) in zip(fds, mounts, strict=True)
        ]
        nofile = req.get("nofile")
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (int(nofile), int(nofile)))
        out = _run(wt, req, stdin, verdict, ahead)
    except Refused as exc:
        out = {"denied": str(exc)}
    except OSError as exc:
        out = {"fault": str(exc)}
    except Exception as exc:
        out = {"fault": f"{type(exc).__name__}: {exc}"}
    verdict.give(out)
    os._exit(0)


if __name__ == "__main__":
    main()
