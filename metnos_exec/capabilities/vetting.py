"""Step 3 of `capabilities`: argument vetting, the first wall.

`vet_arguments` refuses the job (`CapabilityDenied`) unless every path-like argument falls
under a hint of an active ``fs:*`` capability and every URL or host argument under a hint
of an active ``network:*`` capability, before anything is launched; declared paths are
handed on resolved. `require_hint_folders` then refuses a path whose hint's folder does
not exist (the kernel wall could not mount it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from ..errors import CapabilityDenied, MissingFolder
from ..manifest import ArgSpec, Manifest
from ..sandbox.flags import expand_hint
from ..sandbox.mount_sources import check_folder
from .effective import _FS_MODES, EffectiveCapabilities
from .hints import _resolve_hint, match_host, match_path, resolve_path

__all__ = ("VettedArgs", "VettedValue", "require_hint_folders", "vet_arguments")

_HOST_LABEL = re.compile(r"^[a-z0-9_\-.]+$|^[0-9a-f:.]+$")


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
            if mode == scheme and match_host(hint, host, port, _DEFAULT_PORTS.get(mode)):
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
        for mode, hint in self.net:
            if match_host(hint, host, port, _DEFAULT_PORTS.get(mode)):
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
