"""`robust_fetch`: download a pinned file over a bad link, and never keep the wrong bytes.

A device may sit behind a phone's connection; a 30 MB runtime must still arrive whole and
exactly as pinned (spec section 10). The rules, in the order they apply:

1. **Pinned or nothing.** Every download names the SHA-256 it must have; the file reaches
   `dest` only after it matched (written as ``dest.part``, renamed into place). A `dest`
   that already matches is returned without a request.
2. **Ranges.** The body is asked for in `RANGE_BYTES` (8 MiB) ``Range`` requests, written to
   ``dest.part`` as it arrives. A dropped connection or a short range is retried from the
   last byte written (a few tries with backoff per range): the bytes fetched again after a
   drop are fewer than one range. A ``.part`` left by an earlier run is resumed too;
   ``If-Range`` with the first response's ETag makes a server whose file changed meanwhile
   send the whole new file instead of splicing two versions.
3. **A server that ignores Range** (``200`` to a range request) cannot resume: the ``.part``
   is discarded and the whole body is taken from that response, so the download still
   completes; a drop there starts over from byte 0 (same bounded tries).
4. **Copies.** A complete ``.part`` whose SHA-256 is not the pin is discarded and fetched
   again, and the copies' hashes are compared: a copy that matches the pin wins; two copies
   that agree with each other but not with the pin mean the server serves another file
   (not a bad link), which is an error naming both hashes; copies that never agree after
   `max_copies` are an error naming every hash seen. Bytes that did not match the pin are
   never kept.
5. **Progress** for people: a bar on stderr when it is a terminal, else ``fetch.progress``
   log records (every 10 %), plus ``fetch.started`` / ``fetch.retry`` / ``fetch.finished``
   / ``fetch.failed``.

The HTTP client is httpx (the ``device`` extra), which runs on anyio: asyncio and trio.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import stat
import sys
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Final, Literal, TextIO, cast

import anyio

from ..errors import MetnosError, ToolUnavailable
from ..logs import get_logger

if TYPE_CHECKING:  # pragma: no cover
    import httpx

__all__ = (
    "DEADLINE_S",
    "MAX_BYTES",
    "MAX_COPIES",
    "RANGE_BYTES",
    "FetchError",
    "robust_fetch",
    "sha256_file",
)

#: Bytes asked for per request.
RANGE_BYTES: Final = 8 * 1024 * 1024
#: The largest file taken (announced or received): a body that never ends, or a size a
#: hostile server claims, stops here instead of filling the disk.
MAX_BYTES: Final = 1 << 30
#: Seconds a whole download may take (every copy, range and retry): a server that trickles
#: a byte before each read timeout would otherwise never be given up on.
DEADLINE_S: Final = 3600.0
#: Complete copies fetched before giving up on a hash that never matches.
MAX_COPIES: Final = 4
#: Tries of one range (or of a whole body from a server without ranges) in a row that
#: make no progress before giving up.
MAX_TRIES: Final = 6

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_UNSATISFIED = re.compile(r"^bytes \*/(\d+)$")

_log = get_logger()


class FetchError(MetnosError):
    """A download could not produce the pinned bytes (the message says why and names the
    hashes seen)."""

    code = "E_FETCH"


class _Redirected(Exception):
    """A redirect that cannot be followed (another scheme, a loop): not retried."""


class _Drop(Exception):
    """A transfer ended early (connection dropped, short body, server error)."""


def sha256_file(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> str:
    """SHA-256 (hex) of a file, read in 1 MiB blocks (a symlink refused with `ELOOP` when
    `follow_symlinks` is false)."""
    digest = hashlib.sha256()
    flags = os.O_RDONLY | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    with open(os.open(path, flags), "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


ProgressFn = Callable[[int, int | None], None]


class _Progress:
    """A bar on a terminal, else a ``fetch.progress`` record every 10 %."""

    def __init__(self, url: str, stream: TextIO | None = None) -> None:
        self.url = url
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self._last_tenth = -1
        self._drawn = 0.0

    def __call__(self, done: int, total: int | None) -> None:
        if self.tty:
            now = time.monotonic()
            if now - self._drawn < 0.1 and total is not None and done < total:
                return
            self._drawn = now
            if total:
                filled = int(30 * done / total)
                bar = "#" * filled + "-" * (30 - filled)
                text = f"\r[{bar}] {done / total:6.1%} {done >> 20}/{total >> 20} MiB "
            else:
                text = f"\r{done >> 20} MiB "
            self.stream.write(text)
            if total is not None and done >= total:
                self.stream.write("\n")
            self.stream.flush()
            return
        tenth = int(10 * done / total) if total else done >> 23
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            _log.info("fetch.progress", url=self.url, done=done, total=total)


async def robust_fetch(
    url: str,
    sha256: str,
    dest: str | os.PathLike[str],
    *,
    range_bytes: int = RANGE_BYTES,
    max_copies: int = MAX_COPIES,
    max_tries: int = MAX_TRIES,
    max_bytes: int = MAX_BYTES,
    retry_delay_s: float = 0.5,
    timeout_s: float = 30.0,
    deadline_s: float | None = DEADLINE_S,
    progress: ProgressFn | None = None,
    client: httpx.AsyncClient | None = None,
) -> Path:
    """Download `url` to `dest` and return it, only once its SHA-256 is `sha256`.

    Args:
        url: ``http://`` or ``https://``.
        sha256: the pinned SHA-256 (64 hex digits); required, never looked up.
        dest: where the verified file goes (its folder is created); ``dest.part`` holds
            the download meanwhile and is resumed by a later call.
        range_bytes: bytes per ``Range`` request.
        max_copies: complete copies fetched before giving up on the hash.
        max_tries: tries without progress (per range) before giving up.
        max_bytes: the largest file accepted; a larger announced size, or a body that goes
            on past it, is a `FetchError`.
        retry_delay_s: first backoff after a failed try (doubles, capped at 10 s).
        timeout_s: connect / read timeout per request.
        deadline_s: the whole download's time (``None``: no bound); past it, a
            `FetchError`, the ``.part`` kept for a later call to resume.
        progress: ``(done, total)`` callback; default a bar on a terminal, else
            ``fetch.progress`` records.
        client: an httpx client to use (tests); default one per call.

    Raises:
        FetchError: the server never gave the pinned bytes, or kept failing.
        ToolUnavailable: httpx is not installed (the ``device`` extra).
    """
    pinned = sha256.strip().lower()
    if not _HEX64.match(pinned):
        raise FetchError(f"{url}: the pinned SHA-256 {sha256!r} is not 64 hex digits")
    target = Path(dest)
    if await anyio.Path(target).is_file() and (
        await anyio.to_thread.run_sync(sha256_file, target) == pinned
    ):
        return target
    try:
        import httpx
    except ImportError as exc:
        raise ToolUnavailable(
            f"downloading needs httpx ({exc}); pip install 'metnos-exec[device]'"
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    _drop_if_not_regular(part)
    report = progress if progress is not None else _Progress(url)
    own = client is None
    http = client or httpx.AsyncClient(
        timeout=timeout_s,
        follow_redirects=True,
        event_hooks={"response": [_check_redirect]},
    )
    started = time.monotonic()
    _log.info("fetch.started", url=url, dest=str(target), resume_from=_size(part))
    try:
        with anyio.move_on_after(math.inf if deadline_s is None else deadline_s):
            return await _copies(
                http,
                url,
                pinned,
                target,
                part,
                report,
                started,
                range_bytes=range_bytes,
                max_copies=max_copies,
                max_tries=max_tries,
                retry_delay_s=retry_delay_s,
                max_bytes=max_bytes,
            )
        raise FetchError(
            f"{url}: the download did not finish within {deadline_s} s (deadline_s); "
            f"{_size(part)} bytes are kept in {part.name} for the next try"
        )
    except FetchError as exc:
        _log.error("fetch.failed", url=url, code=exc.code, error=exc.message)
        raise
    finally:
        if own:
            with anyio.CancelScope(shield=True):
                await http.aclose()


async def _copies(
    http: httpx.AsyncClient,
    url: str,
    pinned: str,
    target: Path,
    part: Path,
    report: ProgressFn,
    started: float,
    *,
    range_bytes: int,
    max_copies: int,
    max_tries: int,
    retry_delay_s: float,
    max_bytes: int,
) -> Path:
    copies: list[str] = []
    while True:
        transfer = _Transfer(
            http, url, part, range_bytes, max_tries, retry_delay_s, report, max_bytes
        )
        await transfer.run()
        got = await anyio.to_thread.run_sync(lambda: sha256_file(part, follow_symlinks=False))
        if got == pinned:
            os.replace(part, target)
            _log.info(
                "fetch.finished",
                url=url,
                dest=str(target),
                bytes=(await anyio.Path(target).stat()).st_size,
                seconds=round(time.monotonic() - started, 3),
                copies=len(copies) + 1,
            )
            return target
        await anyio.Path(part).unlink()
        if copies and copies[-1] == got:
            raise FetchError(
                f"{url}: two downloads agree on SHA-256 {got}, but the pinned SHA-256 is "
                f"{pinned}: the server serves another file (check the URL and the pin)"
            )
        copies.append(got)
        if len(copies) >= max_copies:
            raise FetchError(
                f"{url}: {len(copies)} downloads never matched the pinned SHA-256 "
                f"{pinned} nor each other (got {', '.join(copies)}): the link or the "
                "server corrupts the data"
            )
        _log.warning(
            "fetch.retry",
            url=url,
            reason="sha256_mismatch",
            got=got,
            pinned=pinned,
            attempt=len(copies) + 1,
        )


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except FileNotFoundError:
        return 0


def _drop_if_not_regular(part: Path) -> None:
    """A ``.part`` that is a symlink (or anything but a regular file) is removed, never
    written through: the download must not land outside `dest`."""
    try:
        st = part.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        _log.warning("fetch.part_discarded", part=str(part), reason="not a regular file")
        if stat.S_ISDIR(st.st_mode):
            raise FetchError(f"{part} is a folder, not a partial download: remove it")
        part.unlink()


async def _check_redirect(resp: httpx.Response) -> None:
    """httpx follows redirects; one to another scheme (``file://``, ...) or a loop is an
    answer, not a bad link: it ends the download at once with a clear error."""
    if resp.is_redirect:
        location = resp.headers.get("location", "")
        scheme = location.split(":", 1)[0].lower() if ":" in location.split("/", 1)[0] else ""
        if scheme and scheme not in ("http", "https"):
            raise _Redirected(f"redirected to {location!r}: only http(s) is followed")


class _Transfer:
    """One complete copy into ``part``, resuming whatever it already holds."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        url: str,
        part: Path,
        range_bytes: int,
        max_tries: int,
        retry_delay_s: float,
        report: ProgressFn,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.http = http
        self.url = url
        self.part = part
        self.range_bytes = range_bytes
        self.max_tries = max_tries
        self.retry_delay_s = retry_delay_s
        self.report = report
        self.max_bytes = max_bytes
        self.total: int | None = None
        self.etag: str | None = None

    async def run(self) -> None:
        offset = _size(self.part)
        tries = 0
        while self.total is None or offset < self.total:
            before = offset
            try:
                offset = await self._one(offset)
            except _Drop as exc:
                offset = _size(self.part)
                tries = 0 if offset > before else tries + 1
                if tries >= self.max_tries:
                    raise FetchError(
                        f"{self.url}: gave up after {tries} tries without progress at byte "
                        f"{offset}: {exc}"
                    ) from None
                _log.warning(
                    "fetch.retry", url=self.url, reason=str(exc), offset=offset, attempt=tries + 1
                )
                if tries:
                    await anyio.sleep(min(10.0, self.retry_delay_s * 2 ** (tries - 1)))
                continue
            tries = 0

    async def _one(self, offset: int) -> int:
        """Fetch one range from `offset`; return the new end of ``part``."""
        import httpx

        end = offset + self.range_bytes - 1
        if self.total is not None:
            end = min(end, self.total - 1)
        headers = {"Range": f"bytes={offset}-{end}", "Accept-Encoding": "identity"}
        if self.etag is not None:
            headers["If-Range"] = self.etag
        try:
            async with self.http.stream("GET", self.url, headers=headers) as resp:
                return await self._receive(resp, offset, end)
        except _Redirected as exc:
            raise FetchError(f"{self.url}: {exc}") from None
        except httpx.TooManyRedirects as exc:
            raise FetchError(f"{self.url}: too many redirects ({exc})") from None
        except httpx.UnsupportedProtocol as exc:
            # A redirect to another scheme through a caller's client (ours refuses it in
            # `_check_redirect`): an answer, not a dropped link.
            raise FetchError(f"{self.url}: {exc}") from None
        except httpx.TransportError as exc:
            raise _Drop(f"{type(exc).__name__}: {exc}") from None

    async def _receive(self, resp: httpx.Response, offset: int, end: int) -> int:
        status = resp.status_code
        if status == 416:
            m = _UNSATISFIED.match(resp.headers.get("content-range", ""))
            if m is not None and int(m.group(1)) == offset:
                self.total = offset  # the .part already holds the whole file
                return offset
            # The .part is longer than the file (another version): start over.
            self.part.unlink(missing_ok=True)
            raise _Drop("range not satisfiable; the partial file was discarded")
        if status >= 500 or status == 429:
            raise _Drop(f"HTTP {status}")
        if status == 200:
            return await self._whole(resp, offset)
        if status != 206:
            raise FetchError(f"{self.url}: HTTP {status} {resp.reason_phrase}")
        m = _CONTENT_RANGE.match(resp.headers.get("content-range", ""))
        if (
            m is None
            or int(m.group(1)) != offset
            or int(m.group(2)) < offset
            or (m.group(3) != "*" and int(m.group(2)) >= int(m.group(3)))
        ):
            raise _Drop(f"unexpected Content-Range {resp.headers.get('content-range')!r}")
        if m.group(3) != "*":
            self.total = self._bounded(int(m.group(3)))
        self._bounded(int(m.group(2)) + 1)
        if self.etag is None:
            self.etag = _strong_etag(resp)
        want = int(m.group(2)) - offset + 1
        got = 0
        # aclosing: a generator left by a drop is closed now, not by the GC (trio warns).
        # The cut scope stops a body that goes on past its range (no Content-Length, never
        # ending): cancelling unwinds httpx's nested generators from the inside, where a
        # `break` would leave them to the GC (a warning under trio).
        with await _open(self.part, "ab") as f, anyio.CancelScope() as cut:
            async with contextlib.aclosing(_raw(resp)) as body:
                async for chunk in body:
                    chunk = chunk[: max(want - got, 0)]
                    if chunk:
                        f.write(chunk)
                        f.flush()
                        got += len(chunk)
                        self.report(offset + got, self.total)
                    if got >= want:
                        cut.cancel()
        if got < want:
            raise _Drop(f"range ended after {got} of {want} bytes")
        return offset + got

    def _bounded(self, size: int) -> int:
        if size > self.max_bytes:
            raise FetchError(
                f"{self.url}: the server announces {size} bytes, more than {self.max_bytes}, "
                "the most taken (max_bytes)"
            )
        return size

    async def _whole(self, resp: httpx.Response, offset: int) -> int:
        """A ``200``: the server ignored ``Range``; take the whole body from byte 0."""
        if offset:
            _log.warning("fetch.retry", url=self.url, reason="range_ignored", offset=0, attempt=1)
        length = resp.headers.get("content-length")
        self.total = self._bounded(int(length)) if length is not None and length.isdigit() else None
        got = 0
        over = False
        with await _open(self.part, "wb") as f, anyio.CancelScope() as cut:
            async with contextlib.aclosing(_raw(resp)) as body:
                async for chunk in body:
                    if got + len(chunk) > self.max_bytes:
                        over = True
                        cut.cancel()  # see _receive: unwinds httpx's generators cleanly
                        continue
                    f.write(chunk)
                    got += len(chunk)
                    self.report(got, self.total)
            f.flush()
        if over:
            self.part.unlink(missing_ok=True)
            raise FetchError(
                f"{self.url}: the body goes on past {self.max_bytes} bytes, the most taken "
                "(max_bytes); the partial file was discarded"
            )
        if self.total is not None and got < self.total:
            raise _Drop(f"body ended after {got} of {self.total} bytes (no Range: from 0)")
        self.total = got
        return got


async def _open(path: Path, mode: Literal["ab", "wb"]) -> BinaryIO:
    """Open in a thread (a slow file system must not stall the loop), never through a
    symlink (``O_NOFOLLOW``: one planted meanwhile is an error, not a write elsewhere).
    The writes that follow stay inline: a chunk goes to the page cache in microseconds,
    far less than a thread hop per chunk would cost."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    flags |= os.O_APPEND if mode == "ab" else os.O_TRUNC

    def opened() -> BinaryIO:
        try:
            return open(os.open(path, flags, 0o600), mode)
        except OSError as exc:
            raise FetchError(f"cannot write the partial download {path}: {exc}") from None

    return await anyio.to_thread.run_sync(opened)


def _raw(resp: httpx.Response) -> AsyncGenerator[bytes, None]:
    return cast("AsyncGenerator[bytes, None]", resp.aiter_raw())


def _strong_etag(resp: Any) -> str | None:
    etag = resp.headers.get("etag")
    # If-Range takes a strong validator only (RFC 9110 13.1.5).
    return etag if etag and not etag.startswith("W/") else None
