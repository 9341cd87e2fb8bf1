"""``web`` (the live view in a browser) and ``top`` (the same in a terminal); both in
`metnos_exec.web`, both with the ``web`` extra (starlette, hypercorn, rich)."""

from __future__ import annotations

import argparse
import importlib

from ..brokers import redact_url
from ..errors import BadConfig, MetnosError
from ._common import (
    EXIT,
    Subparsers,
    _check_url,
    _Exit,
    _exit_for,
    _open,
    _positive_float,
    _run,
    add_command,
    os_error_exit,
)


def _need(module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise _Exit(
            EXIT["usage"],
            f"E_CONFIG: {module} is not installed: pip install 'metnos-exec[web]'",
        ) from None


def _cmd_web(ns: argparse.Namespace) -> int:
    _check_url(ns.broker)  # a mistyped URL is a usage error before anything listens
    for module in ("starlette", "hypercorn"):
        _need(module)
    import anyio

    from ..web.serve import check_settings, parse_bind, serve

    if ns.broker.partition(":")[0] == "memory":
        _open(ns.broker)  # refused there, with the reason
    try:
        host, port = parse_bind(ns.bind)
        settings = check_settings(
            host, port, broker_url=ns.broker, token=ns.token, allow_actions=ns.allow_actions
        )
    except BadConfig as exc:
        raise _Exit(EXIT["usage"], str(exc)) from None

    async def go() -> int:
        await serve(host, port, settings)
        return 0

    try:
        return anyio.run(go, backend=ns.backend)
    except MetnosError as exc:
        raise _Exit(_exit_for(exc), str(exc)) from None
    except OSError as exc:
        raise os_error_exit(exc) from None


def _cmd_top(ns: argparse.Namespace) -> int:
    _need("rich")
    from ..web.top import run_top

    async def go() -> int:
        async with _open(ns.broker) as broker:
            await run_top(broker, url=redact_url(ns.broker), interval_s=ns.interval, once=ns.once)
        return 0

    try:
        return _run(go)
    except KeyboardInterrupt:  # Ctrl-C is how one leaves top: not an error
        return 0


def register(subparsers: Subparsers) -> None:
    """Add ``web`` and ``top``."""
    w = add_command(
        subparsers,
        "web",
        "the live view of the queue in a browser (read-only unless told)",
        "Serve a page that shows the queue live: counts by state, running jobs, recent "
        "results with their five walls, one job's detail, dead letters, workers. Read-only "
        "by default; loopback only unless a token is given. Open the address it prints; "
        "with a token, open http://HOST:PORT/#token=TOKEN.",
    )
    w.add_argument(
        "--bind",
        default="127.0.0.1:8765",
        metavar="HOST:PORT",
        help="where to listen (default 127.0.0.1:8765; port 0: a free one, printed)",
    )
    w.add_argument(
        "--token",
        help="the secret every API call must carry (default: $METNOS_WEB_TOKEN); needed for "
        "--allow-actions and for any bind other than loopback",
    )
    w.add_argument(
        "--allow-actions",
        action="store_true",
        help="offer cancel and undo on the page (needs a token)",
    )
    w.add_argument(
        "--backend",
        choices=["asyncio", "trio"],
        default="asyncio",
        help="the event loop the server runs on (default asyncio)",
    )
    w.set_defaults(fn=_cmd_web)

    t = add_command(
        subparsers,
        "top",
        "the live view of the queue in the terminal",
        "Show the queue refreshing in place (counts, running jobs, recent results with "
        "their walls, dead letters, workers); for an ssh session. --once prints it once.",
    )
    t.add_argument("--once", action="store_true", help="print the view once and exit")
    t.add_argument(
        "--interval",
        type=_positive_float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default 1)",
    )
    t.set_defaults(fn=_cmd_top)
