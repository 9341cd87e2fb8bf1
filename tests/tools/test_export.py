"""Tool definitions (issue 19, acceptance 3): every example executor and one using the
whole argument language, exported for OpenAI (Chat and Responses) and Anthropic, validate
against the SDKs' own type definitions; strict mode's rules hold in every strict schema
and keep what the worker accepts; ``metnos-exec tools`` prints them from a folder or from
the catalog."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
from anthropic.types import ToolParam
from anthropic.types.tool_param import InputSchemaTyped
from openai.types.chat import ChatCompletionToolParam
from openai.types.responses import FunctionToolParam
from openai.types.shared_params import FunctionDefinition
from pydantic import TypeAdapter

from metnos_exec.brokers import open_broker
from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.capabilities import final_args
from metnos_exec.cli import main
from metnos_exec.devices.catalog import ExecutorInfo
from metnos_exec.manifest import ExecutorRegistry, Manifest, load_manifest
from metnos_exec.tools import (
    FORMATS,
    definitions_from_catalog,
    definitions_from_folder,
    tool_definition,
)
from metnos_exec.tools.mcp_spec import tool_annotations
from metnos_exec.toolspec import TOOL_NAME_RE, input_schema, output_schema
from tests.helpers.rich_manifest import LOOSE, write_executor

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples" / "executors"


def _keys_of(typed_dict: Any) -> set[str]:
    keys: set[str] = set()
    for klass in typed_dict.__mro__:
        keys |= set(getattr(klass, "__annotations__", {}))
    return keys


def check(typed_dict: Any, value: dict[str, Any]) -> None:
    """`value` is a valid `typed_dict` of the SDK, holding no key the type lacks
    (pydantic ignores extra keys of a TypedDict; the APIs refuse them)."""
    TypeAdapter(typed_dict).validate_python(value)
    assert set(value) <= _keys_of(typed_dict), (set(value), typed_dict)


@pytest.fixture
def manifests(tmp_path: Path) -> list[Manifest]:
    registry = ExecutorRegistry.load(EXAMPLES, strict=True)
    rich = load_manifest(write_executor(tmp_path))
    return [*(registry[name].manifest for name in registry), rich]


def test_definitions_validate_against_the_sdks_types(manifests: list[Manifest]) -> None:
    assert len(manifests) >= 6
    for manifest in manifests:
        chat = tool_definition(manifest, "openai")
        check(ChatCompletionToolParam, chat)
        check(FunctionDefinition, chat["function"])
        responses = tool_definition(manifest, "openai-responses")
        check(FunctionToolParam, responses)
        anthropic = tool_definition(manifest, "anthropic")
        check(ToolParam, anthropic)
        # ToolParam takes any dict as input_schema too; its typed arm wants an object.
        TypeAdapter(InputSchemaTyped).validate_python(anthropic["input_schema"])
        for d in (chat["function"], responses, anthropic):
            assert TOOL_NAME_RE.fullmatch(d["name"]) and d["description"]
        assert chat["function"]["strict"] is True and responses["strict"] is True
        assert anthropic["input_schema"] == input_schema(manifest)
        for schema in (chat["function"]["parameters"], anthropic["input_schema"]):
            jsonschema.Draft202012Validator.check_schema(schema)


def _walk(node: dict[str, Any], at: str = "$") -> list[str]:
    """Every break of strict mode's rules in `node`, by path."""
    broken = []
    if "default" in node:
        broken.append(f"{at}: default")
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    if "enum" in node and "null" in types and None not in node["enum"]:
        broken.append(f"{at}: nullable but null is not in the enum")
    if "object" in types:
        props = node.get("properties")
        if props is None:
            return [*broken, f"{at}: object without properties"]
        if node.get("additionalProperties") is not False:
            broken.append(f"{at}: not closed")
        if sorted(node.get("required", [])) != sorted(props):
            broken.append(f"{at}: not every property required")
        for name, sub in props.items():
            broken += _walk(sub, f"{at}.{name}")
    if "array" in types:
        if "items" not in node:
            return [*broken, f"{at}: array without items"]
        broken += _walk(node["items"], f"{at}[]")
    return broken


def _nullable_paths(plain: dict[str, Any], strict: dict[str, Any], at: str = "$") -> None:
    """Each property optional in `plain` is nullable in `strict`; each required one not."""
    if plain.get("type") == "object" and "properties" in plain:
        required = set(plain.get("required", ()))
        for name, sub in plain["properties"].items():
            strict_sub = strict["properties"][name]
            nullable = isinstance(strict_sub["type"], list) and "null" in strict_sub["type"]
            assert nullable == (name not in required), f"{at}.{name}"
            _nullable_paths(sub, strict_sub, f"{at}.{name}")
    if plain.get("type") == "array" and "items" in plain:
        _nullable_paths(plain["items"], strict["items"], f"{at}[]")


