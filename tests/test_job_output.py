"""Whatever a job prints, the worker's answer is a result: never an internal error.

An executor's stdout is untrusted input. These tests feed the output parser the nasty cases
(deep nesting, huge numbers, invalid UTF-8, NaN, duplicate keys, giant strings, random
bytes) through the supervisor and a broker round trip, fuzz it with hypothesis, and run the
400,000-level document of issue 8 on real bubblewrap end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Job, decode_result, encode
from metnos_exec.sandbox._types import Success
from metnos_exec.supervisor import MAX_OUTPUT_DEPTH
from metnos_exec.supervisor.outcome import _parse_output
from tests.supervisor.test_supervisor import (  # noqa: F401
    ScriptedArm,
    chooser,
    executors,
    make,
    registry,
)

pytestmark = pytest.mark.anyio

DEEP = b"[" * 400_000 + b"]" * 400_000

#: (stdout, valid JSON within the limits?)
CORPUS: dict[str, tuple[bytes, bool]] = {
    "400k nested arrays": (DEEP, False),
    "400k nested objects": (b'{"a":' * 400_000 + b"1" + b"}" * 400_000, False),
    "nested just past the limit": (
        b"[" * (MAX_OUTPUT_DEPTH + 1) + b"]" * (MAX_OUTPUT_DEPTH + 1),
        False,
    ),
    "nested at the limit": (b"[" * MAX_OUTPUT_DEPTH + b"]" * MAX_OUTPUT_DEPTH, True),
    "deep but unbalanced": (b"[" * 5000, False),
    "many flat brackets": (b"[" + b"[],{}," * 20_000 + b"1]", True),
    "brackets inside strings": (json.dumps(["[" * 10_000]).encode(), True),
    "huge integer": (b"1" * 5000, False),
    "huge negative integer": (b"-" + b"9" * 400, True),
    "float overflow": (b"1e400", False),
    "NaN": (b"NaN", False),
    "Infinity": (b"[Infinity]", False),
    "invalid UTF-8 in a string": (b'"\xff\xfe"', False),
    "invalid UTF-8 outside": (b"\xc3\x28", False),
    "lone surrogate escape": (b'"\\ud800"', False),
    "NUL escape": (b'"\\u0000"', True),
    "raw NUL": (b'"a\x00b"', False),
    "duplicate keys": (b'{"a": 1, "a": 2}', True),
    "giant string": (b'"' + b"x" * (1 << 20) + b'"', True),
    "two documents": (b"{} {}", False),
    "BOM": (b"\xef\xbb\xbf{}", False),
    "only whitespace": (b" \n\t ", False),
    "terminal escapes": (b'"\x1b]0;pwned\x07"', False),
    "escaped terminal escapes": (b'"\\u001b]0;pwned\\u0007"', True),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_the_parser_answers_a_value_or_bad_output(name: str) -> None:
    stdout, valid = CORPUS[name]
    value, error = _parse_output(stdout)
    if valid:
        assert error is None, error
        assert msgspec.json.decode(msgspec.json.encode(value)) == value
    else:
        assert error is not None and error.code == "E_BAD_OUTPUT", (value, error)
        assert isinstance(value, str | None) and len(value or "") <= 4096


def test_deep_nesting_names_the_limit() -> None:
    _, error = _parse_output(DEEP)
    assert error is not None and f"deeper than {MAX_OUTPUT_DEPTH} levels" in error.message


async def test_every_corpus_output_ends_as_a_result_never_a_host_fault(
    registry: ExecutorRegistry,  # noqa: F811
) -> None:
    broker = MemoryBroker()
    arm = ScriptedArm(*((Success(), stdout) for stdout, _ in CORPUS.values()))
    ids = [(await broker.submit(Job(executor="echo"))).job_id for _ in CORPUS]
    await make(broker, registry, arm, concurrency=1).run(burst=True)
    for (name, (_, valid)), job_id in zip(CORPUS.items(), ids, strict=True):
        result = await broker.get_result(job_id)
        assert result is not None, name
        if valid:
            assert result.status == "succeeded", (name, result.error)
        else:
            assert result.status == "failed", (name, result.status, result.error)
            assert result.error is not None and result.error.code == "E_BAD_OUTPUT", name
        # What the broker stores reads back the same (a reader recursing again is safe).
        assert decode_result(encode(result)) == result
    assert await broker.dead_letters(limit=100) == []


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=30,
)


@settings(
    database=None,  # no example files in the checkout (it may be read-only)
    deadline=None,  # a loaded CI machine must not turn speed into a failure
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    st.one_of(
        st.binary(max_size=2000),
        _json_values.map(lambda v: json.dumps(v).encode()),
        st.builds(
            lambda depth, opener, tail: opener * depth + tail,
            st.integers(0, 3000),
            st.sampled_from([b"[", b'{"k":', b'[{"k":']),
            st.binary(max_size=50),
        ),
    )
)
def test_fuzz_any_bytes_give_a_value_or_bad_output(stdout: bytes) -> None:
    value, error = _parse_output(stdout)
    if error is not None:
        assert error.code == "E_BAD_OUTPUT"
        return
    # Accepted: it must survive the broker's encoding and a decode again.
    assert msgspec.json.decode(msgspec.json.encode(value)) == value


async def test_400k_levels_from_a_real_bwrap_job_is_bad_output(tmp_path: Path) -> None:
    from metnos_exec.sandbox.bwrap import BwrapSandbox, bwrap_probe
    from metnos_exec.supervisor import Supervisor, SupervisorConfig

    from .conftest import need

    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    folder = tmp_path / "executors" / "deep"
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text(
        'name = "deep"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
    )
    (folder / "main.py").write_text("import sys\nsys.stdout.write('[' * 400000 + ']' * 400000)\n")
    broker = MemoryBroker()
    arm = BwrapSandbox()
    job_id = (await broker.submit(Job(executor="deep"))).job_id
    sup = Supervisor(
        broker,
        ExecutorRegistry.load(tmp_path / "executors"),
        SupervisorConfig(home=str(tmp_path), worker_id="w1", concurrency=1),
        arm_chooser=chooser(arm),
        predict_arm=lambda runtime: "bwrap",
    )
    await sup.run(burst=True)
    result = await broker.get_result(job_id)
    assert result is not None and result.status == "failed", result
    assert result.error is not None and result.error.code == "E_BAD_OUTPUT", result.error
    assert result.attempt == 1  # a verdict, not a host fault that would be retried
