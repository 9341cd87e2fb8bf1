"""An executor as a tool: its name and its arguments as JSON Schema, for every tool format
(`metnos_exec.tools`: MCP, OpenAI, Anthropic) and for `Client.run_tool_call`.

The manifest's argument schema maps 1:1 onto JSON Schema (`manifest.ArgSpec` says what
each field means): each argument is a property of its ``type``, with its
``description``, ``enum`` and ``default``; an array's ``items`` and an object's
``properties`` nest the same way; required arguments are listed in ``required``; an
object with declared properties takes no other key (``additionalProperties: false``), as
the worker refuses unknown arguments too. ``format`` (what argument vetting checks a
value against) has no JSON Schema counterpart and is not written out. Tool names must
match ``^[a-zA-Z0-9_-]{1,64}$`` (OpenAI's rule, the strictest): a manifest name already
does; the reserved undo executor (``metnos:undo``) becomes ``metnos_undo``.

**Strict mode** (`strict_schema`; OpenAI's ``strict: true``, where the model can only
produce what the schema allows) needs every object closed and every property listed in
``required``, and takes no ``default``. The normaliser closes every object, lists every
property, and makes each optional argument *nullable* (``type: [t, "null"]``, ``null``
added to its ``enum``) and required; its default moves into its description. This keeps
the tool's meaning because the worker treats ``null`` as absent, at the top and inside
objects (`capabilities.final_args`): a model that sends ``null`` gets exactly the default
(or the absence) it would have got by leaving the argument out. What strict mode cannot
express is an ``object`` without declared ``properties`` (any keys) and an ``array``
without ``items`` (any elements): closing them would forbid what the executor accepts, so
such a tool is exported with ``strict: false`` and its plain schema, and the reasons go
in the schema's ``$comment`` (`StrictSchema.why_not`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final, NamedTuple

from .manifest import ArgSpec, Manifest

__all__ = (
    "TOOL_NAME_RE",
    "StrictSchema",
    "arg_schema",
    "executor_for_tool",
    "input_schema",
    "output_problem",
    "output_schema",
    "strict_schema",
    "tool_description",
    "tool_name",
)

#: What every tool format accepts as a tool name.
TOOL_NAME_RE: Final = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def tool_name(executor: str) -> str:
    """The tool name of `executor`: itself when allowed, else with every other character
    replaced by ``_`` and cut to 64 (names are unique while executors' names are: a
    manifest name is ``[a-z][a-z0-9_-]{0,63}``, and only reserved names hold ``:``)."""
    if TOOL_NAME_RE.fullmatch(executor):
        return executor
    return re.sub(r"[^a-zA-Z0-9_-]", "_", executor)[:64] or "_"


def executor_for_tool(name: str, executors: Any) -> str | None:
    """The executor among `executors` (names) whose tool name is `name`, or ``None``."""
    for executor in executors:
        if tool_name(executor) == name:
            return str(executor)
    return None


def tool_description(manifest: Manifest) -> str:
    """What the model reads about the tool: the manifest's description (or its name)."""
    return manifest.description or f"Run the executor {manifest.name} (version {manifest.version})"


def arg_schema(spec: ArgSpec) -> dict[str, Any]:
    """One argument (or a nested element or property) as a JSON Schema."""
    out: dict[str, Any] = {"type": spec.type}
    if spec.description:
        out["description"] = spec.description
    if spec.enum is not None:
        out["enum"] = list(spec.enum)
    if spec.default is not None:
        out["default"] = spec.default
    if spec.items is not None:
        out["items"] = arg_schema(spec.items)
    if spec.properties is not None:
        out.update(_object_schema(spec.properties))
    return out


def _object_schema(props: dict[str, ArgSpec]) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "properties": {name: arg_schema(spec) for name, spec in props.items()},
        "additionalProperties": False,
    }
    required = [name for name, spec in props.items() if spec.required]
    if required:
        schema["required"] = required
    return schema


def input_schema(manifest: Manifest) -> dict[str, Any]:
    """The executor's arguments as one JSON Schema object (a tool's input schema)."""
    return {"type": "object", **_object_schema(manifest.args)}


