"""`Client.run_tool_call` (issue 19, acceptance 4): tool calls built with the OpenAI and
Anthropic SDKs' own types run against a worker (the example executors, every job in the
echo double: what is tested is the shaping, not the arms) and come back in the SDK's
result shape; a call outside the hints comes back as an error the model can read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest
from anthropic.types import ToolResultBlockParam, ToolUseBlock
from openai.types.chat import ChatCompletionMessageFunctionToolCall, ChatCompletionToolMessageParam
from openai.types.chat.chat_completion_message_function_tool_call import Function
from openai.types.responses import ResponseFunctionToolCall
from openai.types.responses.response_input_param import FunctionCallOutput
from pydantic import TypeAdapter

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.client import Client, SyncClient
from metnos_exec.errors import BadMessage
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.sandbox.doubles import EchoSandbox
from metnos_exec.sandbox.select import ArmChoice
from metnos_exec.supervisor import Supervisor, SupervisorConfig
from metnos_exec.toolcall import parse_tool_call
from tests.helpers.worker_cli import wait_for_event, worker_argv

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "executors"


def chat_call(
    name: str, args: Any, call_id: str = "call_1"
) -> ChatCompletionMessageFunctionToolCall:
    text = args if isinstance(args, str) else json.dumps(args)
    return ChatCompletionMessageFunctionToolCall(
        id=call_id, type="function", function=Function(name=name, arguments=text)
    )


def responses_call(name: str, args: dict[str, Any]) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        type="function_call", call_id="fc_1", name=name, arguments=json.dumps(args)
    )


def anthropic_call(name: str, args: dict[str, Any]) -> ToolUseBlock:
    return ToolUseBlock(type="tool_use", id="toolu_1", name=name, input=args)


def check_shape(param_type: Any, reply: dict[str, Any]) -> None:
    """`reply` is a valid `param_type` (a TypedDict of the SDK) with no key it lacks."""
    TypeAdapter(param_type).validate_python(reply)
    assert set(reply) <= set(param_type.__annotations__), reply


def _echo(runtime: str, **_: Any) -> ArmChoice:
    return ArmChoice(EchoSandbox())


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "home" / "notes").mkdir(parents=True)
    (tmp_path / "home" / "notes" / "a.md").write_text("hello\n")
    return tmp_path / "home"


async def _with_worker(home: Path, body: Any) -> None:
    broker = MemoryBroker()
    registry = ExecutorRegistry.load(EXAMPLES)
    sup = Supervisor(
        broker, registry, SupervisorConfig(worker_id="w", home=str(home)), arm_chooser=_echo
    )
    async with Client(broker) as client, anyio.create_task_group() as tg:
        await tg.start(sup.run)
        await body(client)
        await sup.drain(1)


@pytest.mark.anyio
async def test_round_trips_in_each_providers_shape(home: Path) -> None:
    async def body(client: Client) -> None:
        args = {"path": "~/notes/a.md", "max_bytes": None}
        reply = await client.run_tool_call(chat_call("read_notes", args), timeout=10)
        check_shape(ChatCompletionToolMessageParam, reply)
        assert reply["role"] == "tool" and reply["tool_call_id"] == "call_1"
        first, line = reply["content"].split("\n")
        # The echo double hands back the final arguments: the path resolved, the null
        # max_bytes replaced by its default.
        assert json.loads(first) == {"path": str(home / "notes" / "a.md"), "max_bytes": 65536}
        assert line.startswith("[metnos-exec] job ") and "succeeded in the echo sandbox" in line

        reply = await client.run_tool_call(responses_call("read_notes", {"path": "~/notes"}))
        check_shape(FunctionCallOutput, reply)
        assert reply["call_id"] == "fc_1" and reply["type"] == "function_call_output"
        assert "succeeded" in reply["output"] and not reply["output"].startswith("ERROR")

        reply = await client.run_tool_call(anthropic_call("word_count", {"path": "~/notes"}))
        check_shape(ToolResultBlockParam, reply)
        assert reply["tool_use_id"] == "toolu_1" and reply["is_error"] is False

        # The same calls as plain dicts (what a framework or a JSON log hands over).
        as_dict = anthropic_call("read_notes", {}).model_dump()
        reply = await client.run_tool_call(as_dict)
        assert reply["type"] == "tool_result" and reply["is_error"] is False

    await _with_worker(home, body)


@pytest.mark.anyio
async def test_a_refused_call_is_an_error_the_model_can_read(home: Path) -> None:
    async def body(client: Client) -> None:
        outside = {"path": "/etc/passwd"}
        reply = await client.run_tool_call(anthropic_call("read_notes", outside))
        check_shape(ToolResultBlockParam, reply)
        assert reply["is_error"] is True
        text = reply["content"]
        assert text.startswith("ERROR: the tool call was refused before it ran"), text
        assert "E_CAPABILITY_DENIED" in text and "/etc/passwd" in text
        assert "job " in text and " rejected" in text

        reply = await client.run_tool_call(chat_call("read_notes", outside))
        assert reply["content"].startswith("ERROR:") and "E_CAPABILITY_DENIED" in reply["content"]

        bad_type = {"path": "~/notes", "max_bytes": "lots"}
        reply = await client.run_tool_call(responses_call("read_notes", bad_type))
        assert reply["output"].startswith("ERROR:") and "E_BAD_ARGS" in reply["output"]

    await _with_worker(home, body)


@pytest.mark.anyio
async def test_calls_the_queue_cannot_take_are_error_results(home: Path) -> None:
    async def body(client: Client) -> None:
        reply = await client.run_tool_call(anthropic_call("read_nots", {}))
        assert reply["is_error"] is True
        assert "no worker on this queue serves" in reply["content"]
        assert "did you mean read_notes" in reply["content"]

        reply = await client.run_tool_call(chat_call("read_notes", "{not json"))
        check_shape(ChatCompletionToolMessageParam, reply)
        assert reply["content"].startswith("ERROR: read_notes: the arguments are not valid JSON")

        reply = await client.run_tool_call(chat_call("read_notes", "[1]"))
        assert "must be a JSON object, got list" in reply["content"]

    await _with_worker(home, body)
    async with Client(MemoryBroker()) as client:
        with pytest.raises(BadMessage, match="not a tool call"):
            await client.run_tool_call({"type": "text", "text": "hi"})


def test_parse_reads_attributes_of_objects_without_model_dump() -> None:
    class Fn:
        name = "read_notes"
        arguments = '{"path": "~/notes"}'

    class Call:
        id = "c"
        type = "function"
        function = Fn()

    parsed = parse_tool_call(Call())
    assert parsed.provider == "openai-chat" and parsed.args == {"path": "~/notes"}
    assert parse_tool_call(chat_call("wasm_hello", "")).args == {}


def test_the_sync_client_runs_a_tool_call(tmp_path: Path) -> None:
    """`SyncClient.run_tool_call` against a real ``metnos-exec worker`` process."""
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    env = {**os.environ, "METNOS_ARM_OVERRIDE": "echo", "HOME": str(tmp_path)}
    url = f"sqlite:///{tmp_path}/q.db"
    log = tmp_path / "worker.jsonl"
    worker = subprocess.Popen(
        worker_argv(url, EXAMPLES, log, "--home", str(home)),
        env=env,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for_event(log, "worker.started", worker)
        with SyncClient(url) as client:
            reply = client.run_tool_call(chat_call("read_notes", {"path": "~/notes"}), wait=30)
            refused = client.run_tool_call(anthropic_call("read_notes", {"path": "/etc"}))
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert "succeeded" in reply["content"] and not reply["content"].startswith("ERROR")
    assert refused["is_error"] is True and "E_CAPABILITY_DENIED" in refused["content"]
