"""What an operator looks at and tidies: ``status`` (the queue's counts, the workers and
what they serve, the sandbox arms of this machine, recent dead letters), ``tail`` (a
worker's JSON log, readably) and ``purge`` (finished jobs past retention forgotten, their
space given back)."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
import time
from typing import Any

import msgspec

from .._terminal import visible
from ..brokers import DEFAULT_RETENTION_S, Broker, redact_url
from ..brokers.presence import JOB_STATES, JobListing, WorkerInfo, is_live, unserved
from ..errors import BadConfig, MetnosError
from ..messages import Progress, describe_progress
from ._common import EXIT, Subparsers, _dump_json, _Exit, _open, _retention, _run, add_command


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _sandbox_status() -> dict[str, Any]:
    try:
        from ..sandbox import status as status_mod
    except ImportError as exc:
        return {"error": f"sandbox status unavailable: {exc}"}
    try:
        report = status_mod.status()
    except MetnosError as exc:  # e.g. METNOS_BWRAP naming no executable
        return {"error": str(exc)}
    built = msgspec.to_builtins(report)
    return built if isinstance(built, dict) else {"status": built}


def _scalar(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(_scalar(v) for v in value) if value else "-"
    return str(value)


def _readable(doc: dict[str, Any], *, indent: str) -> list[str]:
    """Nested dicts as indented ``key: value`` lines (``status`` for people)."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, dict):
            if not value:
                lines.append(f"{indent}{key}: -")
                continue
            lines.append(f"{indent}{key}:")
            lines.extend(_readable(value, indent=indent + "  "))
        else:
            lines.append(visible(f"{indent}{key}: {_scalar(value)}"))
    return lines


def _fleet(workers: list[WorkerInfo], queued: dict[tuple[str, str], int]) -> dict[str, Any]:
    """The workers (live, stopped, lost: gone without a word) and the executors whose
    queued jobs no live worker serves."""
    now = time.time()

    def state(w: WorkerInfo) -> str:
        return "live" if is_live(w, now) else "stopped" if w.stopped_at else "lost"

    return {
        "workers": [
            {
                "id": w.id,
                "state": state(w),
                "host": w.host,
                "pid": w.pid,
                "device": w.device,
                "executors": list(w.executors),
                "slots": w.slots,
                "running": len(w.running),
                "running_jobs": list(w.running),
                "version": w.version,
                "started_at": w.started_at,
                "seen_at": w.seen_at,
                "stopped_at": w.stopped_at,
            }
            for w in workers
        ],
        "waiting_for_a_worker": [
            {"device": device, "executor": name or None, "queued": n}
            for (device, name), n in sorted(unserved(queued, workers, now).items())
        ],
    }


def _fleet_lines(fleet: dict[str, Any]) -> list[str]:
    workers = fleet["workers"]
    live = sum(w["state"] == "live" for w in workers)
    out = [f"workers ({live} live, {len(workers) - live} gone in the last hour)"]
    for w in workers:
        out.append(
            visible(
                f"  {w['id']}  {w['state']}  {w['host']}:{w['pid']}  device={w['device']}  "
                f"slots={w['slots']}  running={w['running']}  executors: "
                f"{', '.join(e for e in w['executors'] if ':' not in e) or '-'}"
            )
        )
    if fleet["waiting_for_a_worker"]:
        out.append("waiting for a worker (no live worker serves these executors)")
        for item in fleet["waiting_for_a_worker"]:
            name = item["executor"] or "(jobs of an older build)"
            out.append(visible(f"  {name} on {item['device']}: {item['queued']} queued"))
    return out


def _job_lines(jobs: list[JobListing], progress: dict[str, Progress]) -> list[str]:
    out = [f"jobs ({len(jobs)}, newest first)"]
    for j in jobs:
        status = f" {j.status}" if j.status else ""
        worker = f" on {j.worker}" if j.worker else ""
        p = progress.get(j.job_id)
        shown = f"  {describe_progress(p)}" if p is not None else ""
        out.append(
            visible(
                f"  {j.job_id}  {j.state}{status}  {j.executor or '-'}  device={j.device}  "
                f"attempt={j.attempt}{worker}{shown}"
            )
        )
    return out


async def _progress_of(broker: Broker, jobs: list[JobListing]) -> dict[str, Progress]:
    """The latest progress of the running jobs listed (one read each: a listing holds at
    most ``--limit`` jobs)."""
    out: dict[str, Progress] = {}
    for j in jobs:
        if j.state == "running":
            p = await broker.get_progress(j.job_id)
            if p is not None:
                out[j.job_id] = p
    return out


