"""Executor manifests: `manifest.toml` decoded into frozen msgspec Structs.

A bad manifest is rejected at load with a message naming the file, the field and the
problem. `when` clauses are kept raw on purpose: a malformed clause makes its capability
inactive and is reported per invocation (see `capabilities`), it never stops a load.

The last check of a load is the ``packable`` claim (`check_packable`): a packable
executor's code, read by `source_imports` without running it, must import only the
standard library and its own files. It lives here, not in `devices.packability` (which
holds the rest of that contract and re-exports it), so that loading a manifest needs
nothing from the layers above.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from .errors import BadManifest, UnknownExecutor
from .sandbox.flags import expand_hint
from .source_imports import imported_modules

__all__ = (
    "ArgSpec",
    "CapabilitySpec",
    "Executor",
    "ExecutorRegistry",
    "Limits",
    "Manifest",
    "PYTHON_WASM_ABSENT",
    "check_packable",
    "load_manifest",
)

ArgType = Literal["string", "integer", "number", "boolean", "array", "object"]
Runtime = Literal["python", "wasm", "wasm-python"]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]{0,63}$")
_CAP_RE = re.compile(r"^[a-z][a-z0-9_\-]*:[a-z0-9_\-\*]+$")

#: What ``~`` stands for while a hint is checked at load (the real home is per job).
_PLACEHOLDER_HOME = "/home/metnos-manifest-check"
_PORT = r"(?::(?:[1-9][0-9]{0,4}))?"
_LABEL = r"[a-z0-9_](?:[a-z0-9_\-]{0,61}[a-z0-9_])?"
#: ``*``, ``host``, ``*.domain`` (labels of letters, digits, ``-``, ``_``), or ``[ipv6]``;
#: each but ``*`` optionally with ``:port``. Matched case-insensitively.
_NET_HINT_RE = re.compile(
    rf"^(?:\*|(?:\*\.)?{_LABEL}(?:\.{_LABEL})*\.?{_PORT}|\[[0-9a-f:.]+\]{_PORT})$",
    re.IGNORECASE,
)

#: Standard-library modules (public names of `sys.stdlib_module_names`) that the pinned
#: python.wasm (CPython 3.12.0 for WASI, `PYTHON_WASM_SHA256`) does not have or cannot
#: import, measured by `find_spec` and `import_module` inside it. A ``wasm-python``
#: executor gets no dry run, so its load check refuses these by name.
PYTHON_WASM_ABSENT: Final = frozenset(
    {
        "antigravity", "asynchat", "asyncore", "ctypes", "curses", "distutils", "ensurepip",
        "fcntl", "grp", "idlelib", "imp", "lib2to3", "lzma", "mmap", "msilib", "msvcrt",
        "multiprocessing", "nis", "nt", "ossaudiodev", "pwd", "pydoc_data", "readline",
        "resource", "rlcompleter", "smtpd", "spwd", "ssl", "syslog", "termios", "tkinter",
        "turtle", "turtledemo", "uu", "venv", "webbrowser", "winreg", "winsound", "xdrlib",
    }
)  # fmt: skip


class ArgSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One argument of the executor's schema (or, nested, one element or property of it).

    The argument language is a subset of JSON Schema, and `capabilities.final_args`
    enforces all of it: each field below has its JSON Schema meaning (`toolspec` writes it
    out), and a manifest using it in a way that has none is refused at load.

    * `type`, `description`, `enum`: the JSON Schema keywords (a value must be of the type,
      and one of the enum's values when there is one; an ``integer`` is a JSON integer,
      ``1.0`` is refused).
    * `default`: applied by the worker when the argument is absent or ``null`` (top-level
      arguments only: the worker fills in no default inside a value).
    * `required`: the argument is listed in its object's ``required``.
    * `items` (``type = "array"`` only): the schema of every element.
    * `properties` (``type = "object"`` only): the object's properties, each with its own
      `required`; no other key is accepted (``additionalProperties: false``), and a
      ``null`` property counts as absent, as at the top. An ``object`` without
      `properties` takes any object, an ``array`` without `items` any elements.

    `format` is not JSON Schema's (it exports as nothing): it tells argument vetting what a
    top-level value designates: ``"path"`` values must fall under an active ``fs:*`` hint,
    ``"url"`` / ``"host"`` values under a ``network:*`` hint; ``"text"`` marks free text
    that vetting must not mistake for a path or URL (without a format, a string that looks
    like a path or URL is vetted as one, at any depth, as defence in depth).
    """

    type: ArgType = "string"
    description: str = ""
    enum: tuple[Any, ...] | None = None
    default: Any = None
    required: bool = False
    format: Literal["path", "url", "host", "text"] | None = None
    items: ArgSpec | None = None
    properties: dict[str, ArgSpec] | None = None


class CapabilitySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A declared capability: ``kind:mode`` plus hints and an optional ``when`` clause."""

    name: str
    hints: tuple[str, ...] = ()
    when: Any = None

    @property
    def kind(self) -> str:
        return self.name.split(":", 1)[0]

    @property
    def mode(self) -> str:
        return self.name.split(":", 1)[1]


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    timeout_s: float = 30.0
    memory_mb: int = 256
    fuel: int | None = None
    pids: int = 64
    cpu_s: int | None = None
    file_size_mb: int = 64
    open_files: int = 256
    output_kb: int = 1024
    #: Staging budget: what the job may write into its writable folders (see staging).
    disk_mb: int = 256
    #: The network wall's bounds: connections open at once, and megabytes relayed in
    #: both directions over the job's life (`sandbox.egress.EgressLimits`).
    net_connections: int = 32
    net_mb: int = 1024


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    version: str
    runtime: Runtime
    entry: str
    description: str = ""
    args: dict[str, ArgSpec] = msgspec.field(default_factory=dict)
    capabilities: tuple[CapabilitySpec, ...] = ()
    limits: Limits = msgspec.field(default_factory=Limits)
    #: Whether the executor can be shipped to a remote device: it imports only the standard
    #: library and its own files (checked at load, see `packability`). ``false`` keeps it
    #: on server workers.
    packable: bool = True
    #: Whether the executor mutates user files (refused under ``read_only`` autonomy even
    #: when it declares no ``fs:write``). Defaults to "has an fs:write capability".
    mutating: bool | None = None
    #: Whether running it twice with the same arguments does no more than running it once
    #: (an agent may retry it freely; MCP's ``idempotentHint``).
    idempotent: bool = False
    #: The JSON output's schema, when the author declares one: the properties of the one
    #: object the executor writes, in the argument language (``[output.text]``, with
    #: ``type``, ``description``, ``enum``, ``required``, ``items``, ``properties``; no
    #: ``default`` and no ``format``, which mean something for arguments only). Exported as
    #: MCP's ``outputSchema`` (`toolspec.output_schema`); the worker does not check it,
    #: the MCP server does before it calls an output structured content of that schema.
    output: dict[str, ArgSpec] | None = None
    #: Warm bwrap sandboxes to keep started for this executor's jobs (issue 22,
    #: `metnos_exec.sandbox._bwrap_warm`): each serves one job; ``None``: the worker's
    #: default (``worker --warm N``, else 0).
    warm: Annotated[int, msgspec.Meta(ge=0, le=64)] | None = None
    #: ``"approve"``: every job's staged changes wait for an approval (``metnos-exec
    #: approve JOB``; README, "Approval gates"); ``"auto"``: committed when the job succeeds
    #: (a job may still ask, `Job.commit`).
    commit: Literal["auto", "approve"] = "auto"

    @property
    def is_mutating(self) -> bool:
        if self.mutating is not None:
            return self.mutating
        return any(c.name == "fs:write" for c in self.capabilities)


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
}


def _default_fits(spec: ArgSpec) -> bool:
    return _fits(spec.type, spec.default)


def _fits(type_: str, value: Any) -> bool:
    # bool is an int subclass in Python; TOML and JSON keep them apart, and so do we.
    if isinstance(value, bool) and type_ != "boolean":
        return False
    return isinstance(value, _PY_TYPES[type_])


def _arg_problem(
    spec: ArgSpec, at: str, *, top: bool, item: bool = False
) -> tuple[str, str] | None:
    """(field, problem) for the first construct of `spec` without a JSON Schema meaning the
    worker enforces, or None. `top`: a top-level argument; `item`: an array's `items`."""
    if spec.default is not None:
        if not top:
            return f"{at}.default", "a default applies to top-level arguments only"
        if not _default_fits(spec):
            return f"{at}.default", f"{spec.default!r} is not of type {spec.type}"
    if spec.format is not None and not top:
        return f"{at}.format", "format is honoured on top-level arguments only"
    if spec.required and item:
        return f"{at}.required", "an array's items are not properties; drop required"
    if spec.enum is not None:
        if not spec.enum:
            return f"{at}.enum", "must not be empty"
        for i, value in enumerate(spec.enum):
            if not _fits(spec.type, value):
                return f"{at}.enum[{i}]", f"{value!r} is not of type {spec.type}"
        if spec.default is not None and spec.default not in spec.enum:
            return f"{at}.default", f"{spec.default!r} is not in the enum"
    if spec.required and spec.default is not None:
        return at, "an argument with a default can not be required"
    if spec.items is not None:
        if spec.type != "array":
            return f"{at}.items", f"items describes an array's elements, not a {spec.type}"
        found = _arg_problem(spec.items, f"{at}.items", top=False, item=True)
        if found is not None:
            return found
    if spec.properties is not None:
        if spec.type != "object":
            return f"{at}.properties", f"properties describes an object, not a {spec.type}"
        for name, sub in spec.properties.items():
            found = _arg_problem(sub, f"{at}.properties.{name}", top=False)
            if found is not None:
                return found
    return None