def test_strict_mode_rules_hold_and_keep_the_meaning(manifests: list[Manifest]) -> None:
    for manifest in manifests:
        strict = tool_definition(manifest, "openai")["function"]["parameters"]
        assert _walk(strict) == [], manifest.name
        _nullable_paths(input_schema(manifest), strict)
    rich = manifests[-1]
    strict = tool_definition(rich, "openai-responses")["parameters"]
    assert strict["properties"]["nights"]["description"] == "null: the default, 3"
    assert strict["properties"]["class"]["enum"] == ["economy", "business", None]
    # What a strict model must send (every key, null for "not given") is valid under the
    # strict schema and means to the worker what the same call without the nulls means.
    sparse = {"title": "t", "legs": [{"from": "a", "to": "b"}], "traveller": {"name": "n"}}
    full = {
        "title": "t",
        "budget": None,
        "nights": None,
        "class": None,
        "tags": None,
        "legs": [{"from": "a", "to": "b", "by": None}],
        "traveller": {"name": "n", "age": None},
    }
    validator = jsonschema.Draft202012Validator(strict)
    assert validator.is_valid(full) and not validator.is_valid(sparse)
    assert final_args(rich, full) == final_args(rich, sparse)
    jsonschema.Draft202012Validator(input_schema(rich)).validate(sparse)


def test_what_strict_mode_cannot_express_is_exported_not_strict(tmp_path: Path) -> None:
    loose = load_manifest(write_executor(tmp_path, LOOSE, "plan_loose"))
    chat = tool_definition(loose, "openai")
    check(ChatCompletionToolParam, chat)
    assert chat["function"]["strict"] is False
    params = chat["function"]["parameters"]
    comment = params.pop("$comment")
    assert "arguments.extra is an object of any keys" in comment
    assert "arguments.notes is an array of any elements" in comment
    assert params == input_schema(loose)  # the plain schema, which the worker checks
    responses = tool_definition(loose, "openai-responses")
    check(FunctionToolParam, responses)
    assert responses["strict"] is False and "$comment" in responses["parameters"]


def test_mcp_definitions_carry_annotations_from_the_capabilities() -> None:
    registry = ExecutorRegistry.load(EXAMPLES)
    tools = {n: tool_definition(registry[n].manifest, "mcp") for n in registry}
    for name, tool in tools.items():
        declared = output_schema(registry[name].manifest)
        keys = {"name", "description", "inputSchema", "annotations"}
        assert set(tool) == (keys | {"outputSchema"} if declared else keys)
        if declared:
            assert tool["outputSchema"] == declared
            jsonschema.Draft202012Validator.check_schema(declared)
    assert "outputSchema" in tools["read_notes"]  # the example that declares its output
    hints = {n: t["annotations"] for n, t in tools.items()}
    assert hints["read_notes"]["readOnlyHint"] and not hints["read_notes"]["openWorldHint"]
    # The MCP server's own rules (tools/mcp_spec): a network request is never read-only,
    # and a writer is destructive unless the operator says every worker stages writes.
    assert not hints["fetch_url"]["readOnlyHint"] and hints["fetch_url"]["openWorldHint"]
    assert not hints["delete_note"]["readOnlyHint"] and hints["delete_note"]["destructiveHint"]
    assert hints["write_note"]["destructiveHint"] and hints["write_note"]["openWorldHint"]
    for name in registry:
        assert hints[name] == tool_annotations(registry[name].manifest)


@pytest.mark.anyio
async def test_the_catalog_gives_what_the_folder_gives() -> None:
    registry = ExecutorRegistry.load(EXAMPLES)
    broker = MemoryBroker()
    assert await definitions_from_catalog(broker, "openai") == []
    await broker.publish_executors(
        [ExecutorInfo(name=n, manifest=registry[n].manifest, worker="w") for n in registry]
    )
    for fmt in FORMATS:
        from_folder, errors = definitions_from_folder(EXAMPLES, fmt)
        assert errors == {}
        assert await definitions_from_catalog(broker, fmt) == from_folder


def test_the_tools_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for fmt in FORMATS:
        assert main(["tools", "--executors", str(EXAMPLES), "--format", fmt]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc == definitions_from_folder(EXAMPLES, fmt)[0]
    root = tmp_path / "ex"
    write_executor(root, LOOSE, "plan_loose")
    (root / "broken").mkdir()
    (root / "broken" / "manifest.toml").write_text('name = "broken"\n')
    assert main(["tools", "--executors", str(root)]) == 0
    out = capsys.readouterr()
    assert [t["function"]["name"] for t in json.loads(out.out)] == ["plan_loose"]
    assert "note: plan_loose: Exported with strict: false" in out.err
    assert "left out:" in out.err and "broken" in out.err

    url = f"sqlite:///{tmp_path}/q.db"
    loose = load_manifest(root / "plan_loose" / "manifest.toml")

    async def publish(infos: list[ExecutorInfo]) -> None:
        async with open_broker(url) as broker:
            await broker.publish_executors(infos)

    anyio.run(publish, [])
    with pytest.raises(SystemExit) as info:
        main(["tools", "--broker", url])
    assert info.value.code == 5 and "no server worker has published" in capsys.readouterr().err
    anyio.run(publish, [ExecutorInfo(name="plan_loose", manifest=loose, worker="w")])
    assert main(["tools", "--broker", url, "--format", "anthropic"]) == 0
    [tool] = json.loads(capsys.readouterr().out)
    assert tool["name"] == "plan_loose" and tool["input_schema"] == input_schema(loose)


def test_tools_help_names_every_option() -> None:
    from metnos_exec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    tools = sub.choices["tools"]  # type: ignore[attr-defined]
    for action in tools._actions:
        assert action.help, action.dest
