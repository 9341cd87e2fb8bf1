"""The queue's messages: wire shape, validation at the edge, ids, and the JSON Schemas."""

from __future__ import annotations

import json

import msgspec
import pytest

from metnos_exec import _schemas
from metnos_exec.errors import BadMessage
from metnos_exec.messages import (
    STDERR_CAP_BYTES,
    DeadLetter,
    ErrorInfo,
    Job,
    Result,
    cap_text,
    decode_dead_letter,
    decode_job,
    decode_job_msgpack,
    decode_result,
    encode,
    encode_msgpack,
    new_job_id,
)
from metnos_exec.sandbox._types import AxisVerdict, ContainmentReport, Failure, Usage


def test_spec_example_job_decodes() -> None:
    wire = (
        b'{"v": 1, "id": "01JDX9ABCDEFGHJKMNPQRSTVWX", "executor": "write_note",'
        b' "args": {"path": "~/notes/today.md", "text": "buy milk"},'
        b' "timeout_s": 30, "autonomy": "supervised", "device": null, "max_attempts": 3,'
        b' "idempotency_key": "run-7/step-3", "correlation_id": "run-7/step-3"}'
    )
    job = decode_job(wire)
    assert job.executor == "write_note"
    assert job.args == {"path": "~/notes/today.md", "text": "buy milk"}
    assert job.timeout_s == 30.0 and job.max_attempts == 3 and job.priority == 0
    assert job.idempotency_key == "run-7/step-3"


def test_job_round_trips_in_json_and_msgpack() -> None:
    job = Job(executor="echo", args={"a": [1, 2]}, priority=5, not_before=123.5, device="p1")
    assert decode_job(encode(job)) == job
    assert decode_job_msgpack(encode_msgpack(job)) == job
    first = json.loads(encode(job))
    assert next(iter(first)) == "v" and first["v"] == 1


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    job = decode_job(b'{"executor": "echo", "added_in_v1_5": {"x": 1}}')
    assert job.executor == "echo"


@pytest.mark.parametrize(
    ("wire", "path"),
    [
        (b'{"executor": "echo", "max_attempts": "3"}', "$.max_attempts"),
        (b'{"executor": "echo", "max_attempts": 0}', "$.max_attempts"),
        (b'{"executor": "echo", "autonomy": "yolo"}', "$.autonomy"),
        (b'{"executor": "echo", "timeout_s": -1}', "$.timeout_s"),
        (b'{"executor": "", "args": {}}', "$.executor"),
        (b'{"executor": "echo", "args": [1]}', "$.args"),
        (b'{"args": {}}', "executor"),
    ],
)
def test_bad_fields_are_rejected_naming_the_path(wire: bytes, path: str) -> None:
    with pytest.raises(BadMessage) as info:
        decode_job(wire)
    assert info.value.code == "E_BAD_MESSAGE"
    assert path in info.value.message


@pytest.mark.parametrize("wire", [b"", b"not json", b"[1, 2]", b"\xff\xfe", b'{"executor"'])
def test_garbage_is_a_bad_message(wire: bytes) -> None:
    with pytest.raises(BadMessage):
        decode_job(wire)
    with pytest.raises(BadMessage):
        decode_job_msgpack(wire)


def test_newer_wire_version_is_refused() -> None:
    with pytest.raises(BadMessage, match="v=2"):
        decode_job(b'{"v": 2, "executor": "echo"}')


def test_ids_are_ulids_unique_and_sorted_in_creation_order() -> None:
    ids = [new_job_id() for _ in range(5000)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    alphabet = set("0123456789ABCDEFGHJKMNPQRSTVWXYZ")
    assert all(len(i) == 26 and set(i) <= alphabet for i in ids)
    assert Job(executor="a").id != Job(executor="a").id


def test_result_round_trips_with_exit_containment_and_usage() -> None:
    kept = AxisVerdict(state="kept", reason="bwrap")
    result = Result(
        job_id="j1",
        status="failed",
        output={"partial": True},
        exit=Failure(code=3),
        error=ErrorInfo(code="E_EXIT", message="exited with 3"),
        stderr="boom",
        containment=ContainmentReport(
            sandbox="bwrap",
            files=kept,
            network=kept,
            process_tree=kept,
            user=kept,
            resources=AxisVerdict(state="partial", reason="no cgroup"),
        ),
        usage=Usage(wall_s=0.5, cpu_s=0.1),
        undo_ids=("u1",),
        worker="w1",
        device="server",
        attempt=2,
        started_at=1.0,
        finished_at=2.0,
    )
    assert decode_result(encode(result)) == result
    assert json.loads(encode(result))["exit"] == {"type": "failure", "code": 3}


def test_dead_letter_keeps_raw_bytes() -> None:
    letter = DeadLetter(
        job_id="x",
        raw=b"\xff not json",
        error=ErrorInfo(code="E_BAD_MESSAGE", message="m"),
        at=5.0,
    )
    assert decode_dead_letter(encode(letter)) == letter


def test_cap_text() -> None:
    assert cap_text(b"hello") == ("hello", False)
    text, cut = cap_text(b"x" * (STDERR_CAP_BYTES + 1))
    assert cut and len(text) == STDERR_CAP_BYTES
    assert cap_text(b"\xffok", cap=10) == ("\ufffdok", False)


def test_messages_are_frozen() -> None:
    job = Job(executor="echo")
    with pytest.raises(AttributeError):
        job.executor = "other"  # type: ignore[misc]


def test_committed_schemas_are_current() -> None:
    stale = _schemas.stale()
    assert not stale, (
        f"queue/schemas is stale ({', '.join(stale)}): "
        "run `python -m metnos_exec._schemas` to refresh"
    )


def test_schemas_describe_the_wire() -> None:
    rendered = {name: json.loads(text) for name, text in _schemas.render().items()}
    job = rendered["job.json"]["$defs"]["Job"]
    assert job["required"] == ["executor"]
    assert job["properties"]["autonomy"]["enum"] == ["full", "read_only", "supervised"]
    assert "additionalProperties" not in job  # forward compatible: unknown fields pass
    result = rendered["result.json"]["$defs"]["Result"]
    assert set(result["required"]) == {"job_id", "status"}


def test_schema_check_flags_a_stale_file(tmp_path: object) -> None:
    from pathlib import Path

    folder = Path(str(tmp_path))
    assert _schemas.main(["--out", str(folder)]) == 0
    assert _schemas.main(["--out", str(folder), "--check"]) == 0
    (folder / "job.json").write_text("{}\n")
    assert _schemas.main(["--out", str(folder), "--check"]) == 1


def test_msgspec_decoder_is_strict_about_types() -> None:
    # Guard against a msgspec upgrade turning on lax coercion ("3" -> 3) behind our back.
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"executor": "e", "priority": "1"}', type=Job)
