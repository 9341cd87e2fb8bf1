"""Serving the view: the bind rules, and hypercorn on whichever event loop runs us.

The rules (`check_settings`): a bind on another address than loopback needs a token (the
queue's arguments and outputs are data, and the network is not the operator's browser);
``--allow-actions`` needs a token on any bind (an action is a write: a page that can
cancel must know a secret no other site has). The token comes from ``--token`` or
``$METNOS_WEB_TOKEN``; at least `MIN_TOKEN_CHARS` characters.

Hypercorn runs the app on asyncio or trio (``--backend``); the listening socket is made
here, so ``--bind 127.0.0.1:0`` takes a free port and the line ``serving on URL`` on
stderr says which, once the socket listens (tests wait for that line).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any, Final

import anyio
import sniffio

from ..brokers import open_broker
from ..errors import BadConfig
from .app import WebSettings, create_app

__all__ = ("MIN_TOKEN_CHARS", "TOKEN_ENV", "check_settings", "parse_bind", "serve")

TOKEN_ENV: Final = "METNOS_WEB_TOKEN"
#: A shorter secret is guessed; ``python -c 'import secrets; print(secrets.token_urlsafe())'``
#: makes a good one.
MIN_TOKEN_CHARS: Final = 16


def parse_bind(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port).

    Raises:
        BadConfig: not HOST:PORT with a port from 0 to 65535.
    """
    host, sep, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not sep or not host or not 0 <= port <= 65535:
        raise BadConfig(f"--bind {text!r}: expected HOST:PORT, such as 127.0.0.1:8765")
    return host, port


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or ``localhost``; a name is not resolved (it could move)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_settings(
    host: str,
    port: int,
    *,
    broker_url: str,
    token: str | None,
    allow_actions: bool,
    environ: Mapping[str, str] | None = None,
) -> WebSettings:
    """The view's settings, or why it must not start.

    Raises:
        BadConfig: a non-loopback bind or ``--allow-actions`` without a token; a token
            shorter than `MIN_TOKEN_CHARS`.
    """
    env = os.environ if environ is None else environ
    token = token if token is not None else (env.get(TOKEN_ENV) or None)
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise BadConfig(
            f"the web token is {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(python -c 'import secrets; print(secrets.token_urlsafe())')"
        )
    loopback = is_loopback(host)
    if token is None and not loopback:
        raise BadConfig(
            f"--bind {host}: an address other than loopback shows the queue to the network; "
            f"give a token (--token or ${TOKEN_ENV}) or bind 127.0.0.1"
        )
    if token is None and allow_actions:
        raise BadConfig(
            f"--allow-actions needs a token (--token or ${TOKEN_ENV}): the page sends it "
            "with every action, so no other site can cancel or undo your jobs"
        )
    hosts: tuple[str, ...] = ()
    if loopback:
        names = {"127.0.0.1", "localhost", "[::1]", host if ":" not in host else f"[{host}]"}
        hosts = tuple(sorted(f"{name}:{port}" for name in names))
    return WebSettings(broker_url=broker_url, token=token, allow_actions=allow_actions, hosts=hosts)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise BadConfig(f"--bind {host}:{port}: cannot listen there: {exc.strerror}") from None
    return sock


async def serve(host: str, port: int, settings: WebSettings) -> None:
    """Serve the view until SIGINT or SIGTERM, then stop gracefully."""
    from hypercorn.config import Config

    sock = _listen(host, port)
    bound_port = sock.getsockname()[1]
    if settings.hosts:
        # Port 0 became a real port: the Host rule must name it.
        settings = check_settings(
            host,
            bound_port,
            broker_url=settings.broker_url,
            token=settings.token,
            allow_actions=settings.allow_actions,
            environ={},
        )
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns (and closes) the socket now
    config.accesslog = None  # one line per poll, every second: noise, not news
    config.errorlog = "-"  # a fault in the app reaches stderr, with its traceback
    config.loglevel = "WARNING"
    config.graceful_timeout = 2.0
    shown = f"[{host}]" if ":" in host else host
    async with open_broker(settings.broker_url, create=False) as broker:
        app = create_app(settings, broker)
        await _run(app, config, f"http://{shown}:{bound_port}/")


async def _run(app: Any, config: Any, url: str) -> None:
    stop = anyio.Event()

    async def on_signals() -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                stop.set()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(on_signals)
        sys.stderr.write(f"metnos-exec web: serving on {url}\n")
        sys.stderr.flush()
        if sniffio.current_async_library() == "trio":
            from hypercorn.trio import serve as trio_serve

            await trio_serve(app, config, shutdown_trigger=stop.wait)
        else:
            from hypercorn.asyncio import serve as asyncio_serve

            await asyncio_serve(app, config, shutdown_trigger=stop.wait)
        tg.cancel_scope.cancel()
