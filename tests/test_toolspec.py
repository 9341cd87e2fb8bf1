"""An executor as a tool: names and input schemas (`metnos_exec.toolspec`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import UNDO_EXECUTOR
from metnos_exec.toolspec import (
    TOOL_NAME_RE,
    executor_for_tool,
    input_schema,
    output_problem,
    output_schema,
    tool_name,
)

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


READ_NOTES = ExecutorRegistry.load(EXAMPLES)["read_notes"].manifest

NOTE = {"kind": "note", "path": "/h/notes/a.md", "text": "milk", "truncated": False}
FOLDER = {"kind": "folder", "path": "/h/notes", "notes": [{"path": "a", "bytes": 1, "modified": 2}]}


def test_output_schema_is_the_declared_output_and_absent_when_none_is() -> None:
    schema = output_schema(READ_NOTES)
    assert schema is not None and schema["type"] == "object"
    assert schema["additionalProperties"] is False and schema["required"] == ["kind", "path"]
    assert schema["properties"]["kind"]["enum"] == ["note", "folder"]
    item = schema["properties"]["notes"]["items"]
    assert item["required"] == ["path", "bytes", "modified"]
    assert output_schema(ExecutorRegistry.load(EXAMPLES)["word_count"].manifest) is None
    assert output_problem(ExecutorRegistry.load(EXAMPLES)["word_count"].manifest, 1) is None


@pytest.mark.parametrize(
    ("output", "problem"),
    [
        (NOTE, None),
        (FOLDER, None),
        ({"kind": "note"}, "output.path is required"),
        ({**NOTE, "kind": "neither"}, "is not one of"),
        ({**NOTE, "extra": 1}, "'extra', which the schema does not declare"),
        ({**NOTE, "truncated": 0}, "output.truncated must be of type boolean"),
        ({**FOLDER, "notes": [{"path": "a", "bytes": True, "modified": 2}]}, "bytes must be"),
        ({**FOLDER, "notes": [{"path": "a", "bytes": 1}]}, "notes[0].modified is required"),
        ({**FOLDER, "notes": [{"path": "a", "bytes": 1.5, "modified": 2}]}, "type integer"),
        ({**NOTE, "path": None}, "must be of type string, got null"),
        ([NOTE], "the output is a JSON array, not an object"),
        ("text", "the output is a JSON string, not an object"),
    ],
)
def test_output_problem_agrees_with_a_json_schema_validator(
    output: Any, problem: str | None
) -> None:
    """What output_problem accepts, jsonschema accepts too (so an MCP client's validation
    of structuredContent never fails on an output we passed), and each refusal says where."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = output_schema(READ_NOTES)
    got = output_problem(READ_NOTES, output)
    valid = jsonschema.Draft202012Validator(schema).is_valid(output)
    if problem is None:
        assert got is None and valid
    else:
        assert got is not None and problem in got, got
        assert not valid