def _jobs_doc(jobs: list[JobListing], progress: dict[str, Progress]) -> list[Any]:
    """The listing for ``--json``: each running job with its latest ``progress``."""
    docs: list[Any] = msgspec.to_builtins(jobs)
    for doc in docs:
        p = progress.get(doc["job_id"])
        if p is not None:
            doc["progress"] = msgspec.to_builtins(p)
    return docs


async def _list_jobs(broker: Broker, ns: argparse.Namespace) -> list[JobListing]:
    states = ns.state or list(JOB_STATES)
    return await broker.list_jobs(
        states=states, executor=ns.executor, device=ns.device, limit=ns.limit
    )


def _cmd_status(ns: argparse.Namespace) -> int:
    if not ns.jobs and (ns.state or ns.executor or ns.device):
        raise _Exit(EXIT["usage"], "--state, --executor and --device filter --jobs: add --jobs")

    async def go() -> int:
        async with _open(ns.broker) as broker:
            stats = await broker.stats()
            dead = await broker.dead_letters(limit=5)
            fleet = _fleet(await broker.workers(), await broker.queued_executors())
            jobs = await _list_jobs(broker, ns) if ns.jobs else None
            progress = await _progress_of(broker, jobs) if jobs is not None else {}
            lost = await broker.data_lost()
        sandbox = _sandbox_status()
        url = redact_url(ns.broker)
        doc: dict[str, Any] = {
            "broker": {
                "url": url,
                **msgspec.to_builtins(stats),
                # The store lost its data (a Redis restarted without persistence): the
                # counts above are the new data set's (newest first; kept a week).
                "data_lost": msgspec.to_builtins(lost),
            },
            **fleet,
            **({"jobs": _jobs_doc(jobs, progress)} if jobs is not None else {}),
            "sandbox": sandbox,
            "recent_dead_letters": [
                {"job_id": d.job_id, "code": d.error.code, "message": d.error.message} for d in dead
            ],
        }
        if ns.json:
            _dump_json(doc, sys.stdout)
            return 0
        out = [f"broker {url}"]
        # `delayed` is the part of `queued` not yet due: shown inside it, not beside it.
        counts = [f"queued={stats.queued} ({stats.delayed} delayed)"]
        counts += [f"{k}={getattr(stats, k)}" for k in ("running", "done", "dead")]
        out.append("  " + "  ".join(counts))
        for loss in lost:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(loss.at))
            out.append(visible(f"  DATA LOST (found {when}): {loss.detail}"))
        out.extend(_fleet_lines(fleet))
        if jobs is not None:
            out.extend(_job_lines(jobs, progress))
        out.append("sandbox")
        out.extend(_readable(sandbox, indent="  "))
        if dead:
            out.append("recent dead letters")
            for d in dead:
                out.append(visible(f"  {d.job_id} {d.error.code}: {d.error.message}"))
        sys.stdout.write("\n".join(out) + "\n")
        return 0

    return _run(go)


