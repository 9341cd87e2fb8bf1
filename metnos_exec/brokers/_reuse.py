"""Whether a second submit is the same job (idempotency keys, ids) and the message of a
queued job's cancel: shared by every broker (re-exported by `metnos_exec.brokers.base`)."""

from __future__ import annotations

import msgspec

from ..errors import IdempotencyConflict
from ..messages import Job

__all__ = ("check_idempotent_reuse", "queued_cancel_message")


def _canonical_args(args: dict[str, object]) -> object:
    # Through JSON, as the wire sees them: a tuple and a list are the same argument, and a
    # job read back from a store compares equal to the one submitted.
    return msgspec.json.decode(msgspec.json.encode(args))


def queued_cancel_message(attempt: int) -> str:
    """The message of the ``cancelled`` result a queued job gets: ``attempt`` deliveries
    had started (a job waiting for a retry), or none. (``redis.lua`` says the same.)"""
    if attempt <= 0:
        return "cancelled before it started"
    return f"cancelled while waiting to be retried, after {attempt} attempt(s)"


def check_idempotent_reuse(original: Job, new: Job, *, by_id: bool = False) -> None:
    """Accept `new` as a duplicate of `original` (same idempotency key, or with `by_id`
    the same job id) only when it asks for the same thing: same executor, same
    arguments. Other fields (timeout, priority, correlation id, ...) may differ: they say
    how, not what.

    Raises:
        IdempotencyConflict: the key (or id) already names a job with another executor or
            other arguments; returning its id would silently drop what the caller asked
            for.
    """
    if original.executor == new.executor and _canonical_args(original.args) == _canonical_args(
        new.args
    ):
        return
    what = "executor" if original.executor != new.executor else "arguments"
    if by_id:
        raise IdempotencyConflict(
            f"job id {new.id!r} already names a job ({original.executor}) with different "
            f"{what}; use a new id for a different job",
            original_job_id=original.id,
        )
    raise IdempotencyConflict(
        f"idempotency key {new.idempotency_key!r} already names job {original.id} "
        f"({original.executor}) with different {what}; use a new key for a different job",
        original_job_id=original.id,
    )