def _output_problem(spec: ArgSpec, at: str) -> tuple[str, str] | None:
    """(field, problem) for an output property (or a nested part of one) that uses what
    only an argument can (a default, a format), else `_arg_problem`'s answer."""
    if spec.default is not None:
        return f"{at}.default", "an output has no default (defaults are for arguments)"
    if spec.format is not None:
        return f"{at}.format", "format tells argument vetting what to check; not for an output"
    parts = [(f"{at}.properties.{k}", sub) for k, sub in (spec.properties or {}).items()]
    if spec.items is not None:
        parts.append((f"{at}.items", spec.items))
    for where, sub in parts:
        found = _output_problem(sub, where)
        if found is not None:
            return found
    return _arg_problem(spec, at, top=False)


def _hint_problem(kind: str, hint: str) -> str | None:
    """Why a hint of a ``kind`` capability is unusable, or None.

    A bad hint must stop the load: dropped silently at plan time, it would leave a manifest
    that looks like it grants something and grants nothing (or, for ``/*``, everything).
    """
    if kind == "fs":
        try:
            expand_hint(hint, _PLACEHOLDER_HOME)
        except ValueError as exc:
            return f"is not a usable fs hint ({exc})"
        if ".." in hint.split("/"):
            return "holds a '..' segment; write the folder it means"
    elif kind == "network":
        port = re.search(r":([0-9]+)$", hint)
        if port is not None and int(port.group(1)) > 65535:
            return "names a port above 65535"
        if not _NET_HINT_RE.match(hint):
            return (
                "is not a host hint; write a host name, *.domain or * "
                "(optionally :port), without scheme or path"
            )
    return None


def _is_local(folder: Path, top: str) -> bool:
    return (folder / f"{top}.py").is_file() or (folder / top).is_dir()


def check_packable(manifest: Manifest, folder: str | os.PathLike[str]) -> list[str]:
    """Check a ``packable`` executor's imports; return its top-level module names.

    Raises:
        BadManifest: naming the file, line and module that is neither the standard
            library nor inside the folder.
    """
    if not manifest.packable or manifest.runtime == "wasm":
        return []
    root = Path(folder)
    tops: dict[str, None] = {}
    for rel, line, module in imported_modules(root):
        top = module.partition(".")[0]
        if _is_local(root, top):
            tops.setdefault(top, None)
            continue
        if manifest.runtime == "wasm-python" and top in PYTHON_WASM_ABSENT:
            raise BadManifest(
                f"{root}/manifest.toml: field `packable`: {rel}:{line} imports `{module}`, "
                "which python.wasm (CPython 3.12 for WASI, the runtime of `wasm-python`) "
                "does not have, so no device could run it; use another module, runtime "
                '"python", or packable = false'
            )
        if top in sys.stdlib_module_names:
            tops.setdefault(top, None)
            continue
        raise BadManifest(
            f"{root}/manifest.toml: field `packable`: {rel}:{line} imports `{module}`, which "
            "is neither the standard library nor a file in the executor's folder, so a "
            "device could not run it; use only the standard library or set packable = false"
        )
    return list(tops)


