"""`metnos_exec.tools.mcp_spec`: annotations from capabilities, results as tool results (no
MCP SDK needed), and the HTTP bind rule of the server."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from metnos_exec.manifest import ExecutorRegistry, Manifest
from metnos_exec.messages import ErrorInfo, Result
from metnos_exec.tools.mcp_spec import error_result, tool_annotations, tool_definition, tool_result
from metnos_exec.toolspec import input_schema, output_schema

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "executors"
REGISTRY = ExecutorRegistry.load(EXAMPLES)


def _manifest(**fields: object) -> Manifest:
    base = {"name": "x", "version": "1", "runtime": "python", "entry": "main.py"}
    return msgspec.convert({**base, **fields}, Manifest)


def test_annotations_of_the_examples() -> None:
    got = {name: tool_annotations(e.manifest) for name, e in REGISTRY.items()}
    for name in ("read_notes", "word_count", "wasm_hello"):
        assert got[name]["readOnlyHint"] is True and got[name]["openWorldHint"] is False
        assert "destructiveHint" not in got[name]
    for name in ("write_note", "move_note", "delete_note", "fetch_url"):
        assert got[name]["readOnlyHint"] is False and got[name]["destructiveHint"] is True
    # write_note's network is only active in sync mode: still counted (the worst call).
    assert got["write_note"]["openWorldHint"] is True
    assert got["fetch_url"]["openWorldHint"] is True
    assert all(a["idempotentHint"] is False for a in got.values())


def test_destructive_is_false_only_for_file_only_writers_with_assume_staged() -> None:
    staged = {n: tool_annotations(e.manifest, assume_staged=True) for n, e in REGISTRY.items()}
    assert staged["delete_note"]["destructiveHint"] is False
    assert staged["move_note"]["destructiveHint"] is False
    assert staged["write_note"]["destructiveHint"] is True  # it may sync over the network
    assert staged["fetch_url"]["destructiveHint"] is True
    provider = _manifest(capabilities=[{"name": "provider:access", "hints": ["google_mail"]}])
    a = tool_annotations(provider, assume_staged=True)
    assert a["readOnlyHint"] is False and a["openWorldHint"] is True
    assert a["destructiveHint"] is True
    mutating = tool_annotations(_manifest(mutating=True))
    assert mutating["readOnlyHint"] is False


def test_tool_definition_uses_toolspec() -> None:
    m = REGISTRY["read_notes"].manifest
    tool = tool_definition(m)
    assert tool["name"] == "read_notes" and tool["inputSchema"] == input_schema(m)
    assert "fs:read ~/notes/**" in tool["description"]


def test_a_declared_output_is_the_output_schema_and_is_enforced() -> None:
    """read_notes declares its output: the tool has outputSchema; a conforming output is
    structured content, one that breaks the schema is an isError result saying why."""
    m = REGISTRY["read_notes"].manifest
    assert tool_definition(m)["outputSchema"] == output_schema(m)
    assert "outputSchema" not in tool_definition(REGISTRY["word_count"].manifest)
    good = {"kind": "note", "path": "/n/a.md", "text": "milk", "truncated": False}
    ok = tool_result(Result(job_id="j", status="succeeded", output=good), m)
    assert ok["isError"] is False and ok["structuredContent"] == good
    bad = tool_result(Result(job_id="j", status="succeeded", output={"kind": "note"}), m)
    assert bad["isError"] is True and "structuredContent" not in bad
    text = bad["content"][0]["text"]
    assert "does not match the tool's output schema" in text
    assert "output.path is required" in text and '{"kind": "note"}' in text
    assert bad["_meta"]["error_code"] == "E_BAD_OUTPUT" and bad["_meta"]["status"] == "succeeded"
    failed = tool_result(Result(job_id="j", status="failed", output={"error": "x"}), m)
    assert failed["isError"] is True and "job failed" in failed["content"][0]["text"]


def test_a_succeeded_result() -> None:
    out = tool_result(Result(job_id="j1", status="succeeded", output={"n": 1}, undo_ids=("u",)))
    assert out["isError"] is False and out["structuredContent"] == {"n": 1}
    assert out["content"] == [{"type": "text", "text": '{"n": 1}'}]
    assert out["_meta"]["job_id"] == "j1" and out["_meta"]["undo_ids"] == ["u"]
    listed = tool_result(Result(job_id="j2", status="succeeded", output=[1, 2]))
    assert listed["structuredContent"] == {"result": [1, 2]}


@pytest.mark.parametrize(
    ("status", "words"),
    [
        ("rejected", "refused"),
        ("failed", "failed"),
        ("timed_out", "ran out of time"),
        ("cancelled", "cancelled"),
        ("dead", "given up"),
    ],
)
def test_an_unsuccessful_result_is_an_error_result(status: str, words: str) -> None:
    error = ErrorInfo(code="E_CAPABILITY_DENIED", message="`path` is outside every hint")
    out = tool_result(Result(job_id="j", status=status, error=error))  # type: ignore[arg-type]
    assert out["isError"] is True and "structuredContent" not in out
    text = out["content"][0]["text"]
    assert words in text and "E_CAPABILITY_DENIED: `path` is outside every hint" in text
    assert out["_meta"]["error_code"] == "E_CAPABILITY_DENIED"


def test_error_result() -> None:
    out = error_result("E_UNKNOWN_EXECUTOR", "no such executor")
    assert out["isError"] is True and out["content"][0]["text"].startswith("refused: E_")


def test_http_bind_rule() -> None:
    pytest.importorskip("mcp")
    from metnos_exec.tools.mcp_server import check_http_bind, needs_token

    assert not needs_token("127.0.0.1") and not needs_token("::1") and not needs_token("[::1]")
    assert not needs_token("localhost")
    for host in ("127.0.0.2", "0.0.0.0", "192.168.1.5", "::"):
        assert needs_token(host)
        with pytest.raises(ValueError, match="needs a bearer token"):
            check_http_bind(host, None)
        check_http_bind(host, "t")
    with pytest.raises(ValueError, match="not an IP address"):
        check_http_bind("example.com", "t")


def test_a_result_awaiting_approval_names_the_job_and_carries_the_change_set() -> None:
    from metnos_exec.changeset import ChangeEntry, ChangeSet

    changes = ChangeSet(
        entries=(ChangeEntry(path="/h/notes/a.txt", kind="created", type="file", size_after=1),),
        total=1,
        committed=False,
    )
    result = Result(
        job_id="01GATED", status="awaiting_approval", output={"ok": True}, changes=changes
    )
    out = tool_result(result)
    assert out["isError"] is False and out["structuredContent"] == {"ok": True}
    text = out["content"][0]["text"]
    assert "await approval" in text and "metnos-exec approve 01GATED" in text
    assert out["_meta"]["awaiting_approval"] is True
    assert out["_meta"]["changes"]["entries"][0]["path"] == "/h/notes/a.txt"
    assert out["_meta"]["changes"]["committed"] is False
