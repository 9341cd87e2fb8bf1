"""The Starlette app of ``metnos-exec web``: three static files, a JSON API, the guards.

Routes:

==============================  ======  =================================================
path                            method  what
==============================  ======  =================================================
``/``, ``/app.js``,             GET     the page (no data in them; never need the token)
``/style.css``
``/api/overview``               GET     `snapshot.overview` plus what the view allows
``/api/jobs/{id}``              GET     `snapshot.detail`; 404 for an unknown job
``/api/jobs/{id}/cancel``       POST    `Client.cancel` (with ``--allow-actions`` only)
``/api/jobs/{id}/undo``         POST    `Client.submit_undo` (with ``--allow-actions``)
``/api/jobs/{id}/retry``        POST    a dead letter's job queued again as a new job
                                        (`retry_dead`; with ``--allow-actions``)
==============================  ======  =================================================

The guards, each against one threat (SECURITY.md, "The live view"):

- *Job output is hostile.* The page puts every value in with ``textContent``; the
  Content-Security-Policy allows scripts, styles and fetches from this origin only and
  no inline script, so even a value that reached the DOM as markup could not run.
  ``nosniff`` keeps a JSON answer from being read as a script; ``frame-ancestors 'none'``
  keeps the page out of another site's frame (clickjacking an action button).
- *Another site in the operator's browser* (CSRF, DNS rebinding). On a loopback bind the
  ``Host`` must be a loopback name with the view's port: a rebinding site's name is
  refused, so it cannot read the queue. An action is a POST that must carry the token in
  the ``X-Metnos-Token`` header (a form cannot set a header; a cross-origin fetch that
  does is preflighted, and no CORS answer is ever given), and its ``Origin`` (when sent)
  must be this view's. No cookie is used, so there is no ambient credential to ride on.
- *Other people on the network.* With a token, every ``/api`` call needs it (reads too):
  job arguments and outputs are data. `serve` refuses a non-loopback bind without one.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, Final

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..brokers import Broker, open_broker, redact_url
from ..client import Client
from ..errors import BrokerError, MetnosError
from ..messages import new_job_id
from .snapshot import RunningClock, detail, overview

__all__ = ("CSP", "E_RETRY_UNAVAILABLE", "TOKEN_HEADER", "WebSettings", "create_app", "retry_dead")

#: A retry asked of a job that is no dead letter with a readable job message.
E_RETRY_UNAVAILABLE: Final = "E_RETRY_UNAVAILABLE"

#: The header the page's script sends the token in.
TOKEN_HEADER: Final = "x-metnos-token"

#: Everything from this origin only; no inline script or style, no plugin, no frame.
CSP: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)

_SECURITY_HEADERS: Final = (
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
)

_STATIC: Final = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}

_ENCODER = msgspec.json.Encoder()


class WebSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What one view serves and allows.

    Attributes:
        broker_url: the queue to read.
        token: the secret every ``/api`` call must carry (``None``: none needed, reads
            only on a loopback bind).
        allow_actions: offer cancel and undo (needs a token).
        hosts: the ``Host`` values accepted (``()``: any, for a non-loopback bind, where
            the token guards instead).
    """

    broker_url: str
    token: str | None = None
    allow_actions: bool = False
    hosts: tuple[str, ...] = ()


def _json(doc: Any, status: int = 200) -> Response:
    return Response(_ENCODER.encode(doc), status_code=status, media_type="application/json")


def _refuse(status: int, code: str, message: str) -> Response:
    return _json({"error": {"code": code, "message": message}}, status)


class _Headers:
    """ASGI middleware: refuse a foreign ``Host``; add the security headers to every
    answer."""

    def __init__(self, app: Any, hosts: tuple[str, ...]) -> None:
        self.app = app
        self.hosts = frozenset(h.lower() for h in hosts)

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_SECURITY_HEADERS]
            await send(message)

        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
        if self.hosts and host not in self.hosts:
            # DNS rebinding: a site whose name now points at 127.0.0.1 sends its own name.
            refusal = _refuse(
                421, "E_WEB_HOST", f"this view answers only to {', '.join(sorted(self.hosts))}"
            )
            await refusal(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)


def _token_ok(request: Request, token: str | None) -> bool:
    if token is None:
        return True
    sent = request.headers.get(TOKEN_HEADER, "")
    return hmac.compare_digest(sent.encode(), token.encode())