def _cmd_tail(ns: argparse.Namespace) -> int:
    from ..logs import EVENTS, tail

    if ns.event and not any(name.startswith(ns.event) for name in EVENTS):
        # A typo would otherwise print nothing, as if no such record had been written.
        close = difflib.get_close_matches(ns.event, EVENTS, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise _Exit(
            EXIT["usage"],
            f"--event {ns.event!r}: no log event has that name or starts with it; {hint}"
            "the events are listed in metnos_exec/logs.py (EVENTS) and the README",
        )
    if not os.path.exists(ns.file):
        raise _Exit(EXIT["not_found"], f"no log file {ns.file}")
    if os.path.isdir(ns.file):
        logs = sorted(n for n in os.listdir(ns.file) if n.endswith((".jsonl", ".log")))
        hint = f": its logs are {', '.join(logs[:5])}" if logs else ""
        raise _Exit(EXIT["usage"], f"{ns.file} is a folder; tail reads a log file{hint}")
    color = ns.color if ns.color is not None else sys.stdout.isatty()
    try:
        tail(
            ns.file,
            job=ns.job,
            event=ns.event,
            level=ns.level,
            follow=ns.follow,
            color=color,
            raw=ns.json,
        )
    except BrokenPipeError:
        # `metnos-exec tail f | head`: the reader left; that is not an error.
        with contextlib.suppress(OSError):
            sys.stdout.close()
    return 0


def _cmd_purge(ns: argparse.Namespace) -> int:
    older_than = DEFAULT_RETENTION_S
    if ns.older_than_days is not None:
        older_than = _retention(ns.older_than_days, "--older-than-days") or 0.0
        if not older_than:
            raise _Exit(EXIT["usage"], "--older-than-days: 'never' purges nothing; give days")
    else:
        from ..worker import retention_from_env

        try:
            env_retention = retention_from_env()
        except BadConfig as exc:
            raise _Exit(EXIT["usage"], str(exc)) from None
        if env_retention is None:
            raise _Exit(
                EXIT["usage"],
                "METNOS_RETENTION_DAYS=never: nothing to purge; pass --older-than-days",
            )
        older_than = env_retention

    async def go() -> int:
        async with _open(ns.broker) as broker:
            report = await broker.purge(older_than_s=older_than)
            vacuumed = None
            vacuum = getattr(broker, "vacuum", None)
            if ns.vacuum and vacuum is not None:
                vacuumed = await vacuum()
        doc: dict[str, Any] = {
            "older_than_days": round(older_than / 86400, 6),
            **msgspec.to_builtins(report),
        }
        if vacuumed is not None:
            doc["vacuum_reclaimed_bytes"] = vacuumed
        if ns.json:
            _dump_json(doc, sys.stdout)
            return 0
        days = f"{older_than / 86400:g}"
        line = f"purged {report.jobs} finished job(s) older than {days} day(s)"
        if report.collected:
            line += f", collected {report.collected} item(s)"
        reclaimed = (report.reclaimed_bytes or 0) + (vacuumed or 0)
        if report.reclaimed_bytes is not None or vacuumed is not None:
            line += f"; {reclaimed:,} bytes given back to the file system"
        sys.stdout.write(line + "\n")
        if report.reclaimed_bytes is None and vacuumed is None and vacuum is not None:
            sys.stdout.write(
                "this queue file was made without incremental vacuum: run "
                "`metnos-exec purge --vacuum` once (it rewrites the file; stop heavy work "
                "first) and later purges shrink it by themselves\n"
            )
        return 0

    return _run(go)


def register(subparsers: Subparsers) -> None:
    """Add ``status``, ``tail`` and ``purge``."""
    st = add_command(
        subparsers,
        "status",
        "queue counts, the workers, and the sandbox arms available here",
        "Queue counts; the workers serving the queue (live, and gone in the last hour) with "
        "their executors; executors whose queued jobs no live worker serves; the sandbox "
        "arms available on this machine; recent dead letters. Error codes are listed by "
        "`metnos-exec codes`.",
    )
    st.add_argument("--json", action="store_true", help="one JSON document instead of text")
    st.add_argument(
        "--jobs", action="store_true", help="list jobs too: queued, running and recent ones"
    )
    st.add_argument(
        "--state",
        action="append",
        choices=JOB_STATES,
        help="with --jobs: only jobs in this state (repeat for several)",
    )
    st.add_argument("--executor", help="with --jobs: only this executor's jobs")
    st.add_argument("--device", help="with --jobs: only jobs for this device")
    st.add_argument(
        "--limit", type=_positive_int, default=50, help="with --jobs: at most this many (50)"
    )
    st.set_defaults(fn=_cmd_status)

    t = add_command(
        subparsers,
        "tail",
        "show (and follow) a worker's JSON log",
        "Show a JSON-lines log readably; filter by job, event (exact, or a family such as "
        "'job.') and minimum level.",
        broker=False,
    )
    t.add_argument("file", help="the log file (a worker's --log-file)")
    t.add_argument("--job", metavar="JOB_ID", help="only the records of this job")
    t.add_argument(
        "--event", metavar="NAME", help="only this event, or a family ending in '.' (job.)"
    )
    t.add_argument(
        "--level",
        choices=["debug", "info", "warning", "error", "critical"],
        help="only records at this level or above",
    )
    t.add_argument("-f", "--follow", action="store_true", help="keep following the file")
    t.add_argument(
        "--color",
        dest="color",
        action="store_true",
        default=None,
        help="colour the lines (default: when stdout is a terminal)",
    )
    t.add_argument("--no-color", dest="color", action="store_false", help="no colours")
    t.add_argument("--json", action="store_true", help="print the matching raw JSON lines")
    t.set_defaults(fn=_cmd_tail)

    pu = add_command(
        subparsers,
        "purge",
        "forget finished jobs past retention, and give the space back",
        "Forget finished jobs (results, dead letters, idempotency keys) older than the "
        "retention, and give the freed space back to the file system. Workers do this "
        "by themselves at start and hourly; queued and running jobs are never touched.",
    )
    pu.add_argument(
        "--older-than-days",
        metavar="DAYS",
        help="the retention (default: $METNOS_RETENTION_DAYS, else 7)",
    )
    pu.add_argument(
        "--vacuum",
        action="store_true",
        help="SQLite: also rewrite the whole file (needed once for a file made by an older "
        "version, so later purges shrink it; holds the queue for the rewrite)",
    )
    pu.add_argument("--json", action="store_true", help="machine-readable output")
    pu.set_defaults(fn=_cmd_purge)
