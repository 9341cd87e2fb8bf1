"""What one connection of a job did, as its result and the logs report it."""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ("EgressRecord", "Via")

#: How the connection reached the wall: the HTTP proxy (``connect`` for CONNECT,
#: ``http`` for an absolute-form request), SOCKS5, a literal-address forward, transparent
#: capture (a fake address of the DNS stub), or a DNS question.
Via = Literal["connect", "http", "socks", "forward", "capture", "dns", "direct"]


class EgressRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One connection (or DNS question) of the job, allowed or refused.

    Attributes:
        host: the name or address the job asked for.
        port: the port it asked for (53 for a DNS question).
        allowed: whether the wall let it through.
        reason: why: the rule that allowed it, or the refusal (which says it is policy).
        via: how it reached the wall.
        address: the address the worker connected to (``None``: none).
        sent: bytes from the job to the host.
        received: bytes from the host to the job.
    """

    host: str
    port: int
    allowed: bool
    reason: str
    via: Via
    address: str | None = None
    sent: int = 0
    received: int = 0
