"""``metnos-exec top``: the live view's overview in a terminal, refreshed in place (rich).

Every value from the queue passes through `metnos_exec._terminal.visible` and lands in a
`rich.text.Text` (never parsed as rich markup): a job id, an executor name or an error
message holding ESC sequences or ``[bold]`` prints as those characters, and cannot move
the cursor, retitle the window or restyle the table.
"""

from __future__ import annotations

import os
import time
from typing import Any, Final

from .._terminal import visible
from ..brokers import Broker
from .snapshot import RunningClock, overview

__all__ = ("render", "run_top")

#: How an axis verdict is coloured (the page uses the same three).
WALL_STYLE: Final = {"kept": "green", "partial": "yellow", "not_kept": "bold red"}
_AXES: Final = ("files", "network", "process_tree", "user", "resources")
_STATUS_STYLE: Final = {
    "succeeded": "green",
    "failed": "red",
    "timed_out": "red",
    "cancelled": "yellow",
    "rejected": "magenta",
    "dead": "bold red",
    "awaiting_approval": "cyan",
}


def _t(value: Any, style: str = "") -> Any:
    from rich.text import Text

    return Text(visible("-" if value is None else str(value)), style=style)


def _walls(walls: dict[str, str] | None) -> Any:
    from rich.text import Text

    if walls is None:
        return Text("no sandbox", style="dim")
    out = Text()
    for axis in _AXES:
        state = walls.get(axis, "?")
        # One letter per axis (f n p u r), coloured by its verdict: five walls at a glance.
        out.append(axis[0], style=WALL_STYLE.get(state, ""))
    out.append(" " + visible(walls.get("sandbox", "")), style="dim")
    return out


def _table(title: str, columns: tuple[str, ...], rows: list[list[Any]]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", expand=False, show_edge=False)
    for name in columns:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*row)
    if not rows:
        table.add_row(*([_t("(none)", "dim")] + [_t("")] * (len(columns) - 1)))
    return table


def render(doc: dict[str, Any]) -> Any:
    """The overview as one rich renderable."""
    from rich.console import Group

    c = doc["counts"]
    head = _t(
        f"{doc.get('broker', '')}  queued {c['queued']} ({c['delayed']} delayed)  running "
        f"{c['running']}  done {c['done']}  dead {c['dead']}  "
        f"{time.strftime('%H:%M:%S', time.localtime(doc['at']))}",
        "bold",
    )
    running = [
        [
            _t(j["job_id"]),
            _t(j["executor"]),
            _t(j["worker"]),
            _t(f"{'>=' if j['since_seen'] else ''}{j['elapsed_s']:.1f}s"),
            _t(j["attempt"]),
        ]
        for j in doc["running"]
    ]
    recent = [
        [
            _t(j["job_id"]),
            _t(j["executor"]),
            _t(j["status"], _STATUS_STYLE.get(j["status"] or "", "")),
            _walls(j["walls"]),
            _t(f"{j['error']['code']}: {j['error']['message']}" if j["error"] else ""),
        ]
        for j in doc["recent"]
    ]
    dead = [[_t(d["job_id"]), _t(d["code"]), _t(d["message"])] for d in doc["dead"]]
    workers = [
        [
            _t(w["id"]),
            _t(w["state"], "green" if w["state"] == "live" else "red"),
            _t(f"{w['running']}/{w['slots']}"),
            _t(f"{w['seen_s_ago']}s ago"),
            _t(", ".join(w["executors"])),
        ]
        for w in doc["workers"]
    ]
    return Group(
        head,
        _table("running", ("job", "executor", "worker", "elapsed", "attempt"), running),
        _table(
            "recent results (walls: files network process user resources)",
            ("job", "executor", "status", "walls", "error"),
            recent,
        ),
        _table("dead letters", ("job", "code", "message"), dead),
        _table("workers", ("id", "state", "busy", "seen", "executors"), workers),
    )


async def run_top(broker: Broker, *, url: str, interval_s: float, once: bool) -> None:
    """Show the overview; with `once`, print it once (no screen control) and return."""
    import anyio
    from rich.console import Console
    from rich.live import Live

    clock = RunningClock()
    console = Console()
    if once:
        if not console.is_terminal and "COLUMNS" not in os.environ:
            console = Console(width=160)  # a pipe: wider than rich's 80, unless told
        console.print(render(await overview(broker, clock, url=url)))
        return
    with Live(console=console, screen=False, auto_refresh=False) as live:
        while True:
            live.update(render(await overview(broker, clock, url=url)), refresh=True)
            await anyio.sleep(interval_s)
