"""Manifests: good ones load into frozen Structs; bad ones name the file, field and reason."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from metnos_exec.errors import BadManifest, UnknownExecutor
from metnos_exec.manifest import ExecutorRegistry, Manifest, load_manifest

GOOD = """
name = "write_note"
version = "1.0.0"
description = "Write or append a line to a note under ~/notes"
runtime = "python"
entry = "main.py"

[args.path]
type = "string"
required = true
[args.text]
type = "string"
required = true
[args.mode]
type = "string"
enum = ["append", "replace", "sync"]
default = "append"

[[capabilities]]
name = "fs:write"
hints = ["~/notes/**"]

[[capabilities]]
name = "network:https"
hints = ["notes.example.com"]
when = { arg = "mode", values = ["sync"] }

[limits]
timeout_s = 30
memory_mb = 256
fuel = 10_000_000_000
"""


MODE_TABLE = (
    '[args.mode]\ntype = "string"\nenum = ["append", "replace", "sync"]\ndefault = "append"'
)


def write(folder: Path, text: str, *, entry: str = "main.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / entry).write_text("")
    path = folder / "manifest.toml"
    path.write_text(text)
    return path


def test_spec_example_loads(tmp_path: Path) -> None:
    m = load_manifest(write(tmp_path / "w", GOOD))
    assert m.name == "write_note" and m.runtime == "python"
    assert m.args["mode"].enum == ("append", "replace", "sync")
    assert m.args["mode"].default == "append"
    assert [c.name for c in m.capabilities] == ["fs:write", "network:https"]
    assert m.capabilities[1].when == {"arg": "mode", "values": ["sync"]}
    assert (m.capabilities[0].kind, m.capabilities[0].mode) == ("fs", "write")
    assert m.limits.fuel == 10_000_000_000
    assert m.is_mutating
    with pytest.raises(AttributeError):
        m.name = "x"  # type: ignore[misc]


def test_malformed_when_still_loads(tmp_path: Path) -> None:
    # A malformed `when` is an invocation-time verdict (inactive capability), never a load
    # error that would hide the executor.
    text = GOOD.replace('when = { arg = "mode", values = ["sync"] }', 'when = "mode == sync"')
    m = load_manifest(write(tmp_path / "w", text))
    assert m.capabilities[1].when == "mode == sync"


def test_mutating_can_be_declared() -> None:
    base = {"name": "t", "version": "1", "runtime": "python", "entry": "m"}
    assert not msgspec.convert(base, Manifest).is_mutating
    assert msgspec.convert({**base, "mutating": True}, Manifest).is_mutating
    with_write = {**base, "capabilities": [{"name": "fs:write"}]}
    assert not msgspec.convert({**with_write, "mutating": False}, Manifest).is_mutating


@pytest.mark.parametrize(
    ("old", "new", "field", "reason"),
    [
        ('name = "write_note"', 'name = "Write Note"', "name", "must match"),
        ('name = "write_note"\n', "", "name", "missing required field"),
        ('runtime = "python"', 'runtime = "java"', "runtime", "Invalid enum value 'java'"),
        ('entry = "main.py"', 'entry = "../main.py"', "entry", "relative path inside"),
        ('entry = "main.py"', 'entry = "/bin/sh"', "entry", "relative path inside"),
        ('entry = "main.py"', 'entry = "other.py"', "entry", "does not exist"),
        ("timeout_s = 30", 'timeout_s = "30"', "limits.timeout_s", "Expected `float`, got `str`"),
        ("timeout_s = 30", "timeout_s = 0", "limits.timeout_s", "must be positive"),
        ("memory_mb = 256", "memory_mb = -1", "limits.memory_mb", "must be positive"),
        ("fuel = 10_000_000_000", "fuel = 0", "limits.fuel", "must be positive"),
        ('default = "append"', 'default = "prepend"', "args.mode.default", "not in the enum"),
        ('enum = ["append", "replace", "sync"]', "enum = []", "args.mode.enum", "not be empty"),
        ('type = "string"\nenum', 'type = "text"\nenum', "args.mode.type", "Invalid enum"),
        ('name = "fs:write"', 'name = "fswrite"', "capabilities[0].name", "kind:mode"),
        ('hints = ["~/notes/**"]', 'hints = "~/notes/**"', "capabilities[0].hints", "array"),
        ("[limits]", "[limits]\nbogus = 1", "limits.bogus", "unknown field `bogus`"),
        ('description = "', 'colour = "red"\ndescription = "', "colour", "unknown field `colour`"),
        (
            '[args.text]\ntype = "string"\nrequired = true',
            '[args.text]\ntype = "string"\nrequired = true\ndefault = "x"',
            "args.text",
            "can not be required",
        ),
        (
            MODE_TABLE,
            '[args.mode]\ntype = "integer"\ndefault = "append"',
            "args.mode.default",
            "is not of type integer",
        ),
        (
            MODE_TABLE,
            '[args.mode]\ntype = "integer"\ndefault = true',
            "args.mode.default",
            "is not of type integer",
        ),
        ("[args.path]", '[args.path]\nformat = "file"', "args.path.format", "Invalid enum"),
    ],
)
def test_bad_manifest_names_file_field_and_reason(
    tmp_path: Path, old: str, new: str, field: str, reason: str
) -> None:
    assert old in GOOD, old
    path = write(tmp_path / "w", GOOD.replace(old, new, 1))
    with pytest.raises(BadManifest) as ei:
        load_manifest(path)
    msg = str(ei.value)
    assert ei.value.code == "E_BAD_MANIFEST"
    assert str(path) in msg
    assert f"field `{field}`" in msg, msg
    assert reason in msg, msg


def test_not_toml_and_unreadable(tmp_path: Path) -> None:
    path = write(tmp_path / "w", "name = \n")
    with pytest.raises(BadManifest, match="not valid TOML") as ei:
        load_manifest(path)
    assert str(path) in str(ei.value)
    with pytest.raises(BadManifest, match="cannot read"):
        load_manifest(tmp_path / "nope" / "manifest.toml")


def test_registry_keeps_going_past_bad_manifests(tmp_path: Path) -> None:
    write(tmp_path / "good", GOOD)
    write(tmp_path / "bad", GOOD.replace('runtime = "python"', 'runtime = "java"'))
    write(tmp_path / "dup", GOOD)
    reg = ExecutorRegistry.load(tmp_path)
    assert list(reg) == ["write_note"] and len(reg) == 1
    assert reg["write_note"].path in (str(tmp_path / "dup"), str(tmp_path / "good"))
    assert reg.get_executor("write_note").entry_path.endswith("main.py")
    assert set(reg.errors) == {"bad", "write_note"}
    assert "already defined" in str(reg.errors["write_note"])
    with pytest.raises(BadManifest, match="runtime"):
        reg.get_executor("bad")
    with pytest.raises(UnknownExecutor, match="known: write_note"):
        reg.get_executor("nothing")
    with pytest.raises(BadManifest):
        ExecutorRegistry.load(tmp_path, strict=True)
    with pytest.raises(BadManifest, match="does not exist"):
        ExecutorRegistry.load(tmp_path / "missing")


def test_examples_load_strictly() -> None:
    examples = Path(__file__).resolve().parent.parent / "examples" / "executors"
    reg = ExecutorRegistry.load(examples, strict=True)
    assert {"read_notes", "write_note", "fetch_url"} <= set(reg)


@pytest.mark.parametrize(
    ("cap", "hints", "j", "reason"),
    [
        ("fs:write", '["/*"]', 0, "host root"),
        ("fs:read", '["/**"]', 0, "host root"),
        ("fs:write", '["relative/path"]', 0, "not absolute"),
        ("fs:read", '["~/notes/**", ""]', 1, "empty fs hint"),
        ("fs:read", '["~bob/notes"]', 0, "not '~user'"),
        ("fs:write", '["~/notes/../.ssh/**"]', 0, "'..' segment"),
        ("network:https", '["https://notes.example.com"]', 0, "not a host hint"),
        ("network:https", '["notes.example.com/v1"]', 0, "not a host hint"),
        ("network:https", '["example.com", "ex*ample.com"]', 1, "not a host hint"),
        ("network:https", '["user@example.com"]', 0, "not a host hint"),
        ("network:https", '["a b.com"]', 0, "not a host hint"),
        ("network:https", '[""]', 0, "not a host hint"),
        ("network:http", '["example.com:99999"]', 0, "above 65535"),
    ],
)
def test_malformed_hints_are_refused_at_load(
    tmp_path: Path, cap: str, hints: str, j: int, reason: str
) -> None:
    text = GOOD.replace(
        'name = "fs:write"\nhints = ["~/notes/**"]', f'name = "{cap}"\nhints = {hints}'
    )
    assert text != GOOD
    path = write(tmp_path / "w", text)
    with pytest.raises(BadManifest) as ei:
        load_manifest(path)
    msg = ei.value.message
    assert msg.startswith(f"{path}: field `capabilities[0].hints[{j}]`: "), msg
    assert reason in msg, msg


@pytest.mark.parametrize(
    ("cap", "hints"),
    [
        ("fs:read", '["~", "~/notes/**", "/tmp/*", "/srv/data/*.csv", "~/a/[0-9]*"]'),
        ("network:https", '["*", "example.com", "*.example.com", "EXAMPLE.org."]'),
        ("network:http", '["127.0.0.1:8080", "[::1]:80", "[::1]", "my_host-1.lan"]'),
        ("provider:access", '["google_mail", "not_a_skill"]'),  # reported per job, not here
        ("code:exec", '["anything at all"]'),  # unknown kinds grant nothing; kept as is
    ],
)
def test_sane_hints_load(tmp_path: Path, cap: str, hints: str) -> None:
    text = GOOD.replace(
        'name = "fs:write"\nhints = ["~/notes/**"]', f'name = "{cap}"\nhints = {hints}'
    )
    load_manifest(write(tmp_path / "w", text))
