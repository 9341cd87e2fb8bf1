"""Steps 1 and 2 of `capabilities`: the final arguments, and the effective capabilities.

`final_args` checks the caller's arguments against the manifest's schema (converting
command-line text by it) and fills in defaults; `effective_capabilities` evaluates every
``when`` clause on those final values and sorts the declared capabilities into active
and inactive ones, never raising, and extracts the provider bindings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from ..errors import BadArguments
from ..manifest import _PY_TYPES, ArgSpec, Manifest

__all__ = (
    "PROVIDER_SKILLS",
    "Capability",
    "EffectiveCapabilities",
    "InactiveCapability",
    "effective_capabilities",
    "final_args",
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
        out[name] = _conform(manifest.name, name, spec, value)
    return out


def _conform(executor: str, at: str, spec: ArgSpec, value: Any) -> Any:
    """`value` (of `spec`'s type already) checked against the nested `items` and
    `properties`; an object's optional property given as ``null`` is dropped (absent, as a
    top-level ``null`` is: strict tool schemas send ``null`` for "not given")."""
    if spec.items is not None and isinstance(value, list | tuple):
        return [_nested(executor, f"{at}[{i}]", spec.items, v) for i, v in enumerate(value)]
    if spec.properties is None or not isinstance(value, Mapping):
        return value
    unknown = sorted(str(k) for k in value if k not in spec.properties)
    if unknown:
        raise BadArguments(
            f"{executor}: argument `{at}` has unknown key(s) {', '.join(unknown)}; "
            f"declared: {', '.join(sorted(spec.properties)) or 'none'}"
        )
    out: dict[str, Any] = {}
    for key, sub in spec.properties.items():
        if value.get(key) is None:
            if sub.required:
                raise BadArguments(f"{executor}: argument `{at}.{key}` is required")
            continue
        out[key] = _nested(executor, f"{at}.{key}", sub, value[key])
    return out


def _nested(executor: str, at: str, spec: ArgSpec, value: Any) -> Any:
    if not _type_ok(spec, value):
        raise BadArguments(
            f"{executor}: argument `{at}` must be of type {spec.type}, "
            f"got {type(value).__name__} {value!r:.80}"
        )
    if spec.enum is not None and not any(_same(value, e) for e in spec.enum):
        raise BadArguments(
            f"{executor}: argument `{at}` = {value!r:.80} is not one of {list(spec.enum)}"
        )
    return _conform(executor, at, spec, value)


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
