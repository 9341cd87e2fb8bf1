"""Queue backends behind one seam, opened by URL.

``memory://`` (tests, embedding), ``sqlite:///relative/path.db`` or
``sqlite:////absolute/path.db`` (the embedded default), ``redis://host:port/db`` (later).
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
    "open_broker",
)

#: scheme -> "module:class"; the class has ``from_url(url, **options)``. Imported lazily so
#: a missing optional client (redis-py) only matters to whoever asks for that scheme.
_REGISTRY: dict[str, str] = {
    "memory": "metnos_exec.brokers.memory:MemoryBroker",
    "sqlite": "metnos_exec.brokers.sqlite:SQLiteBroker",
    "redis": "metnos_exec.brokers.redis:RedisBroker",
}


class BadBrokerURL(MetnosError):
    """The broker URL names no known broker or is malformed."""

    code = "E_BAD_BROKER_URL"


def open_broker(url: str, **options: Any) -> Broker:
    """Open the broker `url` names. Options given here override the URL's query.

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
    broker: Broker = cls.from_url(url, **merged)
    return broker
