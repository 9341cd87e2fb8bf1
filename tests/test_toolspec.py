"""An executor as a tool: names and input schemas (`metnos_exec.toolspec`)."""

from __future__ import annotations

from pathlib import Path

from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import UNDO_EXECUTOR
from metnos_exec.toolspec import TOOL_NAME_RE, executor_for_tool, input_schema, tool_name

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "executors"


def test_every_example_is_a_tool_with_a_closed_schema() -> None:
    registry = ExecutorRegistry.load(EXAMPLES)
    assert len(registry) >= 5
    for name in registry:
        manifest = registry[name].manifest
        schema = input_schema(manifest)
        assert TOOL_NAME_RE.fullmatch(tool_name(name)) and tool_name(name) == name
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert set(schema["properties"]) == set(manifest.args)
        assert set(schema.get("required", [])) == {
            a for a, s in manifest.args.items() if s.required
        }
    note = input_schema(registry["write_note"].manifest)
    assert note["properties"]["mode"] == {
        "type": "string",
        "enum": ["append", "replace", "sync"],
        "default": "append",
    }


def test_reserved_names_become_valid_tool_names_and_map_back() -> None:
    assert tool_name(UNDO_EXECUTOR) == "metnos_undo"
    assert executor_for_tool("metnos_undo", ["read_notes", UNDO_EXECUTOR]) == UNDO_EXECUTOR
    assert executor_for_tool("nope", ["read_notes"]) is None
    assert TOOL_NAME_RE.fullmatch(tool_name("x" * 100 + ":y"))
