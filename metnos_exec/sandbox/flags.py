"""Manifest-derived walls → bubblewrap argv, as a pure function.

Everything here is a mechanical translation of a `SandboxJob` into flags; nothing runs,
nothing is probed except through injected callables, so every rule is unit-testable on a
machine without bubblewrap. The policy (which mounts, network or not) is decided upstream
by `metnos_exec.plan`; this module only decides *how* bubblewrap expresses it.
"""

from __future__ import annotations

import os
import posixpath

__all__ = ("expand_hint", "expand_hints")

_GLOB_CHARS = frozenset("*?[")


def expand_hint(hint: str, home: str) -> str:
    """Turn an ``fs:*`` hint into the host root bubblewrap should mount.

    bubblewrap mounts whole directory trees, so a glob hint is cut at its first segment
    holding a glob character; the fine grain stays with argument vetting (the first wall).
    ``~`` and ``~/...`` expand against `home` (never ``~user``: a manifest must not name
    other users' homes through us).

    Examples: ``~/notes/**`` → ``/home/u/notes``; ``/tmp/*`` → ``/tmp``;
    ``~/Pictures`` → ``/home/u/Pictures``.

    Args:
        hint: the hint as written in the manifest.
        home: the home directory ``~`` stands for.

    Returns:
        An absolute, normalised host path (no trailing slash, no ``..``).

    Raises:
        ValueError: the hint is empty, relative, uses ``~user``, or starts with a glob
            (which would mount ``/``).
    """
    if not hint:
        raise ValueError("empty fs hint")
    if hint == "~" or hint.startswith("~/"):
        path = home.rstrip("/") + hint[1:]
    elif hint.startswith("~"):
        raise ValueError(f"fs hint {hint!r}: only '~' and '~/' are expanded, not '~user'")
    else:
        path = hint
    if not posixpath.isabs(path):
        raise ValueError(f"fs hint {hint!r} is not absolute after '~' expansion")
    kept: list[str] = []
    for segment in path.split("/")[1:]:
        if _GLOB_CHARS.intersection(segment):
            break
        kept.append(segment)
    root = posixpath.normpath("/" + "/".join(kept))
    if root == "/":
        # Cutting "/*" or "/**" leaves the host root: refusing is the only honest answer,
        # mounting / would turn the files wall into decoration.
        raise ValueError(f"fs hint {hint!r} expands to the host root '/'")
    # normpath keeps a leading "//" (POSIX allows it to mean something else); fold it.
    return "/" + root.lstrip("/")


def expand_hints(hints: tuple[str, ...] | list[str], home: str | None = None) -> tuple[str, ...]:
    """`expand_hint` over several hints, de-duplicated, first occurrence order kept.

    Args:
        hints: hints as written in the manifest.
        home: the home ``~`` stands for; defaults to ``os.path.expanduser("~")``.

    Raises:
        ValueError: as `expand_hint`.
    """
    home = os.path.expanduser("~") if home is None else home
    seen: dict[str, None] = {}
    for hint in hints:
        seen.setdefault(expand_hint(hint, home), None)
    return tuple(seen)
