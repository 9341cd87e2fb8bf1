"""A small ReAct loop (think → act → observe) that feeds the metnos-exec queue.

The "model" here is a script: each step has a thought and a tool call, and may look at the
previous observation to decide its arguments. Every action is a job on the queue; every
observation is the job's `Result` (status, output, which sandbox walls held). A refused
action is an observation too: the agent sees ``E_CAPABILITY_DENIED`` and adapts.

    python examples/agent_loop.py                      # self-contained: a worker in-process
    python examples/agent_loop.py --broker sqlite:///./metnos.db   # against your workers
    python examples/agent_loop.py --log-file agent.jsonl   # the worker's records, kept

With ``--broker``, start a worker first (``metnos-exec worker --executors
examples/executors``); the notes folder is then your worker's ``~/notes``.
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
from metnos_exec.messages import Result
from metnos_exec.supervisor import Supervisor, SupervisorConfig

EXECUTORS = Path(__file__).resolve().parent / "executors"


@dataclass
class Step:
    thought: str
    tool: str
    #: Arguments, or a function of the previous observation that returns them.
    args: dict[str, Any] | Callable[[Result | None], dict[str, Any]]


def _first_note(obs: Result | None) -> dict[str, Any]:
    # Pick a note from the listing the previous step observed.
    entries = (obs.output or {}).get("notes", []) if obs is not None else []
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


def _observation(result: Result) -> str:
    walls = result.containment.sandbox if result.containment else "-"
    if result.status == "succeeded":
        text = json.dumps(result.output)
        return f"{result.status} (sandbox {walls}): {text[:160]}"
    code = result.error.code if result.error else "?"
    message = result.error.message if result.error else ""
    return f"{result.status} {code}: {message[:160]}"


async def agent(client: Client, run_id: str) -> None:
    observation: Result | None = None
    for i, step in enumerate(PLAN, start=1):
        args = step.args(observation) if callable(step.args) else step.args
        print(f"Thought {i}: {step.thought}")
        print(f"Action {i}: {step.tool}({json.dumps(args)})")
        observation = await client.run(
            step.tool, args, timeout=30, correlation_id=f"{run_id}/step-{i}"
        )
        print(f"Observation {i}: {_observation(observation)}\n")


async def main_async(ns: argparse.Namespace) -> None:
    if ns.broker:
        async with Client(ns.broker) as client:
            await agent(client, ns.run_id)
        return
    # Self-contained: a temporary queue and home, and a worker in this process.
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
                await agent(Client(broker), ns.run_id)
                await sup.drain(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--broker", help="use this queue (and its workers) instead of an embedded one")
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
