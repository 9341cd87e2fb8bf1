"""Capabilities per invocation: final arguments, effective capabilities, argument vetting.

Three steps turn a manifest and the caller's arguments into what the invocation may touch:

1. `final_args` checks the arguments against the schema and fills in defaults.
2. `effective_capabilities` evaluates every ``when`` clause on those final values and sorts
   the declared capabilities into active and inactive ones (never raising: a malformed
   clause is an inactive capability with a reason), and extracts the provider bindings.
3. `vet_arguments` is the application-level filter, the *first* wall: every path-like
   argument must fall under a hint of an active ``fs:*`` capability and every URL/host
   argument under a hint of an active ``network:*`` capability, or the job is refused with
   `CapabilityDenied` before anything is launched. The kernel sandbox is the second wall;
   neither replaces the other.

Decisions worth knowing (each tested in ``tests/test_capabilities.py``):

* **when values** are compared as strings: a final value of type string is itself, a
  boolean is ``"true"`` / ``"false"`` (the TOML/JSON spelling, so ``values = ["true"]``
  matches ``true``), an integer is its decimal form. A ``when`` may only name an argument of
  type string, integer or boolean; any other type makes the clause malformed (floats,
  arrays and objects have no single honest string form).
* **Provider bindings** are written ``[[capabilities]] name = "provider:access"``,
  ``hints = ["google_mail"]``: each hint names one skill, and only skills in
  `PROVIDER_SKILLS` bind. Any other claim grants nothing and is reported as inactive.
* **Path vetting** uses glob semantics per path segment: ``*``, ``?`` and ``[...]`` match
  inside one segment, ``**`` matches any number of segments (zero included, so
  ``~/notes/**`` admits ``~/notes`` itself). A hint without glob characters admits exactly
  that path, nothing below it (write ``dir/**`` for a tree). The argument is resolved with
  `os.path.realpath` (symlinks followed; for a path that does not exist yet, its existing
  part is resolved and the rest is normalised), so neither a symlink nor ``..`` can lead
  out of a hint. The hint's literal prefix (its folder) is taken as written, with ``~`` the
  job's real home, and refused with ``E_SYMLINKED_FOLDER`` when a symlink stands on the
  way: a hint's folder is what it names, never what a link (maybe planted by another job)
  points at (`metnos_exec.sandbox.mount_sources`).
* **Which arguments are vetted**: arguments declared ``format = "path"`` / ``"url"`` /
  ``"host"``; and, as defence in depth, any *undeclared* string (at any depth inside arrays
  and objects) that looks like a path (starts with ``/``, ``~`` or ``file:``), like a
  relative path climbing with dot segments (see below) or like a URL (``scheme://...``).
  An argument declared ``format = "text"`` is free text and is never vetted (a message that
  happens to begin with ``/`` must not be mistaken for a path).
* **Relative paths are refused**, declared or not: the executor's working folder is its
  own code folder (and on the direct arm, the host's), so ``../../etc/x`` would mean
  whatever that folder makes of it, never what the caller meant. An undeclared string is
  taken for a relative path when it equals ``.`` or ``..``, starts with ``./`` or ``../``,
  contains ``/../`` or ends with ``/..``; a plain relative name (``notes/a.md``) is not
  recognised (too many sentences contain a slash): declare such arguments
  ``format = "path"``, and then anything not absolute, ``~`` or ``file:`` is refused.
* **Rewriting**: a declared ``path`` argument is handed to the executor as the resolved
  absolute path (so ``~`` and symlinks mean inside the sandbox what they meant here, where
  mounts are made at resolved paths too); undeclared strings are vetted but passed as given.
* **URLs**: the scheme must equal the mode of an active network capability
  (``network:https`` admits ``https://`` only), the host must match one of its hints; a
  hint is a host name, ``*.example.com`` (any subdomain, at any depth, not the apex) or
  ``*`` (any host), optionally with ``:port``. URLs with credentials, whitespace, control
  characters or backslashes are refused outright (parsers disagree about them). A provider
  binding opens the network for the kernel wall but admits no URL argument.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from fnmatch import fnmatchcase
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import msgspec

from .errors import BadArguments, CapabilityDenied, MissingFolder
from .manifest import ArgSpec, Manifest
from .sandbox.flags import expand_hint
from .sandbox.mount_sources import check_folder

__all__ = (
    "PROVIDER_SKILLS",
    "Capability",
    "EffectiveCapabilities",
    "InactiveCapability",
    "VettedArgs",
    "VettedValue",
    "effective_capabilities",
    "final_args",
    "match_host",
    "match_path",
    "require_hint_folders",
    "resolve_path",
    "vet_arguments",
)

#: The fixed vocabulary of provider skills a ``provider:access`` capability may bind.
PROVIDER_SKILLS: frozenset[str] = frozenset(
    {"google_mail", "google_calendar", "microsoft_outlook", "github"}
)

#: Capability kinds this module gives meaning to; anything else is kept but grants nothing.
_FS_MODES = frozenset({"read", "write"})


class Capability(msgspec.Struct, frozen=True):
    """An effective (active) capability of one invocation."""

    name: str
    kind: str
    mode: str
    hints: tuple[str, ...] = ()


class InactiveCapability(msgspec.Struct, frozen=True):
    """A declared capability (or a part of one) that grants nothing here, and why."""

    name: str
    reason: str


class EffectiveCapabilities(msgspec.Struct, frozen=True):
    """What one invocation may use.

    Attributes:
        active: capabilities whose ``when`` matched (or that have none).
        inactive: what grants nothing, with reasons (for the result and the logs).
        provider_bindings: valid provider skills (each in `PROVIDER_SKILLS`).
        unknown_kinds: names of active capabilities this module gives no meaning to.
    """

    active: tuple[Capability, ...] = ()
    inactive: tuple[InactiveCapability, ...] = ()
    provider_bindings: tuple[str, ...] = ()
    unknown_kinds: tuple[str, ...] = ()

    def of(self, kind: str, mode: str | None = None) -> tuple[Capability, ...]:
        """Active capabilities of `kind` (and `mode`, when given)."""
        if not self.active:  # most executors declare few kinds; none at all is common
            return ()
        return tuple(c for c in self.active if c.kind == kind and (mode is None or c.mode == mode))

    @property
    def network(self) -> bool:
        """Whether the kernel wall should let the guest use the network."""
        return bool(self.of("network") or self.provider_bindings)

    @property
    def server_pinned(self) -> bool:
        """A provider binding pins the job to the server (never sent to a device)."""
        return bool(self.provider_bindings)

    @property
    def fs_write(self) -> bool:
        return bool(self.of("fs", "write"))


# --- final arguments ------------------------------------------------------------------

_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
}


def _type_ok(spec: ArgSpec, value: Any) -> bool:
    # bool is an int subclass in Python; JSON keeps them apart and so do we.
    if isinstance(value, bool) and spec.type != "boolean":
        return False
    return isinstance(value, _PY_TYPES[spec.type])


def _same(a: Any, b: Any) -> bool:
    """Equality that keeps booleans apart from numbers (``True == 1`` in Python)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")