def _same_origin(request: Request) -> bool:
    """A POST from this page: its ``Origin`` is this view's (a browser always sends one on
    a fetch POST), and ``Sec-Fetch-Site`` (where sent) does not say another site."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return site is None  # a client that is no browser (curl): the token decides
    return origin.lower() == f"{request.url.scheme}://{request.headers.get('host', '')}".lower()


Handler = Callable[[Request], Awaitable[Response]]


def _guarded(settings: WebSettings, fn: Handler, *, write: bool) -> Handler:
    """`fn` behind the view's rules: read-only unless actions are allowed, an action only
    from this origin, the token when there is one; a store failure as a 503."""

    async def guarded(request: Request) -> Response:
        if write and not settings.allow_actions:
            return _refuse(
                403,
                "E_WEB_READ_ONLY",
                "this view is read-only (start it with --allow-actions and a token to cancel, "
                "retry or undo)",
            )
        if write and not _same_origin(request):
            return _refuse(403, "E_WEB_ORIGIN", "actions come from this view's page only")
        if not _token_ok(request, settings.token):
            return _refuse(
                401,
                "E_WEB_TOKEN",
                "the view's token is missing or wrong (open the page as "
                "http://HOST:PORT/#token=TOKEN)",
            )
        try:
            return await fn(request)
        except BrokerError as exc:
            return _refuse(503, exc.code, str(exc))

    return guarded


class RetryUnavailable(MetnosError):
    """A retry asked of a job that is no dead letter with a readable job message."""

    code = E_RETRY_UNAVAILABLE


async def retry_dead(broker: Broker, job_id: str) -> str:
    """Queue a dead letter's job again, as a new job (a new id, submitted now, no
    idempotency key or ``not_before``; its arguments, executor and limits as they were),
    and return the new id. The dead job and its letter stay as they are (the record of
    what happened). `MetnosError` ``E_RETRY_UNAVAILABLE``: not a dead job, or its letter
    holds no readable job message (a malformed one is not queued again)."""
    state = await broker.get_job_state(job_id)
    letter = None
    if state is not None and state.state == "dead":
        letters = await broker.dead_letters(limit=1000)
        letter = next((d for d in letters if d.job_id == job_id), None)
    if letter is None or letter.job is None:
        what = "no dead letter" if letter is None else "a dead letter without a readable job"
        raise RetryUnavailable(f"job {job_id} is {what}: nothing to retry")
    again = msgspec.structs.replace(
        letter.job,
        id=new_job_id(),
        submitted_at=time.time(),
        idempotency_key=None,
        not_before=None,
        trace=None,
    )
    return (await broker.submit(again)).job_id


def create_app(settings: WebSettings, broker: Broker | None = None) -> Starlette:
    """The view's ASGI app. With `broker` it reads that one (tests; the caller closes
    it); otherwise it opens ``settings.broker_url`` for reading at startup."""
    state: dict[str, Any] = {"clock": RunningClock()}
    shown_url = redact_url(settings.broker_url)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        if broker is not None:
            state["broker"] = broker
            yield
            return
        async with open_broker(settings.broker_url, create=False) as opened:
            state["broker"] = opened
            yield

    def api(*, write: bool = False) -> Callable[[Handler], Handler]:
        return lambda fn: _guarded(settings, fn, write=write)

    async def static(request: Request) -> Response:
        name, media = _STATIC[request.url.path]
        body = resources.files(__package__).joinpath("static", name).read_bytes()
        return Response(body, media_type=media)

    @api()
    async def get_overview(request: Request) -> Response:
        doc = await overview(state["broker"], state["clock"], url=shown_url)
        doc["view"] = {"actions": settings.allow_actions}
        return _json(doc)

    @api()
    async def get_job(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        doc = await detail(state["broker"], job_id)
        if doc is None:
            return _refuse(404, "E_NOT_FOUND", f"no job {job_id} in this queue")
        return _json(doc)

    @api(write=True)
    async def cancel(request: Request) -> Response:
        outcome = await Client(state["broker"]).cancel(request.path_params["job_id"])
        return _json({"outcome": outcome})

    @api(write=True)
    async def undo(request: Request) -> Response:
        try:
            undo_id = await Client(state["broker"]).submit_undo(request.path_params["job_id"])
        except MetnosError as exc:
            return _refuse(409, exc.code, str(exc))
        return _json({"undo_job_id": undo_id})

    @api(write=True)
    async def retry(request: Request) -> Response:
        try:
            new_id = await retry_dead(state["broker"], request.path_params["job_id"])
        except RetryUnavailable as exc:
            return _refuse(409, exc.code, str(exc))
        return _json({"job_id": new_id})

    async def no_icon(request: Request) -> Response:
        return Response(status_code=204)  # a browser asks; a 404 would litter its console

    routes = [Route(path, static) for path in _STATIC]
    routes += [
        Route("/favicon.ico", no_icon),
        Route("/api/overview", get_overview),
        Route("/api/jobs/{job_id}", get_job),
        Route("/api/jobs/{job_id}/cancel", cancel, methods=["POST"]),
        Route("/api/jobs/{job_id}/undo", undo, methods=["POST"]),
        Route("/api/jobs/{job_id}/retry", retry, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(_Headers, hosts=settings.hosts)
    return app
