"""Runs a commit, an undo or a journal recovery in a child that dies at a chosen step.

Usage: ``python -m tests.helpers.crash_driver``; one JSON request per line on stdin, one
JSON answer per line on stdout. The driver is single-threaded and forks one child per
request (cheaper than a new interpreter for each of a hundred crash points); the child
sets its crash point (`metnos_exec.undo.journal.crash_at`), does the work as a worker would
and exits with ``os._exit``: at the crash point, before the step (a kill: no clean-up, no
``finally``, its journal's lock released by the kernel), or after the work, leaving the
journal in place as a worker killed before its result was stored.

Requests (``at``: the crash point, ``null`` for none):

- ``{"do": "commit", "at": N, "state": DIR, "record": JournalRecord}``: fingerprint the
  paths, begin the journal, apply the record's ops with content from the blob store;
- ``{"do": "undo", "at": N, "state": DIR, "entries": [UndoEntry], "undo_job_id": ID,
  "device": NAME, "redo_out": FILE}``: `apply_undo`, as the worker's undo job does (the
  redo entry it made written to FILE, when given);
- ``{"do": "restore", "at": N, "state": DIR, "entries": [UndoEntry], "name": NAME,
  "restore_job_id": ID, "device": NAME, "redo_out": FILE}``: `apply_restore`, as the
  worker's checkpoint restore does;
- ``{"do": "recover", "at": N, "state": DIR, "jobs": [Job]}``: `Staging.recover` with a
  broker of the jobs' queue that knows `jobs` but stores no result (every journal is
  rolled back; a journal naming no queue is settled only by a queue that knows its job).

Answers: ``{"status": "crashed", "step": "mkdir"}``, ``{"status": "done"}`` or
``{"status": "failed", "error": "..."}``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

_REPO = Path(__file__).resolve().parent.parent.parent


def _commit(req: dict[str, Any]) -> None:
    from metnos_exec.messages import Move
    from metnos_exec.undo.blobs import BlobStore
    from metnos_exec.undo.journal import (
        BlobSource,
        Blocked,
        Fingerprint,
        HostTree,
        Journal,
        JournalRecord,
        apply_ops,
    )

    state = Path(req["state"])
    record = msgspec.convert(req["record"], JournalRecord)
    store = BlobStore(state / "blobs")
    tree = HostTree(record.roots)
    # As the planner fingerprints them: every path an op touches, absent ones as None
    # (a path below one that is not a folder yet is absent too).
    expect: dict[str, Fingerprint | None] = {}
    for op in record.ops:
        for path in (op.src, op.dst) if isinstance(op, Move) else (op.path,):
            if path in expect:
                continue
            try:
                st = tree.lstat(path)
            except Blocked:
                st = None
            expect[path] = None if st is None else Fingerprint.of(st)
    handle = Journal(state / "journal").begin(record)
    apply_ops(
        tree, record.ops, source=BlobSource(store), store=store, expect=expect, tag=handle.record.id
    )


def _undo(req: dict[str, Any]) -> None:
    from metnos_exec.messages import UndoEntry
    from metnos_exec.undo.apply import apply_undo
    from metnos_exec.undo.blobs import BlobStore
    from metnos_exec.undo.journal import Journal

    state = Path(req["state"])
    entries = msgspec.convert(req["entries"], list[UndoEntry])
    applied = apply_undo(
        entries,
        job_id=entries[0].job_id,
        undo_job_id=req["undo_job_id"],
        device=req["device"],
        store=BlobStore(state / "blobs"),
        journal=Journal(state / "journal"),
    )
    if req.get("redo_out"):
        Path(req["redo_out"]).write_bytes(msgspec.json.encode(applied.redo))


def _restore(req: dict[str, Any]) -> None:
    from metnos_exec.messages import UndoEntry
    from metnos_exec.undo.blobs import BlobStore
    from metnos_exec.undo.journal import Journal
    from metnos_exec.undo.restore import apply_restore

    state = Path(req["state"])
    applied = apply_restore(
        msgspec.convert(req["entries"], list[UndoEntry]),
        name=req["name"],
        restore_job_id=req["restore_job_id"],
        device=req["device"],
        store=BlobStore(state / "blobs"),
        journal=Journal(state / "journal"),
    )
    assert applied is not None
    if req.get("redo_out"):
        Path(req["redo_out"]).write_bytes(msgspec.json.encode(applied.redo))


def _recover(req: dict[str, Any]) -> None:
    import anyio

    from metnos_exec.brokers.memory import MemoryBroker
    from metnos_exec.messages import Job
    from metnos_exec.undo.staging import Staging

    async def main() -> None:
        broker = MemoryBroker()
        for job in msgspec.convert(req.get("jobs", []), list[Job]):
            await broker.submit(job)
        await staging.recover(broker)

    staging = Staging(req["state"], overlay=False)
    anyio.run(main)


_WORK = {"commit": _commit, "undo": _undo, "restore": _restore, "recover": _recover}


def _child(req: dict[str, Any]) -> None:
    from metnos_exec.undo import journal

    journal.crash_at(None if req["at"] is None else str(req["at"]))
    try:
        _WORK[req["do"]](req)
    except BaseException:
        os.write(2, traceback.format_exc().encode())
        os._exit(1)
    os._exit(0)


def _run(req: dict[str, Any]) -> dict[str, Any]:
    from metnos_exec.undo.journal import CRASH_EXIT

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        os.dup2(w, 2)
        # Its log records (stdout) are not answers.
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        _child(req)
    os.close(w)
    said = b""
    while chunk := os.read(r, 65536):
        said += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    text = said.decode(errors="replace")
    if code == CRASH_EXIT:
        said_last = text.rsplit("metnos-test-crash:", 1)[-1]
        return {"status": "crashed", "step": said_last.rsplit("(", 1)[-1].split(")", 1)[0]}
    if code == 0:
        return {"status": "done"}
    return {"status": "failed", "error": f"exit {code}: {text}"}


def main() -> None:
    # Imported before the first fork: each child starts warm (an event loop's modules too;
    # no thread is started here: the children are forked from a single-threaded process).
    import metnos_exec.undo.apply
    import metnos_exec.undo.restore
    import metnos_exec.undo.staging  # noqa: F401

    anyio.run(anyio.sleep, 0)

    for line in sys.stdin.buffer:
        req = msgspec.json.decode(line)
        if req["do"] == "quit":
            return
        sys.stdout.buffer.write(msgspec.json.encode(_run(req)) + b"\n")
        sys.stdout.buffer.flush()


# --- the test's side ---------------------------------------------------------------------


class Driver:
    """The driver process, one request at a time (see the module docstring)."""

    def __init__(self, proc: anyio.abc.Process) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self.stdin = proc.stdin
        self.stdout = BufferedByteReceiveStream(proc.stdout)

    async def __call__(self, do: str, at: int | None, **kw: Any) -> dict[str, Any]:
        """One request; its answer (a child that failed fails the test, with its error)."""
        await self.stdin.send(msgspec.json.encode({"do": do, "at": at, **kw}) + b"\n")
        with anyio.fail_after(60):
            line = await self.stdout.receive_until(b"\n", 1 << 20)
        answer: dict[str, Any] = msgspec.json.decode(line)
        assert answer["status"] != "failed", answer["error"]
        return answer

    async def crash_everywhere(self, do: str, **kw: Any) -> AsyncIterator[tuple[int, str]]:
        """Run `do` with a crash at step 0, 1, 2... until it completes; yields
        ``(N, step)`` after each crash (the caller checks and recovers), and returns
        once a run completed (its work done, its journal left)."""
        n = 0
        while True:
            answer = await self(do, n, **kw)
            if answer["status"] == "done":
                return
            yield n, answer["step"]
            n += 1
            assert n < 2000, "the work never completes"


@contextlib.asynccontextmanager
async def crash_driver() -> AsyncIterator[Driver]:
    """A driver process for the length of the block."""
    async with await anyio.open_process(
        [sys.executable, "-m", "tests.helpers.crash_driver"], cwd=_REPO, stderr=None
    ) as proc:
        try:
            yield Driver(proc)
        finally:
            await proc.stdin.send(b'{"do": "quit"}\n')  # type: ignore[union-attr]
            with anyio.fail_after(10):
                await proc.wait()


if __name__ == "__main__":
    main()