_BOOLEAN_TEXT = {"true": True, "false": False}
_ANY_JSON = msgspec.json.Decoder()


def _from_text(manifest: Manifest, name: str, spec: ArgSpec, text: str) -> Any:
    """Convert command-line text to the type `spec` declares (see ``Job.text_args``)."""
    stripped = text.strip()
    value: Any = text
    if spec.type == "integer" and _INTEGER_TEXT.fullmatch(stripped):
        value = int(stripped)
    elif spec.type == "boolean" and stripped.lower() in _BOOLEAN_TEXT:
        value = _BOOLEAN_TEXT[stripped.lower()]
    elif spec.type in ("number", "array", "object"):
        try:
            value = _ANY_JSON.decode(stripped)
        except Exception:  # not JSON (or too deep to decode): said below
            value = text
        if spec.type == "number" and isinstance(value, float) and not math.isfinite(value):
            value = text
    if spec.type != "string" and not _type_ok(spec, value):
        raise BadArguments(
            f"{manifest.name}: argument `{name}` must be of type {spec.type}; the text "
            f"{text!r:.80} does not convert to it"
        )
    return value


def final_args(
    manifest: Manifest, args: Mapping[str, Any], *, text_args: Collection[str] = ()
) -> dict[str, Any]:
    """Check `args` against the manifest's schema and apply defaults.

    An explicit JSON ``null`` counts as absent (the default applies), because agent loops
    commonly send ``null`` for "not given".

    Args:
        manifest: the executor's manifest.
        args: the caller's arguments.
        text_args: names of arguments given as command-line text (``Job.text_args``):
            a string value of one is converted to the type its schema declares first
            (``"3"`` to 3 for an ``integer``, ``"true"`` to True for a ``boolean``, JSON
            text for ``number``, ``array`` and ``object``; a ``string`` stays as it is).

    Returns:
        A new dict: every given argument, plus every absent one that has a default.

    Raises:
        BadArguments: an unknown argument, a missing required one, a wrong type (or text
            that does not convert to it), or a value outside the enum. The message names
            the argument.
    """
    if not isinstance(args, Mapping):
        raise BadArguments(f"{manifest.name}: arguments must be an object, got {type(args)}")
    unknown = sorted(str(k) for k in args if k not in manifest.args)
    if unknown:
        known = ", ".join(sorted(manifest.args)) or "none"
        raise BadArguments(
            f"{manifest.name}: unknown argument(s) {', '.join(unknown)}; declared: {known}"
        )
    out: dict[str, Any] = {}
    for name, spec in manifest.args.items():
        value = args.get(name)
        if value is None:
            if spec.required:
                raise BadArguments(f"{manifest.name}: argument `{name}` is required")
            if spec.default is None:
                continue
            value = spec.default
        elif name in text_args and isinstance(value, str):
            value = _from_text(manifest, name, spec, value)
        if not _type_ok(spec, value):
            raise BadArguments(
                f"{manifest.name}: argument `{name}` must be of type {spec.type}, "
                f"got {type(value).__name__} {value!r:.80}"
            )
        if spec.enum is not None and not any(_same(value, e) for e in spec.enum):
            raise BadArguments(
                f"{manifest.name}: argument `{name}` = {value!r:.80} is not one of "
                f"{list(spec.enum)}"
            )
        out[name] = value
    return out


