"""Queue backends behind one seam, opened by URL.

``memory://`` (tests, embedding; in-process only: it is gone when the process ends),
``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db`` (the embedded default;
note the fourth slash: ``sqlite:///work/x.db`` is ``work/x.db`` under the current folder),
``redis://[:password@]host:port/db`` or ``rediss://...`` (TLS): Redis Streams, workers on
many machines (needs the ``redis`` extra: coredis).
Query parameters become keyword options of the broker, e.g.
``sqlite:///./metnos.db?poll_interval_s=0.05&busy_timeout_s=10``.

Adding a broker is one new module and one line in `_REGISTRY`.
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..errors import MetnosError
from .base import (
    Broker,
    BrokerStats,
    CancelOutcome,
    HeartbeatReply,
    JobState,
    Lease,
    RetryOutcome,
    SubmitReceipt,
    UndoRecord,
)

__all__ = (
    "BadBrokerURL",
    "Broker",
    "BrokerStats",
    "CancelOutcome",
    "HeartbeatReply",
    "JobState",
    "Lease",
    "RetryOutcome",
    "SubmitReceipt",
    "UndoRecord",
    "open_broker",
)

#: scheme -> "module:class"; the class has ``from_url(url, **options)``. Imported lazily so
#: a missing optional client (coredis) only matters to whoever asks for that scheme.
_REGISTRY: dict[str, str] = {
    "memory": "metnos_exec.brokers.memory:MemoryBroker",
    "sqlite": "metnos_exec.brokers.sqlite:SQLiteBroker",
    "redis": "metnos_exec.brokers.redis:RedisBroker",
    "rediss": "metnos_exec.brokers.redis:RedisBroker",
}


class BadBrokerURL(MetnosError):
    """The broker URL names no known broker or is malformed."""

    code = "E_BAD_BROKER_URL"


def open_broker(url: str, *, create: bool = True, **options: Any) -> Broker:
    """Open the broker `url` names. Options given here override the URL's query.

    Args:
        create: create the store when it is missing (workers, producers). ``False`` for
            readers: a missing store is then `BrokerUnavailable`-style ``E_BROKER_*``
            error instead of a new, empty queue.

    Raises:
        BadBrokerURL: unknown scheme, or a scheme whose broker is not available.
    """
    scheme = urlsplit(url).scheme
    target = _REGISTRY.get(scheme)
    if target is None:
        known = ", ".join(f"{s}://" for s in _REGISTRY)
        raise BadBrokerURL(f"unknown broker URL {url!r}; use one of {known}")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BadBrokerURL(f"the {scheme}:// broker is not available here: {exc}") from None
    cls = getattr(module, class_name)
    merged: dict[str, Any] = dict(parse_qsl(urlsplit(url).query))
    merged.update(options)
    if not create:
        # Only when asked: a broker without a store to find need not know the option.
        merged["create"] = False
    broker: Broker = cls.from_url(url, **merged)
    return broker
