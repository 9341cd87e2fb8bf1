"""A small ReAct loop (think → act → observe) on metnos-exec's tool layer, as an agent does it.

The tools the model is offered come from the exporter (`metnos_exec.tools`: the executors
as OpenAI Chat, OpenAI Responses or Anthropic tool definitions, ``--format``); the model's
tool calls, in that provider's own shape, are dispatched with `Client.run_tool_call`, and
what is printed as the observation is exactly what goes back to the model: the
provider-shaped result (a ``tool`` message, a ``function_call_output`` or a ``tool_result``).

The "model" is a script (no network): each step has a thought, a tool and arguments, and
may read the previous observation (the text the model would read, nothing more) to decide
them. It only calls tools it was offered, and fills its arguments in from the offered
schema: for a strict OpenAI tool every property is sent, ``null`` for the ones it leaves
out (strict mode requires them all; the worker takes ``null`` as "not given"). A refused
call is an observation too: the model reads ``ERROR: ... E_CAPABILITY_DENIED`` and adapts.

    python examples/agent_loop.py                      # self-contained: a worker in-process
    python examples/agent_loop.py --format anthropic   # the same loop in Anthropic's shapes
    python examples/agent_loop.py --broker sqlite:///./metnos.db   # against your workers
    python examples/agent_loop.py --log-file agent.jsonl   # the worker's records, kept

With ``--broker``, start a worker first (``metnos-exec worker --executors
examples/executors``); the tools are then the catalog it publishes, and the notes folder
is its ``~/notes``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from metnos_exec.brokers import open_broker
from metnos_exec.client import Client
from metnos_exec.logs import configure_logging
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.supervisor import Supervisor, SupervisorConfig
from metnos_exec.tools import definitions_from_catalog, definitions_from_folder

EXECUTORS = Path(__file__).resolve().parent / "executors"

#: The provider formats the loop speaks (the exporter's names).
FORMATS = ("openai", "openai-responses", "anthropic")


@dataclass
class Step:
    thought: str
    tool: str
    #: Arguments, or a function of the previous observation's text that returns them.
    args: dict[str, Any] | Callable[[str], dict[str, Any]]


def _first_note(observation: str) -> dict[str, Any]:
    # The text starts with the executor's JSON output (a listing, for read_notes).
    try:
        listing = json.loads(observation.splitlines()[0])
    except (ValueError, IndexError):
        listing = {}
    entries = listing.get("notes", []) if isinstance(listing, dict) else []
    names = [e["path"] for e in entries if str(e.get("path", "")).endswith((".md", ".txt"))]
    return {"path": f"~/notes/{names[0]}" if names else "~/notes/todo.md"}


PLAN = [
    Step("I should see which notes exist.", "read_notes", {}),
    Step("Let me read the first note.", "read_notes", _first_note),
    Step(
        "I'll record the task in today's note.",
        "write_note",
        {"path": "~/notes/today.md", "text": "- reply to Ada about the queue"},
    ),
    Step(
        "Maybe I can also keep a copy in my home folder.",
        "write_note",
        {"path": "~/agent-copy.md", "text": "copy"},
    ),
    Step(
        "Refused: notes only. Let me check today's note instead.",
        "read_notes",
        {"path": "~/notes/today.md"},
    ),
]


def _name(tool: dict[str, Any]) -> str:
    return str(tool["function"]["name"] if "function" in tool else tool["name"])


class ScriptedModel:
    """Plays `PLAN`, emitting each tool call in the shape of `fmt`'s API."""

    def __init__(self, fmt: str, tools: list[dict[str, Any]]) -> None:
        self.fmt = fmt
        self.tools = {_name(t): t for t in tools}

    def _arguments(self, tool: str, wanted: dict[str, Any]) -> dict[str, Any]:
        offered = self.tools[tool]
        spec = offered.get("function", offered)
        if not spec.get("strict"):
            return wanted
        props = spec["parameters"]["properties"]
        return {name: wanted.get(name) for name in props}  # strict: all, None for the rest

    def call(self, i: int, step: Step, observation: str) -> dict[str, Any]:
        """The model's tool call for step `i`, as its provider's SDK would hand it over."""
        if step.tool not in self.tools:
            raise SystemExit(f"the model wants {step.tool!r}, which it was not offered")
        wanted = step.args(observation) if callable(step.args) else step.args
        args = self._arguments(step.tool, wanted)
        if self.fmt == "anthropic":
            return {"type": "tool_use", "id": f"toolu_{i:02d}", "name": step.tool, "input": args}
        text = json.dumps(args)
        if self.fmt == "openai-responses":
            return {"type": "function_call", "call_id": f"call_{i:02d}", "name": step.tool,
                    "arguments": text}  # fmt: skip
        return {"id": f"call_{i:02d}", "type": "function",
                "function": {"name": step.tool, "arguments": text}}  # fmt: skip


def _text_of(reply: dict[str, Any]) -> str:
    """What the model reads in a provider-shaped result."""
    return str(reply.get("content", reply.get("output", "")))


async def agent(client: Client, fmt: str, tools: list[dict[str, Any]], run_id: str) -> None:
    model = ScriptedModel(fmt, tools)
    print(f"Tools ({fmt}, from the exporter): {', '.join(sorted(model.tools))}")
    observation = ""
    for i, step in enumerate(PLAN, start=1):
        call = model.call(i, step, observation)
        print(f"Thought {i}: {step.thought}")
        print(f"Action {i}: {json.dumps(call)}")
        reply = await client.run_tool_call(call, timeout=30, correlation_id=f"{run_id}/step-{i}")
        observation = _text_of(reply)
        print(f"Observation {i}: {json.dumps(reply, ensure_ascii=False)}\n")


async def main_async(ns: argparse.Namespace) -> None:
    if ns.broker:
        async with Client(ns.broker) as client:
            tools = await definitions_from_catalog(client.broker, ns.format)
            await agent(client, ns.format, tools, ns.run_id)
        return
    # Self-contained: a temporary queue and home, and a worker in this process.
    tools, _ = definitions_from_folder(EXECUTORS, ns.format)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        (home / "notes").mkdir(parents=True)
        (home / "notes" / "ideas.md").write_text("# Ideas\n- sandbox every tool call\n")
        async with open_broker(f"sqlite:///{tmp}/q.db") as broker:
            registry = ExecutorRegistry.load(EXECUTORS)
            sup = Supervisor(
                broker, registry, SupervisorConfig(worker_id="agent-demo", home=str(home))
            )
            async with anyio.create_task_group() as tg:
                await tg.start(sup.run)
                await agent(Client(broker), ns.format, tools, ns.run_id)
                await sup.drain(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--broker", help="use this queue (and its workers) instead of an embedded one")
    p.add_argument(
        "--format", choices=FORMATS, default="openai", help="the model API's tool shapes"
    )
    p.add_argument("--run-id", default="agent-run-1", help="correlation id prefix")
    p.add_argument(
        "--log-file", help="the embedded worker's JSON-lines log (default: errors only, on stderr)"
    )
    p.add_argument("--log-level", help="its lowest level (default: info to a file, else error)")
    ns = p.parse_args()
    # The transcript is for a person: a refused action is an observation in it already,
    # so the worker's records (its `job.rejected` warning, a raw JSON line) stay out of it.
    # They go to --log-file; without one, only an error reaches the terminal, readably.
    if ns.log_file:
        configure_logging(file=ns.log_file, level=ns.log_level or "info")
    else:
        configure_logging(level=ns.log_level or "error", json=False)
    anyio.run(main_async, ns)


if __name__ == "__main__":
    main()
