"""Drive ``metnos-exec mcp --stdio`` with the ``mcp`` SDK's own client: list the tools, call
one (needs the extra: ``pip install 'metnos-exec[mcp]'``).

    python examples/mcp_client.py --broker sqlite:///./metnos.db

Start a worker on the same queue first (``metnos-exec worker --executors
examples/executors``): the server submits each call as a job and a worker runs it. The
call reads your worker's ``~/notes`` (the ``read_notes`` example executor); a call outside
its hints is refused, and the refusal comes back as an error result the model can read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters

EXECUTORS = Path(__file__).resolve().parent / "executors"


def _executors() -> list[str]:
    return ["--executors", str(EXECUTORS)]


async def main(broker: str, path: str) -> None:
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "metnos_exec", "mcp", "--stdio", "--broker", broker, *_executors()],
        env=dict(os.environ),
    )
    async with Client(server) as client:
        for tool in (await client.list_tools()).tools:
            hints = tool.annotations
            read_only = hints is not None and hints.read_only_hint
            print(f"tool {tool.name}{' (read-only)' if read_only else ''}: {tool.description}")
        result = await client.call_tool("read_notes", {"path": path})
        meta = result.meta or {}
        print(f"read_notes -> {meta.get('status')} (job {meta.get('job_id')})")
        print(json.dumps(result.structured_content, indent=2))
        walls = (meta.get("containment") or {}).get("sandbox")
        print(f"sandbox: {walls}; undo ids: {meta.get('undo_ids')}")
        refused = await client.call_tool("read_notes", {"path": "/etc/passwd"})
        print(f"outside the hints -> isError={refused.is_error}:")
        print(refused.content[0].text if refused.content else "")  # type: ignore[union-attr]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--broker", default=os.environ.get("METNOS_BROKER", "sqlite:///./metnos.db"))
    p.add_argument("--path", default="~/notes", help="what read_notes reads (default ~/notes)")
    ns = p.parse_args()
    anyio.run(main, ns.broker, ns.path)
