"""Executors as tools for agents (issue 19): an entry unit over `client` and `toolspec`.

- `tools.mcp_spec`: what an executor is as a Model Context Protocol tool (its definition
  and annotations derived from the manifest's capabilities) and how a job's `Result`
  reads as a tool result (structured content, a text rendering, the containment report,
  the job id and undo ids in ``_meta``, ``isError`` for a refusal or a failed job). It
  imports no MCP SDK.
- `tools.mcp_server`: ``metnos-exec mcp``, the MCP server over the queue (stdio and
  streamable HTTP), built on the ``mcp`` SDK (the ``metnos-exec[mcp]`` extra), imported
  only there.

Tool names and input schemas come from `metnos_exec.toolspec`, never from here.
"""
