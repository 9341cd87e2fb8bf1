"""Manifests to tool definitions: OpenAI (Chat and Responses), Anthropic, MCP.

See the package docstring for the shapes. Every definition is built from one `Manifest`,
so a folder and the catalog give the same document for the same executors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Final, Literal, get_args

from ..brokers import Broker
from ..errors import BadManifest
from ..manifest import ExecutorRegistry, Manifest
from ..toolspec import input_schema, output_schema, strict_schema, tool_description, tool_name
from .mcp_spec import tool_annotations

__all__ = (
    "FORMATS",
    "ToolFormat",
    "catalog_manifests",
    "definitions_from_catalog",
    "definitions_from_folder",
    "mcp_annotations",
    "tool_definition",
    "tool_definitions",
)

ToolFormat = Literal["openai", "openai-responses", "anthropic", "mcp"]

#: The formats `tool_definition` writes.
FORMATS: Final[tuple[ToolFormat, ...]] = get_args(ToolFormat)


def _openai_parameters(manifest: Manifest) -> tuple[dict[str, Any], bool]:
    """(parameters, strict): strict when the normaliser keeps the tool's meaning."""
    plain = input_schema(manifest)
    strict = strict_schema(plain)
    if not strict.why_not:
        return strict.schema, True
    comment = (
        "Exported with strict: false, because strict mode would refuse what this tool "
        f"accepts: {'; '.join(strict.why_not)}."
    )
    return {**plain, "$comment": comment}, False


def mcp_annotations(manifest: Manifest) -> dict[str, Any]:
    """MCP's tool annotations, from the capabilities the manifest declares: the MCP
    server's own rules (`tools.mcp_spec.tool_annotations`, which says each), so that an
    exported definition and a served one never disagree."""
    return tool_annotations(manifest)


def tool_definition(manifest: Manifest, fmt: ToolFormat) -> dict[str, Any]:
    """The tool definition of the executor `manifest` describes, in `fmt`."""
    name, description = tool_name(manifest.name), tool_description(manifest)
    if fmt == "openai":
        parameters, strict = _openai_parameters(manifest)
        function = {
            "name": name,
            "description": description,
            "parameters": parameters,
            "strict": strict,
        }
        return {"type": "function", "function": function}
    if fmt == "openai-responses":
        parameters, strict = _openai_parameters(manifest)
        return {
            "type": "function",
            "name": name,
            "description": description,
            "parameters": parameters,
            "strict": strict,
        }
    if fmt == "anthropic":
        return {"name": name, "description": description, "input_schema": input_schema(manifest)}
    if fmt == "mcp":
        tool: dict[str, Any] = {
            "name": name,
            "description": description,
            "inputSchema": input_schema(manifest),
        }
        declared = output_schema(manifest)
        if declared is not None:
            tool["outputSchema"] = declared
        tool["annotations"] = mcp_annotations(manifest)
        return tool
    raise ValueError(f"unknown tool format {fmt!r}; known: {', '.join(FORMATS)}")


def tool_definitions(manifests: Iterable[Manifest], fmt: ToolFormat) -> list[dict[str, Any]]:
    """The definitions of `manifests` in `fmt`, sorted by tool name."""
    return [tool_definition(m, fmt) for m in sorted(manifests, key=lambda m: tool_name(m.name))]


def definitions_from_folder(
    folder: str | os.PathLike[str], fmt: ToolFormat
) -> tuple[list[dict[str, Any]], dict[str, BadManifest]]:
    """The definitions of an executors folder's executors, and the ones that failed to
    load (folder name → the error; they are left out, as a worker refuses their jobs).

    Raises:
        BadManifest: `folder` is not an executors folder.
    """
    registry = ExecutorRegistry.load(folder)
    manifests = [registry[name].manifest for name in registry]
    return tool_definitions(manifests, fmt), dict(registry.errors)


async def catalog_manifests(broker: Broker) -> list[Manifest]:
    """The manifests the server workers published to `broker`'s catalog (none: an empty
    list, as for a broker without a catalog)."""
    manifests = []
    for name in sorted(await broker.executor_names()):
        info = await broker.executor_info(name)
        if info is not None:
            manifests.append(info.manifest)
    return manifests


async def definitions_from_catalog(broker: Broker, fmt: ToolFormat) -> list[dict[str, Any]]:
    """The definitions of the executors published to `broker`'s catalog, in `fmt`."""
    return tool_definitions(await catalog_manifests(broker), fmt)