# --- effective capabilities -----------------------------------------------------------


def when_string(value: Any) -> str | None:
    """The string a ``when`` clause compares `value` with, or None if it has none."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    return None


def _check_when(manifest: Manifest, when: Any, final: Mapping[str, Any]) -> str | None:
    """None if `when` holds for `final`, else the reason the capability is inactive."""
    if not isinstance(when, Mapping):
        return f"malformed when: expected {{arg, values}}, got {type(when).__name__}"
    keys = set(when)
    if keys != {"arg", "values"}:
        return f"malformed when: keys must be exactly arg, values; got {sorted(map(str, keys))}"
    arg, values = when["arg"], when["values"]
    if not isinstance(arg, str) or arg not in manifest.args:
        return f"malformed when: arg {arg!r} is not a declared argument"
    spec = manifest.args[arg]
    if spec.type not in ("string", "integer", "boolean"):
        return f"malformed when: arg {arg!r} has type {spec.type}, not string/integer/boolean"
    if (
        not isinstance(values, list | tuple)
        or not values
        or not all(isinstance(v, str) for v in values)
    ):
        return f"malformed when: values must be a non-empty list of strings, got {values!r}"
    if spec.enum is not None:
        allowed = {when_string(e) for e in spec.enum}
        stray = [v for v in values if v not in allowed]
        if stray:
            return f"malformed when: values {stray} are not in the enum of {arg!r}"
    if arg not in final:
        return f"when: argument {arg!r} is absent and has no default"
    current = when_string(final[arg])
    if current not in values:
        return f"when: {arg} = {current!r} is not one of {list(values)}"
    return None


def effective_capabilities(
    manifest: Manifest, final_args: Mapping[str, Any]
) -> EffectiveCapabilities:
    """Evaluate the manifest's capabilities for one invocation. Never raises.

    Args:
        manifest: the executor's manifest.
        final_args: the output of `final_args` (defaults already applied).
    """
    active: list[Capability] = []
    inactive: list[InactiveCapability] = []
    bindings: list[str] = []
    unknown: list[str] = []
    for spec in manifest.capabilities:
        if spec.when is not None:
            reason = _check_when(manifest, spec.when, final_args)
            if reason is not None:
                inactive.append(InactiveCapability(spec.name, reason))
                continue
        cap = Capability(spec.name, spec.kind, spec.mode, tuple(spec.hints))
        if cap.kind == "provider":
            if cap.mode != "access":
                inactive.append(
                    InactiveCapability(cap.name, "only provider:access binds a provider skill")
                )
                continue
            if not cap.hints:
                inactive.append(InactiveCapability(cap.name, "names no provider skill"))
                continue
            valid = [h for h in cap.hints if h in PROVIDER_SKILLS]
            for h in cap.hints:
                if h not in PROVIDER_SKILLS:
                    inactive.append(
                        InactiveCapability(
                            cap.name, f"skill {h!r} is not in PROVIDER_SKILLS; grants nothing"
                        )
                    )
            if not valid:
                continue
            for h in valid:
                if h not in bindings:
                    bindings.append(h)
            cap = Capability(cap.name, cap.kind, cap.mode, tuple(valid))
        elif not (cap.kind == "network" or (cap.kind == "fs" and cap.mode in _FS_MODES)):
            unknown.append(cap.name)
        active.append(cap)
    return EffectiveCapabilities(
        active=tuple(active),
        inactive=tuple(inactive),
        provider_bindings=tuple(bindings),
        unknown_kinds=tuple(unknown),
    )


# --- glob matching --------------------------------------------------------------------

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


_HOST_LABEL = re.compile(r"^[a-z0-9_\-.]+$|^[0-9a-f:.]+$")


def match_host(hint: str, host: str, port: int | None = None) -> bool:
    """Whether `host` (and `port`, if any) falls under a network `hint`.

    A hint is ``host``, ``*.domain`` (any subdomain at any depth, not the apex) or ``*``,
    optionally followed by ``:port`` (then the port must be equal). IPv6 literals go in
    brackets: ``[::1]:8080``.
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
    if hint_port is not None and hint_port != port:
        return False
    if hint == "*":
        return True
    if hint.startswith("*."):
        suffix = hint[1:]
        return host.endswith(suffix) and len(host) > len(suffix)
    return host == hint