def _validate(manifest: Manifest, where: Path) -> None:
    def bad(field: str, problem: str) -> BadManifest:
        return BadManifest(f"{where}: field `{field}`: {problem}")

    if not _NAME_RE.match(manifest.name):
        raise bad("name", f"{manifest.name!r} must match {_NAME_RE.pattern}")
    entry = Path(manifest.entry)
    if entry.is_absolute() or ".." in entry.parts:
        raise bad("entry", f"{manifest.entry!r} must be a relative path inside the folder")
    if not (where.parent / entry).is_file():
        raise bad("entry", f"{manifest.entry!r} does not exist next to the manifest")
    for arg_name, spec in manifest.args.items():
        arg_problem = _arg_problem(spec, f"args.{arg_name}", top=True)
        if arg_problem is not None:
            raise bad(*arg_problem)
    for out_name, spec in (manifest.output or {}).items():
        out_problem = _output_problem(spec, f"output.{out_name}")
        if out_problem is not None:
            raise bad(*out_problem)
    for i, cap in enumerate(manifest.capabilities):
        if not _CAP_RE.match(cap.name):
            raise bad(f"capabilities[{i}].name", f"{cap.name!r} is not of the form kind:mode")
        for j, hint in enumerate(cap.hints):
            problem = _hint_problem(cap.kind, hint)
            if problem is not None:
                raise bad(f"capabilities[{i}].hints[{j}]", f"{hint!r} {problem}")
    lim = manifest.limits
    if lim.timeout_s <= 0:
        raise bad("limits.timeout_s", "must be positive")
    for fname in (
        "memory_mb",
        "pids",
        "file_size_mb",
        "open_files",
        "output_kb",
        "disk_mb",
        "net_connections",
        "net_mb",
    ):
        if getattr(lim, fname) <= 0:
            raise bad(f"limits.{fname}", "must be positive")
    if lim.fuel is not None and lim.fuel <= 0:
        raise bad("limits.fuel", "must be positive")
    # Last: a packable executor must import only the standard library and its own files.
    check_packable(manifest, where.parent)


_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def _field_of(exc: msgspec.ValidationError, raw: bytes) -> tuple[str, str]:
    """(message without the JSON path, the TOML field a person would edit)."""
    text, at = str(exc), ""
    if " - at `$" in text:
        text, _, at = text.rpartition(" - at `$")
        at = at.rstrip("`").lstrip(".")
    table_name = at.partition("[...]")[0]
    if table_name in ("args", "output") and at.startswith(f"{table_name}[...]"):
        # msgspec does not name the dict key; find the entry by checking each one.
        try:
            table = msgspec.toml.decode(raw)
            bad_keys = [
                name
                for name, value in dict(table.get(table_name) or {}).items()
                if not _converts(value, ArgSpec)
            ]
        except (msgspec.DecodeError, AttributeError, TypeError):
            bad_keys = []
        if len(bad_keys) == 1:
            at = f"{table_name}.{bad_keys[0]}" + at[len(f"{table_name}[...]") :]
    named = _UNKNOWN_FIELD.search(text) or _MISSING_FIELD.search(text)
    if named:
        # "Object contains unknown field `bogus` - at `$.limits`" → `limits.bogus`.
        at = f"{at}.{named.group(1)}" if at else named.group(1)
    return text, at or "(top level)"


def _converts(value: Any, type_: type) -> bool:
    try:
        msgspec.convert(value, type_)
    except msgspec.ValidationError:
        return False
    return True


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Load and validate one ``manifest.toml``.

    Raises:
        BadManifest: naming the file, the field and the problem.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise BadManifest(f"{p}: cannot read: {exc.strerror}") from exc
    try:
        manifest = msgspec.toml.decode(raw, type=Manifest)
    except msgspec.ValidationError as exc:
        # msgspec says "Expected `int`, got `str` - at `$.limits.timeout_s`"; turn the
        # JSON path into the TOML field a person would edit.
        text, field = _field_of(exc, raw)
        raise BadManifest(f"{p}: field `{field}`: {text}") from exc
    except msgspec.DecodeError as exc:
        raise BadManifest(f"{p}: not valid TOML: {exc}") from exc
    _validate(manifest, p)
    return manifest


