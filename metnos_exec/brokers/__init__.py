"""Queue backends behind one seam, opened by URL.

``memory://`` (tests, embedding; in-process only: it is gone when the process ends),
``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db`` (the embedded default;
note the fourth slash: ``sqlite:///work/x.db`` is ``work/x.db`` under the current folder),
``redis://[:password@]host:port/db`` or ``rediss://...`` (TLS): Redis Streams, workers on
many machines (needs the ``redis`` extra: coredis); ``redis+cluster://host:port[,...]``
(a Redis Cluster) and ``redis+sentinel://host:port[,...]/service`` (a primary found
through Sentinel) too (`metnos_exec.brokers._redis_target`).
Query parameters become keyword options of the broker, e.g.
``sqlite:///./metnos.db?poll_interval_s=0.05&busy_timeout_s=10``.

Adding a broker is one new module and one line in `_REGISTRY` (plus one in `_EXTRAS` when
it needs an optional dependency); its ``from_url`` can turn the options into its
constructor's arguments with `_url.take_options`.
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..errors import MetnosError
from ._url import redact_url
from .base import (
    DEFAULT_RETENTION_S,
    Broker,
    BrokerStats,
    CancelOutcome,
    DataLoss,
    HeartbeatReply,
    JobState,
    Lease,
    PurgeHook,
    PurgeReport,
    RetryOutcome,
    SubmitReceipt,
    UndoRecord,
)

__all__ = (
    "DEFAULT_RETENTION_S",
    "BadBrokerURL",
    "Broker",
    "BrokerStats",
    "CancelOutcome",
    "DataLoss",
    "HeartbeatReply",
    "JobState",
    "Lease",
    "PurgeHook",
    "PurgeReport",
    "RetryOutcome",
    "SubmitReceipt",
    "UndoRecord",
    "open_broker",
    "redact_url",
)

#: scheme -> "module:class"; the class has ``from_url(url, **options)``. Imported lazily so
#: a missing optional client (coredis) only matters to whoever asks for that scheme.
_REGISTRY: dict[str, str] = {
    "memory": "metnos_exec.brokers.memory:MemoryBroker",
    "sqlite": "metnos_exec.brokers.sqlite:SQLiteBroker",
    "redis": "metnos_exec.brokers.redis:RedisBroker",
    "rediss": "metnos_exec.brokers.redis:RedisBroker",
    "redis+cluster": "metnos_exec.brokers.redis:RedisBroker",
    "redis+sentinel": "metnos_exec.brokers.redis:RedisBroker",
}

#: Schemes whose URL lists several hosts (``host:port,host:port``): their broker reads
#: the hosts itself (the one-host check of `urlsplit` would refuse them).
_MANY_HOSTS = frozenset(("redis+cluster", "redis+sentinel"))

#: scheme -> the package extra that brings its optional client, for the error message.
_EXTRAS: dict[str, str] = {
    "redis": "redis",
    "rediss": "redis",
    "redis+cluster": "redis",
    "redis+sentinel": "redis",
}


class BadBrokerURL(MetnosError):
    """The broker URL names no known broker, is malformed, or names a broker this
    installation cannot open (its optional dependency is missing): configuration."""

    code = "E_BAD_BROKER_URL"


def open_broker(url: str, *, create: bool = True, **options: Any) -> Broker:
    """Open the broker `url` names. Options given here override the URL's query.

    Args:
        create: create the store when it is missing (workers, producers). ``False`` for
            readers: a missing store is then `BrokerUnavailable` (``E_BROKER_UNAVAILABLE``)
            instead of a new, empty queue.

    Raises:
        BadBrokerURL: unknown scheme, a malformed URL or option, or a scheme whose broker
            (or its optional dependency) is not installed.
        BrokerError: the store itself cannot be opened (`metnos_exec.errors`).
    """
    try:
        parts = urlsplit(url)
        if parts.scheme not in _MANY_HOSTS:
            parts.port  # noqa: B018 (a port that is not a number is refused here, not later)
    except ValueError as exc:  # "Invalid IPv6 URL" for a stray [, a port not a number
        raise BadBrokerURL(f"{redact_url(url)!r} is not a URL: {exc}") from None
    scheme = parts.scheme
    target = _REGISTRY.get(scheme)
    if target is None:
        known = ", ".join(f"{s}://" for s in _REGISTRY)
        # A queue file's path given where its URL goes: say the URL.
        meant = f"; did you mean sqlite:///{url}?" if not scheme and url.endswith(".db") else ""
        raise BadBrokerURL(f"unknown broker URL {redact_url(url)!r}; use one of {known}{meant}")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BadBrokerURL(_missing(scheme, module_name, exc)) from None
    cls = getattr(module, class_name)
    merged: dict[str, Any] = dict(parse_qsl(parts.query, keep_blank_values=True))
    merged.update(options)
    if not create:
        # Only when asked: a broker without a store to find need not know the option.
        merged["create"] = False
    try:
        broker: Broker = cls.from_url(url, **merged)
    except (ValueError, TypeError) as exc:  # a malformed URL, an unknown or bad option
        raise BadBrokerURL(f"{redact_url(url)}: {exc}") from None
    return broker


def _missing(scheme: str, module_name: str, exc: ImportError) -> str:
    """Why `scheme`'s broker cannot be imported, in words a newcomer can act on."""
    missing = exc.name or ""
    if missing and (missing == module_name or module_name.startswith(missing + ".")):
        return (
            f"the {scheme}:// broker is not part of this installation of metnos-exec "
            f"(no module {module_name}); upgrade metnos-exec, or use another broker"
        )
    extra = _EXTRAS.get(scheme)
    how = f"pip install 'metnos-exec[{extra}]'" if extra else f"install {missing or 'it'}"
    needs = f"the Python package {missing!r}" if missing else "an optional dependency"
    return f"the {scheme}:// broker needs {needs}, which is not installed here: {how}"
