"""Runs a commit, an undo or a journal recovery in a child that dies at a chosen step.

Usage: ``python -m tests.helpers.crash_driver``; one JSON request per line on stdin, one
JSON answer per line on stdout. The driver is single-threaded and forks one child per
request (cheaper than a new interpreter for each of a hundred crash points); the child
sets its crash point (`metnos_exec.journal.crash_at`), does the work as a worker would
and exits with ``os._exit``: at the crash point, before the step (a kill: no clean-up, no
``finally``, its journal's lock released by the kernel), or after the work, leaving the
journal in place as a worker killed before its result was stored.

Requests (``at``: the crash point, ``null`` for none):

- ``{"do": "commit", "at": N, "state": DIR, "record": JournalRecord}``: fingerprint the
  paths, begin the journal, apply the record's ops with content from the blob store;
- ``{"do": "undo", "at": N, "state": DIR, "entries": [UndoEntry], "undo_job_id": ID,
  "device": NAME, "redo_out": FILE}``: `apply_undo`, as the worker's undo job does (the
  redo entry it made written to FILE, when given);
- ``{"do": "recover", "at": N, "state": DIR}``: `Staging.recover` with an empty broker
  (no result stored: every journal is rolled back).

Answers: ``{"status": "crashed", "step": "mkdir"}``, ``{"status": "done"}`` or
``{"status": "failed", "error": "..."}``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import msgspec


def _commit(req: dict[str, Any]) -> None:
    from metnos_exec.blobs import BlobStore
    from metnos_exec.journal import (
        BlobSource,
        Blocked,
        Fingerprint,
        HostTree,
        Journal,
        JournalRecord,
        apply_ops,
    )
    from metnos_exec.messages import Move

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
    from metnos_exec.blobs import BlobStore
    from metnos_exec.journal import Journal
    from metnos_exec.messages import UndoEntry
    from metnos_exec.undo import apply_undo

    state = Path(req["state"])
    applied = apply_undo(
        msgspec.convert(req["entries"], list[UndoEntry]),
        undo_job_id=req["undo_job_id"],
        device=req["device"],
        store=BlobStore(state / "blobs"),
        journal=Journal(state / "journal"),
    )
    if req.get("redo_out"):
        Path(req["redo_out"]).write_bytes(msgspec.json.encode(applied.redo))


def _recover(req: dict[str, Any]) -> None:
    import anyio

    from metnos_exec.brokers.memory import MemoryBroker
    from metnos_exec.staging import Staging

    staging = Staging(req["state"], overlay=False)
    anyio.run(staging.recover, MemoryBroker())


_WORK = {"commit": _commit, "undo": _undo, "recover": _recover}


def _child(req: dict[str, Any]) -> None:
    from metnos_exec import journal

    journal.crash_at(None if req["at"] is None else str(req["at"]))
    try:
        _WORK[req["do"]](req)
    except BaseException:
        os.write(2, traceback.format_exc().encode())
        os._exit(1)
    os._exit(0)


def _run(req: dict[str, Any]) -> dict[str, Any]:
    from metnos_exec.journal import CRASH_EXIT

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
    # Imported before the first fork: each child starts warm.
    import metnos_exec.staging
    import metnos_exec.undo  # noqa: F401

    for line in sys.stdin.buffer:
        req = msgspec.json.decode(line)
        if req["do"] == "quit":
            return
        sys.stdout.buffer.write(msgspec.json.encode(_run(req)) + b"\n")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
