"""A real SQLite queue with jobs in every state, for the live view's tests: queued,
running, succeeded (every wall kept), degraded (walls partial and not kept, with reasons),
refused (no sandbox), hostile (HTML and terminal escapes in its output, stderr and error),
dead, and a worker's presence record."""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from metnos_exec.brokers import open_broker
from metnos_exec.brokers.presence import WorkerInfo
from metnos_exec.messages import ErrorInfo, Job, Result
from metnos_exec.sandbox._types import AxisVerdict, ContainmentReport, Failure, Success

#: What a hostile job prints: markup a careless page would run, escapes a careless
#: terminal would obey (clear the screen, retitle the window), a bidi override.
HOSTILE = "<img src=x onerror=\"document.title='pwned'\"><script>alert(1)</script>"
ESCAPES = "\x1b[2J\x1b]0;owned\x07\u202e"
#: What a careless rich program would read as its own markup.
MARKUP = "[bold red]forged[/]"


def kept(reason: str = "bwrap namespaces") -> AxisVerdict:
    return AxisVerdict("kept", reason)


def report(**axes: AxisVerdict) -> ContainmentReport:
    base = {name: kept() for name in ("files", "network", "process_tree", "user", "resources")}
    return ContainmentReport(sandbox="bwrap", **{**base, **axes})


async def _fill(url: str) -> dict[str, str]:
    ids: dict[str, str] = {}
    async with open_broker(url) as b:
        for name, args in (
            ("ok", {"n": 1}),
            ("degraded", {"n": 2}),
            ("refused", {"path": "/etc/shadow"}),
            ("hostile", {"note": HOSTILE + ESCAPES}),
            ("dead", {"n": 3}),
            ("running", {"n": 4}),
        ):
            ids[name] = (await b.submit(Job(executor="tool", args=args, max_attempts=1))).job_id
        leases = {lease.job.id: lease for lease in await b.lease("w1", visibility_s=300, limit=6)}
        by_name = {name: leases[job_id] for name, job_id in ids.items()}
        now = time.time()

        def result(name: str, **kw: object) -> Result:
            lease = by_name[name]
            return Result(
                job_id=lease.job.id,
                worker="w1",
                attempt=1,
                finished_at=now,
                **kw,  # type: ignore[arg-type]
            )

        await b.ack(
            by_name["ok"],
            result("ok", status="succeeded", output={"n": 1}, exit=Success(), containment=report()),
        )
        await b.ack(
            by_name["degraded"],
            result(
                "degraded",
                status="succeeded",
                exit=Success(),
                containment=report(
                    network=AxisVerdict("not_kept", "no network namespace: host network"),
                    resources=AxisVerdict("partial", "no memory cgroup: rlimits only"),
                ),
            ),
        )
        await b.ack(
            by_name["refused"],
            result(
                "refused",
                status="rejected",
                error=ErrorInfo(
                    code="E_CAPABILITY_DENIED",
                    message="path /etc/shadow is outside the files this executor may read",
                ),
            ),
        )
        await b.ack(
            by_name["hostile"],
            result(
                "hostile",
                status="failed",
                output={"note": HOSTILE + ESCAPES},
                stderr=HOSTILE + ESCAPES,
                exit=Failure(code=1),
                error=ErrorInfo(code="E_EXIT", message=HOSTILE + ESCAPES + MARKUP),
                containment=report(),
            ),
        )
        await b.dead_letter(
            by_name["dead"], error=ErrorInfo(code="E_LEASE_EXPIRED", message="its worker died")
        )
        ids["queued"] = (await b.submit(Job(executor="tool", args={"n": 5}))).job_id
        await b.register_worker(
            WorkerInfo(
                id="w1",
                host="box",
                pid=4242,
                device="server",
                executors=("tool",),
                slots=4,
                running=(ids["running"],),
                started_at=now - 60,
                seen_at=now,
            )
        )
    return ids


def fill_queue(path: Path) -> tuple[str, dict[str, str]]:
    """A queue file at `path` with one job per state; its URL and the job ids by name."""
    url = f"sqlite:///{path}"
    return url, anyio.run(_fill, url)


def fill_url(url: str) -> dict[str, str]:
    """The same jobs on the queue `url` names (a Redis prefix, say); their ids by name."""
    return anyio.run(_fill, url)