def output_schema(manifest: Manifest) -> dict[str, Any] | None:
    """The executor's declared JSON output (``[output.*]``) as one JSON Schema object (a
    tool's output schema), or ``None`` when the manifest declares none."""
    if manifest.output is None:
        return None
    return {"type": "object", **_object_schema(manifest.output)}


def output_problem(manifest: Manifest, output: Any) -> str | None:
    """Why `output` (a job's JSON output) does not conform to `output_schema`, or ``None``
    (also when no output schema is declared).

    Exactly JSON Schema's rules, with two stricter: an ``integer`` is a JSON integer
    (``1.0`` is not), and booleans are never numbers. So an output this accepts also
    validates against the exported schema in any JSON Schema validator.
    """
    if manifest.output is None:
        return None
    if not isinstance(output, dict):
        return f"the output is {_json_type(output)}, not an object"
    return _props_problem(manifest.output, output, "output")


_JSON_TYPES: Final = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    for name in ("boolean", "integer", "number", "string", "array", "object"):
        if isinstance(value, _JSON_TYPES[name]):
            return f"a JSON {name}"
    return type(value).__name__


def _props_problem(props: dict[str, ArgSpec], value: dict[str, Any], at: str) -> str | None:
    for key in value:
        if key not in props:
            return f"{at} has the key {key!r}, which the schema does not declare"
    for key, spec in props.items():
        if key not in value:
            if spec.required:
                return f"{at}.{key} is required and missing"
            continue
        found = _value_problem(spec, value[key], f"{at}.{key}")
        if found is not None:
            return found
    return None


def _value_problem(spec: ArgSpec, value: Any, at: str) -> str | None:
    fits = isinstance(value, _JSON_TYPES[spec.type])
    if isinstance(value, bool) and spec.type != "boolean":
        fits = False
    if not fits:
        return f"{at} must be of type {spec.type}, got {_json_type(value)}"
    if spec.enum is not None and not any(
        isinstance(value, bool) == isinstance(e, bool) and value == e for e in spec.enum
    ):
        return f"{at} = {json.dumps(value)[:80]} is not one of {json.dumps(list(spec.enum))}"
    if spec.items is not None:
        for i, item in enumerate(value):
            found = _value_problem(spec.items, item, f"{at}[{i}]")
            if found is not None:
                return found
    if spec.properties is not None:
        return _props_problem(spec.properties, value, at)
    return None


class StrictSchema(NamedTuple):
    """`strict_schema`'s answer: the strict form, and why it may not be used."""

    #: The schema normalised for strict mode (meaningful only when `why_not` is empty).
    schema: dict[str, Any]
    #: Why the tool must be exported with ``strict: false`` (empty: it may be strict).
    why_not: tuple[str, ...]


def strict_schema(schema: dict[str, Any]) -> StrictSchema:
    """`schema` (an `input_schema`) normalised for strict mode; see the module docstring."""
    why_not: list[str] = []
    return StrictSchema(_strict(schema, "arguments", why_not), tuple(why_not))


def _strict(node: dict[str, Any], at: str, why_not: list[str]) -> dict[str, Any]:
    out = dict(node)
    if node.get("type") == "object":
        if "properties" not in node:
            why_not.append(f"{at} is an object of any keys (no properties declared)")
            return out
        props: dict[str, Any] = node["properties"]
        required = set(node.get("required", ()))
        out["properties"] = {
            name: _strict_property(sub, f"{at}.{name}", name in required, why_not)
            for name, sub in props.items()
        }
        out["required"] = list(props)
        out["additionalProperties"] = False
    elif node.get("type") == "array":
        if "items" not in node:
            why_not.append(f"{at} is an array of any elements (no items declared)")
            return out
        out["items"] = _strict(node["items"], f"{at}[]", why_not)
    return out


def _strict_property(
    node: dict[str, Any], at: str, required: bool, why_not: list[str]
) -> dict[str, Any]:
    out = _strict(node, at, why_not)
    if required:
        return out
    out["type"] = [node["type"], "null"]
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    note = "null: not given"
    if "default" in out:
        note = f"null: the default, {json.dumps(out.pop('default'))}"
    out["description"] = f"{out['description']} ({note})" if out.get("description") else note
    return out