# --- vetting --------------------------------------------------------------------------


class VettedValue(msgspec.Struct, frozen=True):
    """One argument value that vetting checked, and the hint that admitted it."""

    arg: str
    kind: Literal["path", "url", "host"]
    value: str
    resolved: str
    hint: str


class VettedArgs(msgspec.Struct, frozen=True):
    """Arguments that passed vetting.

    Attributes:
        args: what the executor receives (declared paths rewritten to resolved form).
        checked: every value vetting looked at, with the hint that admitted it.
    """

    args: dict[str, Any]
    checked: tuple[VettedValue, ...] = ()


_DEFAULT_PORTS = {"http": 80, "https": 443}
_URL_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def _walk_strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _walk_strings(v, f"{where}[{i}]")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk_strings(v, f"{where}.{k}")


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", "~", "file:"))


def _looks_like_relative_path(s: str) -> bool:
    """A relative path that moves with dot segments (``./x``, ``../x``, ``a/../b``, ``..``)."""
    return s in (".", "..") or s.startswith(("./", "../")) or "/../" in s or s.endswith("/..")


_RELATIVE = (
    "is a relative path, which has no meaning for the executor (it runs in its own folder, "
    "not the caller's); pass an absolute or ~/ path"
)


class _Vetter:
    def __init__(self, manifest: Manifest, effective: EffectiveCapabilities, home: str) -> None:
        self.manifest = manifest
        self.home = home
        self.fs_hints: list[tuple[str, str]] = []  # (hint as written, resolved pattern)
        self.bad_fs_hints: list[str] = []
        for cap in effective.of("fs"):
            if cap.mode not in _FS_MODES:
                continue
            for hint in cap.hints:
                try:
                    self.fs_hints.append((hint, _resolve_hint(hint, home)))
                except ValueError:
                    self.bad_fs_hints.append(hint)
        self.net = [(c.mode, h) for c in effective.of("network") for h in c.hints]
        self.checked: list[VettedValue] = []

    def _deny(self, where: str, value: str, why: str, against: str) -> CapabilityDenied:
        return CapabilityDenied(
            f"{self.manifest.name}: argument `{where}` = {value!r:.200} {why}; "
            f"checked against {against}"
        )

    def _fs_against(self) -> str:
        ignored = (
            f" (ignored, not absolute: {', '.join(self.bad_fs_hints)})" if self.bad_fs_hints else ""
        )
        if not self.fs_hints:
            return "no active fs:* hint" + ignored
        return "fs hints " + ", ".join(f"{h} (→ {r})" for h, r in self.fs_hints) + ignored

    def path(self, where: str, value: str) -> str:
        if not _looks_like_path(value):
            raise self._deny(where, value, _RELATIVE, self._fs_against())
        try:
            resolved = resolve_path(value, self.home)
        except ValueError as exc:
            raise self._deny(
                where, value, f"is not a usable path ({exc})", self._fs_against()
            ) from exc
        for hint, pattern in self.fs_hints:
            if match_path(pattern, resolved):
                self.checked.append(VettedValue(where, "path", value, resolved, hint))
                return resolved
        raise self._deny(
            where,
            value,
            f"(resolved {resolved}) is outside every active fs hint",
            self._fs_against(),
        )

    def _net_against(self, scheme: str | None = None) -> str:
        hints = [f"network:{m} {h}" for m, h in self.net if scheme is None or m == scheme]
        if not hints:
            what = f"network:{scheme}" if scheme else "network:*"
            return f"no active {what} hint"
        return ", ".join(hints)

    def url(self, where: str, value: str) -> None:
        if any(c.isspace() or ord(c) < 0x20 or c == "\x7f" or c == "\\" for c in value):
            raise self._deny(
                where,
                value,
                "holds whitespace, control characters or a backslash",
                self._net_against(),
            )
        try:
            parts = urlsplit(value)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise self._deny(
                where, value, f"is not a valid URL ({exc})", self._net_against()
            ) from exc
        scheme = parts.scheme.lower()
        # A hint with a port compares against the port the client will really use.
        port = port if port is not None else _DEFAULT_PORTS.get(scheme)
        if scheme == "file":
            self.path(where, value)
            return
        if not host:
            raise self._deny(where, value, "names no host", self._net_against(scheme))
        if parts.username is not None or parts.password is not None:
            raise self._deny(
                where, value, "carries credentials in the URL", self._net_against(scheme)
            )
        for mode, hint in self.net:
            if mode == scheme and match_host(hint, host, port):
                self.checked.append(VettedValue(where, "url", value, host, hint))
                return
        raise self._deny(
            where,
            value,
            f"(scheme {scheme}, host {host}) is outside every active network hint",
            self._net_against(scheme),
        )

    def host(self, where: str, value: str) -> None:
        text = value.strip()
        host, port = text, None
        if text.startswith("["):
            end = text.find("]")
            host = text[1:end] if end > 0 else text
            tail = text[end + 1 :] if end > 0 else ""
            port = int(tail[1:]) if tail.startswith(":") and tail[1:].isdigit() else None
        elif text.count(":") == 1:
            h, _, p = text.partition(":")
            if p.isdigit():
                host, port = h, int(p)
        if not host or not _HOST_LABEL.match(host.lower()):
            raise self._deny(where, value, "is not a host name", self._net_against())
        for _mode, hint in self.net:
            if match_host(hint, host, port):
                self.checked.append(VettedValue(where, "host", value, host.lower(), hint))
                return
        raise self._deny(where, value, "is outside every active network hint", self._net_against())

    def undeclared(self, where: str, value: str) -> None:
        if _URL_LIKE.match(value):
            self.url(where, value)
        elif _looks_like_path(value) or _looks_like_relative_path(value):
            self.path(where, value)


