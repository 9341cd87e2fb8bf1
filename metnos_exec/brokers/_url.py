"""A broker URL's options, turned into the keyword arguments of its broker's constructor.

`open_broker` hands a broker's ``from_url`` the URL's query (text: ``?busy_timeout_s=10``)
merged with the options its caller gave in Python (any value). Each broker says which
options it takes and of what kind; `take_options` converts those (a number with
``float``, a name with ``str``, a flag as `flag` reads it, an object as given) and refuses
the rest by name, so that a mistyped option is an error rather than silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ("flag", "redact_url", "take_options")


def redact_url(url: str) -> str:
    """`url` with its password (``redis://:secret@host``) written as ``***``: what
    messages, logs and ``status`` show of a broker URL. A URL that does not parse is
    shown without what could be a password (everything up to the last ``@``)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else url
    if not password:
        return url
    user, _, host = parts.netloc.rpartition("@")
    name = user.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{name}:***@{host}"))


def flag(value: object) -> bool:
    """A yes/no option: text (from a URL) is false when it says ``0``, ``false``, ``no``
    or ``off`` (any case, spaces around ignored) and true otherwise; any other value is
    its truth."""
    if isinstance(value, str):
        value = value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


def _seconds(value: object) -> float:
    """A duration or an interval: a finite number above zero (a zero poll interval
    spins, a negative timeout was read as "cannot reach Redis" with Redis up)."""
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"must be a number of seconds above 0, got {value!r}")
    return number


def _count(value: object) -> int:
    """A count: a whole number, 0 or more."""
    text = str(value).strip()
    if isinstance(value, bool) or not (isinstance(value, int) or text.isdigit()):
        raise ValueError(f"must be a whole number, 0 or more, got {value!r}")
    number = int(text)
    if number < 0:
        raise ValueError(f"must be a whole number, 0 or more, got {value!r}")
    return number


def _name(value: object) -> str:
    """A name: not empty (``?prefix=`` quietly meant the default queue)."""
    text = str(value)
    if not text.strip():
        raise ValueError("must not be empty (leave the option out for its default)")
    return text


def take_options(
    broker: str,
    options: dict[str, Any],
    *,
    floats: Sequence[str] = (),
    strings: Sequence[str] = (),
    flags: Sequence[str] = (),
    objects: Sequence[str] = (),
    counts: Sequence[str] = (),
) -> dict[str, Any]:
    """Take the options `broker` knows out of `options`, converted by kind.

    Args:
        broker: the broker's name in the error message (``sqlite``, ``redis``).
        options: the URL's query merged with the caller's options; emptied of those
            taken.
        floats: options that are seconds (finite, above 0). strings: options that are
            names (not empty). flags: yes/no options (`flag`). objects: options passed
            as given (a clock). counts: whole numbers, 0 or more.

    Raises:
        ValueError: an option of the wrong kind (``option <name>: ...``), or options
            `broker` does not know: ``unknown <broker> broker options: [...]``.
    """
    kinds: tuple[tuple[Sequence[str], Callable[[Any], Any] | None], ...] = (
        (floats, _seconds),
        (strings, _name),
        (flags, flag),
        (objects, None),
        (counts, _count),
    )
    kwargs: dict[str, Any] = {}
    for keys, convert in kinds:
        for key in keys:
            if key in options:
                value = options.pop(key)
                try:
                    kwargs[key] = value if convert is None else convert(value)
                except ValueError as exc:
                    raise ValueError(f"option {key}: {exc}") from None
    if options:
        raise ValueError(f"unknown {broker} broker options: {sorted(options)}")
    return kwargs
