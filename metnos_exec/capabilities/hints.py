"""What a hint admits: glob matching of paths, host matching, resolving path arguments.

Used by `vetting` (step 3 of `capabilities`, whose docstring states the rules): ``fs:*``
hints are matched segment by segment against the resolved argument (`match_path`), the
hint's literal folder taken as written and refused behind a symlink (`_resolve_hint`);
``network:*`` hints against a URL's or a host argument's host and port (`match_host`).
"""

from __future__ import annotations

import os
import posixpath
from fnmatch import fnmatchcase
from urllib.parse import unquote, urlsplit

from ..sandbox.mount_sources import check_folder

__all__ = ("match_host", "match_path", "resolve_path")

_GLOB_CHARS = frozenset("*?[")


def _match_segments(pattern: list[str], path: list[str]) -> bool:
    if not pattern:
        return not path
    head = pattern[0]
    if head == "**":
        # `**` swallows zero or more whole segments.
        return any(_match_segments(pattern[1:], path[i:]) for i in range(len(path) + 1))
    if not path:
        return False
    ok = fnmatchcase(path[0], head) if _GLOB_CHARS.intersection(head) else head == path[0]
    return ok and _match_segments(pattern[1:], path[1:])


def match_path(pattern: str, path: str) -> bool:
    """Glob match of an absolute `path` against an absolute `pattern`, segment by segment.

    ``*``, ``?`` and ``[...]`` never cross ``/``; ``**`` as a whole segment matches any
    number of segments, including none. Both sides are taken as already normalised.
    """
    pat = [s for s in pattern.split("/") if s]
    # Collapse runs of `**`: they mean the same and would make matching exponential.
    collapsed: list[str] = []
    for s in pat:
        if not (s == "**" and collapsed and collapsed[-1] == "**"):
            collapsed.append(s)
    return _match_segments(collapsed, [s for s in path.split("/") if s])


def _expand_user(value: str, home: str) -> str:
    if value == "~":
        return home
    if value.startswith("~/"):
        return home.rstrip("/") + value[1:]
    if value.startswith("~"):
        raise ValueError("only '~' and '~/' are expanded, not '~user'")
    return value


def resolve_path(value: str, home: str) -> str:
    """The absolute, symlink-resolved form of a path argument.

    Accepts ``/abs``, ``~``, ``~/rel`` and ``file:///abs`` (also ``file:~/...``, which
    some callers write). The existing part of the path is resolved through symlinks and
    the remainder normalised, so ``..`` can not climb out of a symlinked folder unseen.

    Raises:
        ValueError: a relative path, ``~user``, a ``file:`` URL naming a host, or a NUL.
    """
    if "\0" in value:
        raise ValueError("contains a NUL byte")
    if value.startswith("file:"):
        parts = urlsplit(value)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URL names a host ({parts.netloc!r})")
        value = unquote(parts.path)
    value = _expand_user(value, home)
    if not posixpath.isabs(value):
        raise ValueError("is not an absolute or ~ path")
    return os.path.realpath(value)


def _resolve_hint(hint: str, home: str) -> str:
    """A hint as the pattern arguments are matched against (glob tail kept).

    Its literal prefix (the folder the kernel wall mounts) is taken as written, ``~``
    being the job's real home: a symlink on the way to it is refused, never followed
    (`sandbox.mount_sources`), so vetting admits exactly what the mount will show.

    Raises:
        ValueError: not absolute after ``~`` expansion.
        SymlinkedFolder: a component of the literal prefix is a symlink.
    """
    path = _expand_user(hint, home)
    if not posixpath.isabs(path):
        raise ValueError("not absolute after ~ expansion")
    segments = [s for s in posixpath.normpath(path).split("/") if s]
    cut = next((i for i, s in enumerate(segments) if _GLOB_CHARS.intersection(s)), None)
    literal = segments if cut is None else segments[:cut]
    tail = [] if cut is None else segments[cut:]
    root = "/" + "/".join(literal)
    check_folder(root)
    return posixpath.join(root, *tail) if tail else root


def match_host(
    hint: str, host: str, port: int | None = None, default_port: int | None = None
) -> bool:
    """Whether `host` (and `port`, if any) falls under a network `hint`.

    A hint is ``host``, ``*.domain`` (any subdomain at any depth, not the apex) or ``*``,
    optionally followed by ``:port``. IPv6 literals go in brackets: ``[::1]:8080``. The
    port rule is the network wall's (`sandbox.egress.policy_for`), so that an argument
    vetted here is one the wall lets through: a hint without a port stands for its mode's
    `default_port` (``network:https`` 443, ``network:http`` 80), and a `port`, when
    known, must be the hint's; a hint of a mode without a default that names no port
    admits no value that names one (the wall grants it no connection).
    """
    hint = hint.strip().lower()
    hint_port: int | None = None
    if hint.startswith("["):
        end = hint.find("]")
        if end < 0:
            return False
        rest = hint[end + 1 :]
        hint, hint_port_s = hint[1:end], rest[1:] if rest.startswith(":") else ""
        hint_port = int(hint_port_s) if hint_port_s.isdigit() else None
    elif hint.count(":") == 1:
        hint, _, hint_port_s = hint.partition(":")
        if not hint_port_s.isdigit():
            return False
        hint_port = int(hint_port_s)
    host = host.lower().rstrip(".")
    hint = hint.rstrip(".")
    if hint_port is None:
        hint_port = default_port
        if hint_port is None and port is not None:
            return False
    if port is not None and hint_port != port:
        return False
    if hint == "*":
        return True
    if hint.startswith("*."):
        suffix = hint[1:]
        return host.endswith(suffix) and len(host) > len(suffix)
    return host == hint