def vet_arguments(
    manifest: Manifest,
    final_args: Mapping[str, Any],
    effective: EffectiveCapabilities,
    *,
    home: str,
) -> VettedArgs:
    """The first wall: refuse the job unless every path/URL/host argument is covered.

    Args:
        manifest: the executor's manifest.
        final_args: from `final_args`.
        effective: from `effective_capabilities`.
        home: what ``~`` stands for (the job's home).

    Returns:
        The arguments the executor receives, and what was checked.

    Raises:
        CapabilityDenied: naming the argument, the value and the hints it was checked
            against. Nothing may be launched after this.
    """
    v = _Vetter(manifest, effective, home)
    out: dict[str, Any] = {}
    for name, value in final_args.items():
        spec = manifest.args.get(name, ArgSpec())
        fmt = spec.format
        if fmt == "text":
            out[name] = value
        elif fmt == "path":
            if isinstance(value, str):
                out[name] = v.path(name, value)
            else:
                # An array of paths: each element is vetted and rewritten.
                items = list(value) if isinstance(value, list | tuple) else None
                if items is None or not all(isinstance(i, str) for i in items):
                    raise v._deny(name, repr(value), "is not a path string", v._fs_against())
                out[name] = [v.path(f"{name}[{i}]", s) for i, s in enumerate(items)]
        elif fmt in ("url", "host"):
            check = v.url if fmt == "url" else v.host
            strings = list(_walk_strings(value, name))
            if not strings:
                raise v._deny(name, repr(value), f"is not a {fmt} string", v._net_against())
            for where, s in strings:
                check(where, s)
            out[name] = value
        else:
            for where, s in _walk_strings(value, name):
                v.undeclared(where, s)
            out[name] = value
    return VettedArgs(args=out, checked=tuple(v.checked))


def require_hint_folders(executor: str, checked: Iterable[VettedValue], home: str) -> None:
    """Refuse a vetted path whose admitting hint names a folder that does not exist.

    The kernel wall mounts each ``fs:*`` hint's folder (the hint cut at its first glob,
    `sandbox.flags.expand_hint`) and can only mount what exists; without this check a
    newcomer without ``~/notes`` gets "Read-only file system" from inside the guest instead
    of the one step that fixes it. Checked on every arm, so a job behaves the same
    whichever arm runs it.

    Args:
        executor: the executor's name (for the message).
        checked: `VettedArgs.checked` from `vet_arguments`.
        home: what ``~`` stands for.

    Raises:
        MissingFolder: naming the argument, its value, the hint and the missing folder.
    """
    for item in checked:
        if item.kind != "path":
            continue
        try:
            root = expand_hint(item.hint, home)
        except ValueError:
            continue  # `load_manifest` refuses such hints; a hand-built manifest mounts nothing
        if not check_folder(root):
            raise MissingFolder(
                f"{executor}: argument `{item.arg}` = {item.value!r:.200} is under hint "
                f"{item.hint!r}, but {root} does not exist, so it cannot be mounted; "
                "create it first"
            )
