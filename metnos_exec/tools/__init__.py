"""Executors as tools for every agent (issue 19): tool definitions, and the MCP server; an
entry unit over `client` and `toolspec`.

`export` turns manifests into the tool definitions each model API takes, from an
executors folder (`ExecutorRegistry`) or from the catalog the server workers publish to
the broker (`Broker.executor_names` / `executor_info`), in one of `FORMATS`:

* ``openai``: Chat Completions, ``{"type": "function", "function": {"name",
  "description", "parameters", "strict"}}``;
* ``openai-responses``: Responses, ``{"type": "function", "name", "description",
  "parameters", "strict"}``;
* ``anthropic``: Messages, ``{"name", "description", "input_schema"}``;
* ``mcp``: a Model Context Protocol ``Tool``, ``{"name", "description", "inputSchema",
  "outputSchema", "annotations"}`` (``outputSchema`` only where the manifest declares its
  output; annotations from the capabilities, `mcp_annotations`).

The OpenAI shapes are strict (``strict: true``, the schema normalised by
`toolspec.strict_schema`) unless strict mode would change what the tool accepts; then
``strict: false``, and the reason is in the parameters' ``$comment``. Anthropic and MCP
get the plain schema (`toolspec.input_schema`), which is exactly what the worker checks.
Running a model's call is `Client.run_tool_call` (`metnos_exec.toolcall`), in `client`.

- `tools.mcp_spec`: what an executor is as a Model Context Protocol tool (its definition
  and annotations derived from the manifest's capabilities: `export`'s ``mcp`` format
  uses them) and how a job's `Result` reads as a tool result (structured content, a text
  rendering, the containment report, the job id and undo ids in ``_meta``, ``isError``
  for a refusal or a failed job). It imports no MCP SDK.
- `tools.mcp_server`: ``metnos-exec mcp``, the MCP server over the queue (stdio and
  streamable HTTP), built on the ``mcp`` SDK (the ``metnos-exec[mcp]`` extra), imported
  only there and in `tools.mcp_tasks`: the MCP Tasks extension, a long call answered
  with a task whose id is the job id.

Tool names and input schemas come from `metnos_exec.toolspec`, never from here.
"""

from __future__ import annotations

from .export import (
    FORMATS,
    ToolFormat,
    catalog_manifests,
    definitions_from_catalog,
    definitions_from_folder,
    mcp_annotations,
    tool_definition,
    tool_definitions,
)

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