class Executor(msgspec.Struct, frozen=True):
    """A loaded executor: its manifest and the folder that holds its code."""

    manifest: Manifest
    path: str

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def entry_path(self) -> str:
        return os.path.join(self.path, self.manifest.entry)


class ExecutorRegistry(Mapping[str, Executor]):
    """Executors loaded from a folder of executor folders.

    Bad manifests do not stop the others from loading: they are kept in `errors`
    (name → `BadManifest`) so a worker can report them and refuse jobs that name them
    with the load error instead of "unknown executor". `strict=True` raises the first.
    """

    def __init__(
        self,
        executors: Mapping[str, Executor],
        errors: Mapping[str, BadManifest],
        error_folders: Mapping[str, str] | None = None,
    ):
        self._executors = dict(executors)
        self.errors: dict[str, BadManifest] = dict(errors)
        #: The folder `load` read (a real path), ``None`` when built otherwise: it and the
        #: executors' folders are the worker's own, which no job's hint may reach.
        self.root: str | None = None
        #: name in `errors` → the folder that failed to load (a signature check of a
        #: worker with trust keys names tampering before a load error; see `Supervisor`).
        self.error_folders: dict[str, str] = dict(error_folders or {})

    @classmethod
    def load(cls, root: str | os.PathLike[str], *, strict: bool = False) -> ExecutorRegistry:
        root_p = Path(root).resolve()
        if not root_p.is_dir():
            if root_p.exists():
                raise BadManifest(
                    f"{root_p}: is not a folder; give the folder that holds the executor "
                    "folders (each with its manifest.toml)"
                )
            raise BadManifest(f"{root_p}: executors folder does not exist")
        if (root_p / "manifest.toml").is_file():
            # Left to load, it finds no executor and every job is "unknown executor".
            raise BadManifest(
                f"{root_p}: this is one executor's folder (it holds manifest.toml); give "
                f"the folder that holds the executor folders: --executors {root_p.parent}"
            )
        found: dict[str, Executor] = {}
        errors: dict[str, BadManifest] = {}
        folders: dict[str, str] = {}
        for mf in sorted(root_p.glob("*/manifest.toml")):
            try:
                manifest = load_manifest(mf)
            except BadManifest as exc:
                if strict:
                    raise
                errors[mf.parent.name] = exc
                folders[mf.parent.name] = str(mf.parent)
                continue
            if manifest.name in found:
                dup = BadManifest(
                    f"{mf}: field `name`: {manifest.name!r} is already defined in "
                    f"{found[manifest.name].path}"
                )
                if strict:
                    raise dup
                errors[manifest.name] = dup
                continue
            # Its real path, taken once here: from now on it is never reached through a
            # symlink (`plan_invocation`, the arms), so a folder (or the root) swapped for
            # a link after loading is refused, not followed to code nobody loaded.
            found[manifest.name] = Executor(manifest=manifest, path=os.path.realpath(mf.parent))
        registry = cls(found, errors, folders)
        registry.root = str(root_p)
        return registry

    def refuse(self, name: str, error: BadManifest) -> None:
        """Move a loaded executor to `errors` (a check after load failed, e.g. its dry
        run): its jobs are then refused with `error`."""
        refused = self._executors.pop(name, None)
        self.errors[name] = error
        if refused is not None:
            self.error_folders[name] = refused.path

    def get_executor(self, name: str) -> Executor:
        """Raises `BadManifest` (its load error) or `UnknownExecutor`."""
        if name in self._executors:
            return self._executors[name]
        if name in self.errors:
            raise self.errors[name]
        raise UnknownExecutor(
            f"no executor named {name!r}; known: {', '.join(sorted(self._executors)) or 'none'}"
        )

    def __getitem__(self, name: str) -> Executor:
        return self._executors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._executors)

    def __len__(self) -> int:
        return len(self._executors)
