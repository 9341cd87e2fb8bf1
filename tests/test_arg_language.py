"""The argument language is JSON Schema (issue 19): nested ``items`` and ``properties``
load, are enforced by the worker's check, export 1:1, and a construct without a JSON
Schema meaning the worker enforces is refused at load, naming its field; the JSON Schema
of ``manifest.toml`` itself describes the example manifests."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from metnos_exec import _schemas
from metnos_exec.capabilities import final_args
from metnos_exec.errors import BadArguments, BadManifest
from metnos_exec.manifest import load_manifest
from metnos_exec.toolspec import input_schema
from tests.helpers.rich_manifest import RICH, write_executor

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "executors"

GOOD_ARGS: dict[str, Any] = {
    "title": "Alps",
    "legs": [{"from": "Turin", "to": "Chamonix", "by": "bus"}, {"from": "x", "to": "y"}],
    "tags": ["hiking"],
    "traveller": {"name": "Ada", "age": 36},
}


def test_nested_schema_loads_and_exports_one_to_one(tmp_path: Path) -> None:
    manifest = load_manifest(write_executor(tmp_path))
    legs = manifest.args["legs"]
    assert legs.items is not None and legs.items.properties is not None
    assert legs.items.properties["from"].required
    schema = input_schema(manifest)
    assert schema["properties"]["legs"]["items"] == {
        "type": "object",
        "properties": {
            "from": {"type": "string"},
            "to": {"type": "string"},
            "by": {"type": "string", "enum": ["train", "plane", "bus"]},
        },
        "additionalProperties": False,
        "required": ["from", "to"],
    }
    assert schema["properties"]["tags"]["items"]["enum"] == ["beach", "city", "hiking"]
    jsonschema.Draft202012Validator.check_schema(schema)


def test_the_worker_enforces_what_the_schema_says(tmp_path: Path) -> None:
    """Every value the worker's check accepts the exported schema accepts, and every one
    it refuses the schema refuses (the same language, enforced twice)."""
    manifest = load_manifest(write_executor(tmp_path))
    validator = jsonschema.Draft202012Validator(input_schema(manifest))
    out = final_args(manifest, GOOD_ARGS)
    assert out["nights"] == 3 and out["class"] == "economy"
    assert validator.is_valid(GOOD_ARGS)
    bad: list[tuple[dict[str, Any], str]] = [
        ({**GOOD_ARGS, "tags": ["moon"]}, r"`tags\[0\]` = 'moon' is not one of"),
        ({**GOOD_ARGS, "tags": "beach"}, "`tags` must be of type array"),
        ({**GOOD_ARGS, "legs": [{"from": "a"}]}, r"`legs\[0\].to` is required"),
        ({**GOOD_ARGS, "legs": [{"from": "a", "to": "b", "via": "c"}]}, "unknown key"),
        ({**GOOD_ARGS, "legs": [{"from": 1, "to": "b"}]}, r"`legs\[0\].from` must be"),
        ({**GOOD_ARGS, "traveller": {"age": 3}}, "`traveller.name` is required"),
        ({**GOOD_ARGS, "traveller": {"name": "a", "age": 1.5}}, "`traveller.age` must be"),
        ({**GOOD_ARGS, "traveller": {"name": "a", "age": True}}, "`traveller.age` must be"),
    ]
    for args, message in bad:
        with pytest.raises(BadArguments, match=message):
            final_args(manifest, args)
        assert not validator.is_valid(args), args


def test_null_counts_as_absent_at_every_depth(tmp_path: Path) -> None:
    """What lets strict mode make optional arguments nullable without changing them: a
    ``null`` optional argument or property is dropped (the default applies at the top)."""
    manifest = load_manifest(write_executor(tmp_path))
    args = {
        **GOOD_ARGS,
        "nights": None,
        "budget": None,
        "legs": [{"from": "a", "to": "b", "by": None}],
        "traveller": {"name": "Ada", "age": None},
    }
    out = final_args(manifest, args)
    assert out["nights"] == 3 and "budget" not in out
    assert out["legs"] == [{"from": "a", "to": "b"}]
    assert out["traveller"] == {"name": "Ada"}
    with pytest.raises(BadArguments, match=r"`legs\[0\].to` is required"):
        final_args(manifest, {**GOOD_ARGS, "legs": [{"from": "a", "to": None}]})


@pytest.mark.parametrize(
    ("table", "field", "problem"),
    [
        ('[args.a]\ntype = "string"\nitems = { type = "string" }', "args.a.items", "array"),
        (
            '[args.a]\ntype = "array"\nproperties = { b = { type = "string" } }',
            "args.a.properties",
            "describes an object",
        ),
        (
            '[args.a]\ntype = "array"\nitems = { type = "string", default = "x" }',
            "args.a.items.default",
            "top-level arguments only",
        ),
        (
            '[args.a]\ntype = "object"\n[args.a.properties.p]\ntype = "string"\nformat = "path"',
            "args.a.properties.p.format",
            "top-level arguments only",
        ),
        (
            '[args.a]\ntype = "array"\nitems = { type = "string", required = true }',
            "args.a.items.required",
            "not properties",
        ),
        ('[args.a]\ntype = "integer"\nenum = [1, "two"]', "args.a.enum[1]", "not of type"),
        (
            '[args.a]\ntype = "array"\nitems = { type = "string", pattern = "x" }',
            "args.a.items.pattern",
            "unknown field",
        ),
    ],
)
def test_constructs_without_an_enforced_meaning_are_refused(
    tmp_path: Path, table: str, field: str, problem: str
) -> None:
    text = 'name = "t"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n' + table
    with pytest.raises(BadManifest, match=problem) as info:
        load_manifest(write_executor(tmp_path, text, "t"))
    assert f"field `{field}`" in str(info.value)


def test_manifest_schema_describes_every_example_and_the_rich_one(tmp_path: Path) -> None:
    schema = json.loads(_schemas.render()["manifest.json"])
    validator = jsonschema.Draft202012Validator(schema)
    manifests = [tomllib.loads(p.read_text()) for p in sorted(EXAMPLES.glob("*/manifest.toml"))]
    assert len(manifests) >= 5
    for doc in [*manifests, tomllib.loads(RICH)]:
        errors = list(validator.iter_errors(doc))
        assert not errors, errors
    assert not validator.is_valid({**manifests[0], "bogus": 1})
    assert not validator.is_valid({**manifests[0], "runtime": "node"})


@pytest.mark.parametrize(
    ("table", "field", "problem"),
    [
        ('[output.a]\ntype = "string"\ndefault = "x"', "output.a.default", "no default"),
        ('[output.a]\ntype = "string"\nformat = "path"', "output.a.format", "not for an output"),
        (
            '[output.a]\ntype = "array"\n[output.a.items]\ntype = "object"\n'
            '[output.a.items.properties.b]\ntype = "integer"\ndefault = 1',
            "output.a.items.properties.b.default",
            "no default",
        ),
        ('[output.a]\ntype = "integer"\nenum = ["one"]', "output.a.enum[0]", "not of type"),
        ('[output.a]\ntype = "string"\npattern = "x"', "output.a.pattern", "unknown field"),
    ],
)
def test_an_output_schema_takes_the_argument_language_without_defaults_or_formats(
    tmp_path: Path, table: str, field: str, problem: str
) -> None:
    text = 'name = "t"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n' + table
    with pytest.raises(BadManifest, match=problem) as info:
        load_manifest(write_executor(tmp_path, text, "t"))
    assert f"field `{field}`" in str(info.value)
