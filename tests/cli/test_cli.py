"""The command line through real processes (`python -m metnos_exec ...`) and exit codes."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from metnos_exec.cli import EXIT, build_parser, main
from metnos_exec.cli.jobs import _parse_arg
from tests.conftest import need
from tests.helpers.worker_cli import wait_for_event, worker_argv

SLEEPY = """\
name = "sleepy"
version = "1"
runtime = "python"
entry = "main.py"
[args.s]
type = "number"
default = 0
[args.note]
type = "string"
default = ""
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    ex = tmp_path / "ex" / "sleepy"
    ex.mkdir(parents=True)
    (ex / "manifest.toml").write_text(SLEEPY)
    (ex / "main.py").write_text("")
    return {
        **os.environ,
        "METNOS_BROKER": f"sqlite:///{tmp_path / 'q.db'}",
        "METNOS_ARM_OVERRIDE": "echo",
        "HOME": str(tmp_path),
    }


def cli(
    env: dict[str, str], *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "metnos_exec", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def test_parse_arg_keeps_the_text_for_the_worker_to_convert() -> None:
    # The CLI cannot know the schema: it sends text, and the worker converts it.
    assert _parse_arg("n=3") == ("n", "3")
    assert _parse_arg("flag=true") == ("flag", "true")
    assert _parse_arg("xs=[1,2]") == ("xs", "[1,2]")
    assert _parse_arg("path=~/notes/a.md") == ("path", "~/notes/a.md")
    assert _parse_arg("text=42") == ("text", "42")
    assert _parse_arg("empty=") == ("empty", "")
    assert _parse_arg("k=null") == ("k", None)  # absent: the default applies


def test_help_everywhere() -> None:
    parser = build_parser()
    assert "exit codes" in parser.format_help()
    for cmd in ("worker", "submit", "result", "cancel", "status", "tail", "undo", "bench"):
        out = subprocess.run(
            [sys.executable, "-m", "metnos_exec", cmd, "--help"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, cmd
        assert "exit codes" in out.stdout, cmd
        # tail reads a log file, bench's benchmarks take their own options: no --broker.
        assert ("--broker" in out.stdout) == (cmd not in ("tail", "bench")), cmd


def test_submit_worker_result_round_trip(env: dict[str, str], tmp_path: Path) -> None:
    sub = cli(env, "submit", "sleepy", "--arg", "s=0", "--arg", "note=buy milk")
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip()
    bad = cli(env, "submit", "sleepy", "--arg", "nope=1")
    rejected_id = bad.stdout.strip()
    pending = cli(env, "result", job_id)
    assert pending.returncode == EXIT["pending"]
    log = tmp_path / "w.jsonl"
    work = cli(
        env, "worker", "--executors", str(tmp_path / "ex"), "--burst", "--log-file", str(log)
    )
    assert work.returncode == 0, work.stderr
    res = cli(env, "result", job_id, "--json")
    assert res.returncode == 0
    doc = json.loads(res.stdout)
    assert doc["status"] == "succeeded" and doc["output"] == {"s": 0, "note": "buy milk"}
    human = cli(env, "result", job_id)
    assert human.stdout.startswith("succeeded") and "sandbox echo" in human.stdout
    rej = cli(env, "result", rejected_id)
    assert rej.returncode == EXIT["rejected"] and "E_BAD_ARGS" in rej.stdout
    assert cli(env, "result", "01NOSUCHJOB").returncode == EXIT["not_found"]
    # tail: readable by default, raw JSON with --json, filtered by job and event.
    t = cli(env, "tail", str(log), "--job", job_id, "--event", "job.finished", "--no-color")
    assert t.returncode == 0 and t.stdout.count("\n") == 1 and "job.finished" in t.stdout
    raw = cli(env, "tail", str(log), "--event", "job.", "--json")
    recs = [msgspec.json.decode(x) for x in raw.stdout.splitlines()]
    assert {r["event"] for r in recs} >= {"job.received", "job.finished", "job.rejected"}
    assert cli(env, "tail", str(tmp_path / "missing.jsonl")).returncode == EXIT["not_found"]
    st = cli(env, "status", "--json")
    assert st.returncode == 0
    status = json.loads(st.stdout)
    assert status["broker"]["done"] == 2 and "sandbox" in status


def test_submit_wait_exit_codes(env: dict[str, str], tmp_path: Path) -> None:
    # Nobody is serving: --wait gives up with "pending".
    out = cli(env, "submit", "sleepy", "--wait", "0.2")
    assert out.returncode == EXIT["pending"] and "no result" in out.stderr
    gone = cli(env, "cancel", "01NOSUCHJOB")
    assert gone.returncode == EXIT["not_found"]
    # An error, like `result`'s and `undo`'s: on stderr, not in the output.
    assert gone.stdout == "" and one_clear_line(gone).startswith("metnos-exec: no job 01NOSUCHJOB")
    job = cli(env, "submit", "sleepy").stdout.strip()
    c = cli(env, "cancel", job)
    assert c.returncode == 0 and "cancelled" in c.stdout
    assert cli(env, "result", job).returncode == EXIT["job_failed"]


def test_usage_and_broker_errors(env: dict[str, str]) -> None:
    assert cli(env, "submit", "sleepy", "--arg", "novalue").returncode == EXIT["usage"]
    assert cli(env, "submit", "sleepy", "--args-json", "[1]").returncode == EXIT["usage"]
    assert cli(env, "submit", "sleepy", "--max-attempts", "0").returncode == EXIT["usage"]
    assert cli(env, "frobnicate").returncode == EXIT["usage"]
    gone = "sqlite:////nonexistent/dir/q.db"
    assert cli(env, "worker", "--executors", ".", "--broker", gone).returncode == EXIT["broker"]
    assert cli(env, "worker", "--executors", "/nonexistent").returncode == EXIT["usage"]
    # A wrong URL is configuration (2), like every other setting; 4 is a store failing.
    bad = cli(env, "status", "--broker", "nosuch://x")
    assert bad.returncode == EXIT["usage"] and "E_BAD_BROKER_URL" in one_clear_line(bad)


def test_undo_of_unknown_or_unchanged_jobs(env: dict[str, str]) -> None:
    assert cli(env, "submit", "sleepy").returncode == 0  # the queue exists
    out = cli(env, "undo", "01JOB")
    assert out.returncode == EXIT["not_found"] and "no job 01JOB" in out.stderr
    job_id = cli(env, "submit", "sleepy").stdout.strip()
    pending = cli(env, "undo", job_id)
    assert pending.returncode == EXIT["rejected"] and "E_UNDO_UNAVAILABLE" in pending.stderr


def test_demo_runs_and_reruns(tmp_path: Path) -> None:
    need(shutil.which("bwrap") is not None, "bubblewrap is not installed")
    env = {k: v for k, v in os.environ.items() if k != "METNOS_BROKER"}
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-m", "metnos_exec.demo"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "unexpected:" not in out.stdout, out.stdout  # every case ended as expected
        assert "E_CAPABILITY_DENIED" in out.stdout and "timed_out" in out.stdout
        assert "next (in another terminal" in out.stdout
        # The walls column is explained, and no detail is cut short.
        assert "walls: the five containment axes" in out.stdout
        assert "checked against fs hints ~/notes/**" in out.stdout
        # The read after the undo fails, and its row says why (the note is gone), not
        # only "the executor exited with code 1".
        [gone] = [ln for ln in out.stdout.splitlines() if ln.startswith("read it after undo")]
        assert "E_EXIT" in gone and "No such file or directory" in gone, gone
        assert not [ln for ln in out.stdout.splitlines() if ln.endswith("...")]
    assert (tmp_path / "demo" / "worker.jsonl").exists()
    # Re-run while the README's background worker serves the demo's queue: refused, with
    # what to do, and the queue file left alone (deleting it would strand that worker).
    db = tmp_path / "demo" / "metnos.db"
    log = tmp_path / "demo" / "bg.jsonl"
    worker = subprocess.Popen(
        worker_argv("sqlite:///demo/metnos.db", "demo/executors", log),
        cwd=tmp_path,
        env={**env, "METNOS_ARM_OVERRIDE": "echo"},
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for_event(log, "worker.started", worker)
        inode = db.stat().st_ino
        again = subprocess.run(
            [sys.executable, "-m", "metnos_exec.demo"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode != 0
        assert f"pid {worker.pid}" in again.stderr and "another folder" in again.stderr
        assert db.stat().st_ino == inode
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(20) == 0


def test_bench_lists_and_refuses_unknown(env: dict[str, str]) -> None:
    root = Path(__file__).resolve().parents[2]
    listed = cli(env, "bench", "--list", cwd=root)
    assert listed.returncode == 0 and "queue_throughput" in listed.stdout.split()
    assert cli(env, "bench", "no_such_bench", cwd=root).returncode == EXIT["usage"]


# --- review fixes ---------------------------------------------------------------------


def one_clear_line(out: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--concurrency", "0"),
        ("--visibility", "0"),
        ("--grace", "-1"),
        ("--visibility", "nan"),
        ("--prefetch", "-1"),
    ],
)
def test_worker_refuses_bad_numbers(
    env: dict[str, str], tmp_path: Path, option: str, value: str
) -> None:
    out = cli(env, "worker", "--executors", str(tmp_path / "ex"), "--burst", option, value)
    assert out.returncode == EXIT["usage"], out.stderr
    assert "Traceback" not in out.stderr and option in out.stderr


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("METNOS_ARM_OVERRIDE", "direct"),
        ("METNOS_ECHO_DELAY_S", "0.2-0.1"),  # read with METNOS_ARM_OVERRIDE=echo (env)
        ("METNOS_REQUIRE_SANDBOX", "sometimes"),
        ("METNOS_BWRAP", "/nonexistent/bwrap"),
        # Issue 15: each of these started a root worker whose every job ran as host root.
        ("METNOS_SLOT_UIDS", "abc"),
        ("METNOS_SLOT_UIDS", "1879048192"),
        ("METNOS_SLOT_UIDS", "-5:10"),
        ("METNOS_SLOT_UIDS", "1879048192:0"),
        ("METNOS_SLOT_UIDS", "0:65536"),
        ("METNOS_SLOT_UIDS", "4294967295:2"),
        ("METNOS_SLOT_UIDS", "0"),
    ],
)
def test_worker_refuses_bad_settings_before_serving(
    env: dict[str, str], tmp_path: Path, variable: str, value: str
) -> None:
    job = cli(env, "submit", "sleepy").stdout.strip()
    bad = {**env, variable: value}
    out = cli(bad, "worker", "--executors", str(tmp_path / "ex"), "--burst")
    assert out.returncode == EXIT["usage"], out.stderr
    line = one_clear_line(out)
    assert variable in line and "E_CONFIG" in line
    # Nothing was leased: the job did not end dead as a host fault.
    assert cli(env, "result", job).returncode == EXIT["pending"]


def test_worker_serves_with_slot_uids_off(env: dict[str, str], tmp_path: Path) -> None:
    # ``off`` stays the explicit way (the others are refused above).
    job = cli(env, "submit", "sleepy").stdout.strip()
    off = {**env, "METNOS_SLOT_UIDS": "Off"}
    out = cli(off, "worker", "--executors", str(tmp_path / "ex"), "--burst")
    assert out.returncode == 0, out.stderr
    assert cli(env, "result", job).returncode == 0


def test_check_worker_config_resolves_the_policy_once() -> None:
    from metnos_exec.errors import BadConfig
    from metnos_exec.policy import Policy
    from metnos_exec.worker import check_worker_config

    assert check_worker_config(environ={"METNOS_REQUIRE_SANDBOX": "never"}) == Policy("never")
    assert check_worker_config(environ={}) == Policy()
    with pytest.raises(BadConfig):
        check_worker_config(environ={"METNOS_REQUIRE_SANDBOX": "x"})
    with pytest.raises(BadConfig):
        check_worker_config(concurrency=0, environ={})


def test_readers_do_not_create_a_missing_queue(env: dict[str, str], tmp_path: Path) -> None:
    missing = tmp_path / "typo.db"
    for args in (("status",), ("result", "01JOB"), ("cancel", "01JOB")):
        out = cli(env, *args, "--broker", f"sqlite:///{missing}")
        assert out.returncode == EXIT["broker"], (args, out.stderr)
        line = one_clear_line(out)
        assert "E_BROKER_UNAVAILABLE" in line and f"no queue file at {missing}" in line
        assert not missing.exists()
    # Three slashes are relative: the message shows the folder it looked in.
    rel = cli(env, "status", "--broker", "sqlite:///work/x.db", cwd=tmp_path)
    assert rel.returncode == EXIT["broker"]
    assert str(tmp_path / "work" / "x.db") in rel.stderr and "four slashes" in rel.stderr
    # A submit typed in another folder, whose relative queue folder is not there: the
    # message names the folder it looked in too (it said "demo/metnos.db").
    sub = cli(env, "submit", "sleepy", "--broker", "sqlite:///demo/x.db", cwd=tmp_path)
    assert sub.returncode == EXIT["broker"]
    assert str(tmp_path / "demo" / "x.db") in one_clear_line(sub)
    # Producers and workers still create it.
    assert cli(env, "submit", "sleepy", "--broker", f"sqlite:///{missing}").returncode == 0
    assert missing.exists()


def test_client_commands_refuse_the_memory_broker(env: dict[str, str]) -> None:
    for args in (("submit", "sleepy"), ("result", "01JOB"), ("cancel", "01JOB"), ("status",)):
        out = cli(env, *args, "--broker", "memory://")
        assert out.returncode == EXIT["usage"], (args, out.stderr, out.stdout)
        assert "memory broker lives inside one process" in one_clear_line(out)
        assert out.stdout == ""


def test_idempotency_key_conflict_is_refused(env: dict[str, str]) -> None:
    first = cli(env, "submit", "sleepy", "--idempotency-key", "k1", "--arg", "s=1")
    assert first.returncode == 0
    job_id = first.stdout.strip()
    same = cli(env, "submit", "sleepy", "--idempotency-key", "k1", "--arg", "s=1")
    assert same.returncode == 0 and same.stdout.strip() == job_id
    other = cli(env, "submit", "sleepy", "--idempotency-key", "k1", "--arg", "s=2")
    assert other.returncode == EXIT["rejected"]
    line = one_clear_line(other)
    assert "E_IDEMPOTENCY_CONFLICT" in line and job_id in line


def test_submit_delay_priority_and_help(env: dict[str, str]) -> None:
    assert cli(env, "submit", "sleepy", "--delay", "3600", "--priority", "5").returncode == 0
    stats = json.loads(cli(env, "status", "--json").stdout)["broker"]
    assert stats["queued"] == 1 and stats["delayed"] == 1
    assert cli(env, "submit", "sleepy", "--delay", "-1").returncode == EXIT["usage"]
    help_ = " ".join(cli(env, "submit", "--help").stdout.split())
    assert "higher runs first" in help_ and "k=null" in help_ and "--delay" in help_
    assert "four slashes" in help_ and "in-process only" in help_


def test_status_is_readable(env: dict[str, str]) -> None:
    assert cli(env, "submit", "sleepy").returncode == 0
    out = cli(env, "status")
    assert out.returncode == 0, out.stderr
    assert "{'" not in out.stdout and "('" not in out.stdout and "None" not in out.stdout
    assert "queued=1" in out.stdout and "  arms:" in out.stdout
    assert "    python: " in out.stdout  # nested keys on their own indented lines
    # Whether the bwrap arm's kernel mechanisms are on, in words.
    assert "  bwrap_seccomp:\n    active: " in out.stdout
    assert "  bwrap_landlock:\n    active: " in out.stdout
    doc = json.loads(cli(env, "status", "--json").stdout)["sandbox"]
    assert set(doc["bwrap_seccomp"]) == set(doc["bwrap_landlock"]) == {"active", "detail"}


def test_codes_lists_every_error_code(env: dict[str, str]) -> None:
    from metnos_exec.errors import ERROR_CODES

    out = cli(env, "codes")
    assert out.returncode == 0
    assert [ln.split()[0] for ln in out.stdout.splitlines()] == list(ERROR_CODES)
    assert json.loads(cli(env, "codes", "--json").stdout) == ERROR_CODES


def test_result_prints_partial_and_lost_axes_apart() -> None:
    import io

    from metnos_exec.cli import _print_result
    from metnos_exec.messages import Result
    from metnos_exec.sandbox._types import AxisVerdict, ContainmentReport

    kept, part, lost = (AxisVerdict(s, "r") for s in ("kept", "partial", "not_kept"))
    report = ContainmentReport(
        sandbox="bwrap", files=kept, network=part, process_tree=kept, user=lost, resources=part
    )
    out = io.StringIO()
    result = Result(job_id="01JOB", status="succeeded", containment=report, finished_at=0.0)
    _print_result(result, as_json=False, out=out)
    assert "containment: partial: network, resources; not kept: user" in out.getvalue()
    out = io.StringIO()
    every = ContainmentReport("bwrap", kept, kept, kept, kept, kept)
    _print_result(msgspec.structs.replace(result, containment=every), as_json=False, out=out)
    assert "containment: all walls kept" in out.getvalue()
    # The undo ids (issue 18, item 11: the human output hid them), and how to use them.
    out = io.StringIO()
    _print_result(msgspec.structs.replace(result, undo_ids=("U1", "U2")), as_json=False, out=out)
    assert "  undo: U1, U2 (metnos-exec undo 01JOB)" in out.getvalue()
    out = io.StringIO()
    _print_result(result, as_json=False, out=out)
    assert "undo:" not in out.getvalue()


def test_bench_uses_the_checkout_folder_and_skips_helpers(
    env: dict[str, str], tmp_path: Path
) -> None:
    # Run from elsewhere: the checkout's bench/ is still found; _noop.py is not listed
    # (it reads stdin at import: run as a benchmark, it hung).
    listed = cli(env, "bench", "--list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    names = listed.stdout.split()
    assert "queue_throughput" in names and not any(n.lstrip("_") == "noop" for n in names)
    assert cli(env, "bench", "_noop", cwd=tmp_path).returncode == EXIT["usage"]
    # A benchmark folder in the current folder is not picked up by accident.
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "stray.py").write_text("def main(argv): return 0\n")
    assert "stray" not in cli(env, "bench", "--list", cwd=tmp_path).stdout.split()
    missing = cli({**env, "METNOS_BENCH_DIR": str(tmp_path / "nope")}, "bench", "--list")
    assert missing.returncode == EXIT["not_found"]
    assert "METNOS_BENCH_DIR" in one_clear_line(missing)
    mine = cli({**env, "METNOS_BENCH_DIR": str(tmp_path / "bench")}, "bench", "--list")
    assert mine.stdout.split() == ["stray"]


def test_worker_passes_prefetch_through(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--prefetch N` reaches the worker (0 turns lease-ahead off)."""
    from metnos_exec import cli as cli_mod

    seen: dict[str, object] = {}

    def fake_run_worker(*args: object, **kwargs: object) -> int:
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(cli_mod, "run_worker", fake_run_worker, raising=False)
    import metnos_exec.worker as worker_mod

    monkeypatch.setattr(worker_mod, "run_worker", fake_run_worker)
    code = cli_mod.main(
        [
            "worker",
            "--broker",
            f"sqlite:///{tmp_path}/q.db",
            "--executors",
            str(tmp_path),
            "--prefetch",
            "0",
        ]
    )
    assert code == 0
    assert seen["prefetch"] == 0


# --- issue 9: a CLI a newcomer can trust ----------------------------------------------


def test_version() -> None:
    from metnos_exec import __version__

    out = subprocess.run(
        [sys.executable, "-m", "metnos_exec", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == f"metnos-exec {__version__}"


def test_help_examples_quote_the_tilde(env: dict[str, str]) -> None:
    # An unquoted ~ is expanded by the shell to the submitter's home, not the worker's.
    for cmd in ("submit", "worker", "result"):
        text = cli(env, cmd, "--help").stdout
        assert not re.search(r"(?<!')\b\w+=~", text), (cmd, text)
    assert "--arg 'path=~/notes/today.md'" in cli(env, "submit", "--help").stdout


def test_a_broker_whose_module_or_extra_is_missing_is_a_clear_configuration_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`redis://` before its broker exists (or without its extra): exit 2 and a sentence
    saying what is missing and how to get it, never a raw "No module named"."""
    import metnos_exec.brokers as brokers
    from metnos_exec.cli import main

    fake = tmp_path / "needs_missing_dep.py"
    fake.write_text("import no_such_client_library_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(brokers._REGISTRY, "absent", "metnos_exec.brokers.absent_xyz:B")
    monkeypatch.setitem(brokers._REGISTRY, "needy", "needs_missing_dep:B")
    monkeypatch.setitem(brokers._EXTRAS, "needy", "needy")
    for url, expected in (
        ("absent://h/0", "not part of this installation of metnos-exec"),
        ("needy://h/0", "pip install 'metnos-exec[needy]'"),
    ):
        with pytest.raises(SystemExit) as info:
            main(["status", "--broker", url])
        err = capsys.readouterr().err
        assert info.value.code == EXIT["usage"], err
        assert "E_BAD_BROKER_URL" in err and expected in err and "No module named" not in err
        assert len(err.strip().splitlines()) == 1
    err_text = brokers._missing("redis", "metnos_exec.brokers.redis", ImportError(name="coredis"))
    assert "needs the Python package 'coredis'" in err_text
    assert "pip install 'metnos-exec[redis]'" in err_text


def test_submit_wait_says_when_no_worker_has_leased_the_job(env: dict[str, str]) -> None:
    out = cli(env, "submit", "sleepy", "--wait", "0.3")
    assert out.returncode == EXIT["pending"]
    line = out.stderr.strip().splitlines()[-1]
    assert "no worker has leased it" in line and "metnos-exec worker --broker" in line
    job = cli(env, "submit", "sleepy").stdout.strip()
    res = cli(env, "result", job, "--wait", "0.2")
    assert res.returncode == EXIT["pending"] and "no worker has leased it" in res.stderr


def test_arg_text_is_converted_by_the_executors_schema(env: dict[str, str], tmp_path: Path) -> None:
    """`--arg note=42` is the text "42" for a string argument, `--arg s=0.5` the number
    0.5 for a number one: the worker, which has the schema, converts the text."""
    ok = cli(env, "submit", "sleepy", "--arg", "note=42", "--arg", "s=0.5").stdout.strip()
    text = cli(env, "submit", "sleepy", "--arg", "note=true", "--arg", "s=1e-3").stdout.strip()
    bad = cli(env, "submit", "sleepy", "--arg", "s=soon").stdout.strip()
    work = cli(env, "worker", "--executors", str(tmp_path / "ex"), "--burst")
    assert work.returncode == 0, work.stderr
    out = json.loads(cli(env, "result", ok, "--json").stdout)
    assert (out["status"], out["output"]) == ("succeeded", {"s": 0.5, "note": "42"})
    out = json.loads(cli(env, "result", text, "--json").stdout)
    assert out["output"] == {"s": 0.001, "note": "true"}
    rejected = cli(env, "result", bad)
    assert rejected.returncode == EXIT["rejected"]
    assert "E_BAD_ARGS" in rejected.stdout and "does not convert" in rejected.stdout


def test_purge_forgets_old_finished_jobs_and_says_so(env: dict[str, str], tmp_path: Path) -> None:
    for _ in range(3):
        assert cli(env, "submit", "sleepy").returncode == 0
    assert cli(env, "worker", "--executors", str(tmp_path / "ex"), "--burst").returncode == 0
    kept = cli(env, "submit", "sleepy").stdout.strip()  # queued: never purged
    out = cli(env, "purge", "--older-than-days", "1e-9", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["jobs"] == 3 and doc["reclaimed_bytes"] is not None
    human = cli(env, "purge", "--older-than-days", "1e-9")
    assert human.returncode == 0 and human.stdout.startswith("purged 0 finished job(s)")
    assert cli(env, "result", kept).returncode == EXIT["pending"]
    for bad in ("0", "-1", "never", "soon"):
        assert cli(env, "purge", "--older-than-days", bad).returncode == EXIT["usage"], bad
    no = cli(env, "worker", "--executors", str(tmp_path / "ex"), "--retention-days", "0")
    assert no.returncode == EXIT["usage"] and "retention" in one_clear_line(no)


def test_a_locked_or_read_only_queue_is_one_clear_line_and_exit_4(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Finding 9: no traceback, and not exit 1 (which means "the job failed")."""
    import sqlite3

    from tests.helpers.faults import read_only

    assert cli(env, "submit", "sleepy").returncode == 0
    db = tmp_path / "q.db"
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")
        locked = cli(env, "submit", "sleepy", "--broker", f"sqlite:///{db}?busy_timeout_s=0.1")
        other.execute("ROLLBACK")
    assert locked.returncode == EXIT["broker"]
    assert "E_BROKER_BUSY" in one_clear_line(locked)
    # It read "cannot use the queue database /.../q.db is locked by another process".
    assert "q.db: the file is locked by another process" in one_clear_line(locked)
    with read_only(db):
        ro = cli(env, "submit", "sleepy")
    assert ro.returncode == EXIT["broker"] and "E_BROKER_READONLY" in one_clear_line(ro)


def test_a_full_disk_is_one_clear_line_and_exit_4(env: dict[str, str], tmp_path: Path) -> None:
    """A real full disk: the queue on a 1 MiB tmpfs (in a user and mount namespace of
    its own, so this runs unprivileged too), filled up before the submit."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-rm", "true"], capture_output=True, check=False)
    need(unshare is not None and probe.returncode == 0, "no unprivileged user+mount namespaces")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {disk} && "
        f"{sys.executable} -m metnos_exec submit sleepy >/dev/null && "
        f"(dd if=/dev/zero of={disk}/filler bs=64k 2>/dev/null; true) && "
        f"exec {sys.executable} -m metnos_exec submit sleepy --arg note=hello"
    )
    out = subprocess.run(
        [unshare or "unshare", "-rm", "sh", "-c", script],
        env={**env, "METNOS_BROKER": f"sqlite:///{disk / 'q.db'}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == EXIT["broker"], out.stderr
    assert "E_BROKER_FULL" in one_clear_line(out)


def test_an_internal_error_is_one_line_with_code_70(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import metnos_exec.cli as cli_mod
    import metnos_exec.cli.codes as codes_mod

    def broken(ns: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(codes_mod, "_cmd_codes", broken)
    with pytest.raises(SystemExit) as info:
        cli_mod.main(["codes"])
    err = capsys.readouterr().err
    assert info.value.code == EXIT["internal"] == 70
    assert "E_INTERNAL: RuntimeError: a bug" in err and "METNOS_DEBUG=1" in err
    monkeypatch.setenv("METNOS_DEBUG", "1")
    with pytest.raises(RuntimeError):
        cli_mod.main(["codes"])


def test_args_json_too_deep_for_the_decoder_is_a_usage_error(env: dict[str, str]) -> None:
    deep = '{"a":' + "[" * 5000 + "]" * 5000 + "}"  # past the decoder's recursion limit
    out = cli(env, "submit", "sleepy", "--args-json", deep)
    assert out.returncode == EXIT["usage"] and "nested too deeply" in one_clear_line(out)
    too = cli(env, "submit", "sleepy", "--args-json", '{"a":' + "[" * 200 + "]" * 200 + "}")
    assert too.returncode == EXIT["usage"] and "MAX_ARGS_DEPTH" in one_clear_line(too)


def test_status_says_when_redis_cannot_be_reached(env: dict[str, str]) -> None:
    from tests.helpers.redis_server import _free_port

    url = f"redis://127.0.0.1:{_free_port()}/0?connect_timeout_s=1"
    out = cli({**env, "METNOS_BROKER": url}, "status")
    assert out.returncode == EXIT["broker"], out
    # One line, the code first (as every error of the CLI), then what happened.
    line = one_clear_line(out)
    assert "E_BROKER_UNAVAILABLE: cannot reach Redis at redis://127.0.0.1:" in line


def test_submit_and_status_on_redis(env: dict[str, str], redis_server: object) -> None:
    url = f"{redis_server.url}?prefix=cli-{os.getpid()}"  # type: ignore[attr-defined]
    env = {**env, "METNOS_BROKER": url}
    sub = cli(env, "submit", "sleepy", "--json")
    assert sub.returncode == 0, sub
    job_id = json.loads(sub.stdout)["job_id"]
    status = cli(env, "status", "--json")
    assert status.returncode == 0, status
    assert json.loads(status.stdout)["broker"]["queued"] == 1
    assert cli(env, "cancel", job_id).returncode == 0
    res = cli(env, "result", job_id, "--json")
    assert json.loads(res.stdout)["status"] == "cancelled"


def test_worker_refuses_an_executors_folder_that_is_not_a_folder_of_executors(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A newcomer's slip: `--executors` given one executor's own folder (or a file). The
    worker started with no executor and rejected every queued job as unknown; now it
    refuses to start, says why and names the folder to give, and leaves the jobs queued."""
    job = cli(env, "submit", "sleepy").stdout.strip()
    one = tmp_path / "ex" / "sleepy"
    out = cli(env, "worker", "--executors", str(one), "--burst")
    assert out.returncode == EXIT["usage"], out.stderr
    line = one_clear_line(out)
    assert "E_BAD_MANIFEST" in line and "one executor's folder" in line, line
    assert f"--executors {tmp_path / 'ex'}" in line, line
    afile = one / "manifest.toml"
    out = cli(env, "worker", "--executors", str(afile), "--burst")
    assert out.returncode == EXIT["usage"], out.stderr
    assert "is not a folder" in one_clear_line(out)
    assert cli(env, "result", job).returncode == EXIT["pending"]


#: ``python -c`` prologue: SIGINT handled as Python does by default (KeyboardInterrupt),
#: then the CLI in this same process.
_SIGINT_DEFAULT = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'metnos-exec'; runpy.run_module('metnos_exec', run_name='__main__')"
)


def test_ctrl_c_of_submit_wait_says_the_job_is_not_cancelled(env: dict[str, str]) -> None:
    """Ctrl-C of `submit --wait` stops the waiting, not the job: the message says so and
    how to see or drop it, instead of a bare "interrupted"."""
    # Ctrl-C as a terminal sends it: to a process whose SIGINT is in its default state. A
    # suite started in the background by a non-interactive shell (`cmd &`) inherits SIGINT
    # ignored, and so would the command (Python then installs no handler): a test of the
    # harness, not of the CLI. Hence the default handler, set before the CLI starts.
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGINT_DEFAULT, "submit", "sleepy", "--wait"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # "submitted ID": the job is queued, now waiting
        assert first.startswith("submitted "), first
        job = first.split()[1]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaped, and its pipes closed whatever happened above
    assert proc.returncode == EXIT["interrupted"], err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"job {job} is not cancelled" in err, err
    assert f"metnos-exec result {job}" in err and f"metnos-exec cancel {job}" in err, err
    assert cli(env, "result", job).returncode == EXIT["pending"]


def test_dev_demo_takes_its_folder_from_where_it_is_typed(tmp_path: Path) -> None:
    """`~/metnos-exec/dev demo mydemo` typed in another folder made `mydemo` inside the
    checkout (the script moves there first), while the steps it printed said "from this
    folder". The folder is now taken from where the command was typed, and the steps name
    the folder they are to be typed in."""
    need(shutil.which("bwrap") is not None, "bubblewrap is not installed")
    root = Path(__file__).resolve().parents[2]
    # As `./dev setup` stamps it: only then does `./dev demo` install nothing.
    want = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()[:16]
    stamp = root / ".venv" / ".installed"
    need(
        stamp.exists() and stamp.read_text().strip() == want,
        "./dev setup has not been run in this checkout since pyproject.toml changed",
    )
    env = {k: v for k, v in os.environ.items() if k != "METNOS_BROKER"}
    out = subprocess.run(
        [str(root / "dev"), "demo", "mydemo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "mydemo" / "metnos.db").exists()
    assert not (root / "mydemo").exists()
    assert f"next (in another terminal, from {root}):" in out.stdout, out.stdout[-1500:]
    # An option is not a folder (it was made into one, `--help`, and the demo ran there).
    helped = subprocess.run(
        [str(root / "dev"), "demo", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0 and "usage: ./dev demo [DIR]" in helped.stdout, helped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mydemo"]


@pytest.mark.parametrize("command", [("status",), ("submit", "sleepy"), ("result", "01J")])
def test_an_unreachable_redis_is_one_line_for_a_client_command(
    env: dict[str, str], command: tuple[str, ...]
) -> None:
    """The Redis broker logs `broker.error` for a worker's log; a client command printed
    that record on stdout (structlog's unconfigured default), where `--json` readers
    expect a document, next to its own one-line error."""
    pytest.importorskip("coredis")
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bad = {**env, "METNOS_BROKER": f"redis://127.0.0.1:{port}/0"}
    out = cli(bad, *command)
    assert out.returncode == EXIT["broker"], out.stderr
    line = one_clear_line(out)
    assert line.startswith("metnos-exec: E_BROKER_UNAVAILABLE: cannot reach Redis"), line
    assert out.stdout == "", out.stdout


def test_tail_of_a_folder_is_a_usage_error_naming_its_logs(
    env: dict[str, str], tmp_path: Path
) -> None:
    # Issue 18, item 10: `tail FOLDER` was an internal error (exit 70, IsADirectoryError).
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "worker.jsonl").write_text("")
    out = cli(env, "tail", str(folder))
    assert out.returncode == EXIT["usage"], out.stderr
    line = one_clear_line(out)
    assert "is a folder" in line and "worker.jsonl" in line, line


def test_tail_refuses_an_event_no_record_can_have(env: dict[str, str], tmp_path: Path) -> None:
    """`tail --event job.finshed` (a typo) printed nothing and exited 0, as if no job had
    finished; an event name (or prefix) outside the fixed vocabulary is a usage error that
    names the closest events."""
    log = tmp_path / "w.jsonl"
    log.write_text('{"ts":"2026-01-01T00:00:00Z","level":"info","event":"job.finished"}\n')
    out = cli(env, "tail", str(log), "--event", "job.finshed")
    assert out.returncode == EXIT["usage"], out.stderr
    line = one_clear_line(out)
    assert "job.finshed" in line and "job.finished" in line, line
    ok = cli(env, "tail", str(log), "--event", "job.", "--json")
    assert ok.returncode == 0 and '"job.finished"' in ok.stdout


def test_dev_and_demo_help_say_how_to_use_them(tmp_path: Path) -> None:
    """`./dev` alone printed its help with a stray "set -euo pipefail" line; `./dev demo
    --help` ran the demo in a new folder named `--help`."""
    root = Path(__file__).resolve().parents[2]
    usage = subprocess.run(
        ["bash", str(root / "dev")], capture_output=True, text=True, timeout=30, check=False
    )
    assert usage.returncode == 2
    assert "./dev demo" in usage.stdout and "set -euo" not in usage.stdout, usage.stdout
    for flag, code in (("--help", 0), ("-h", 0), ("--bogus", 2)):
        out = subprocess.run(
            [sys.executable, "-m", "metnos_exec.demo", flag],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == code, out
        assert "usage: ./dev demo [DIR]" in out.stdout + out.stderr, out
        assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_a_bare_file_path_as_broker_url_is_answered_with_the_url(env: dict[str, str]) -> None:
    """`--broker demo/metnos.db` (the file, not a URL): the error gives the URL to type."""
    for given, meant in (
        ("demo/metnos.db", "sqlite:///demo/metnos.db"),
        ("/var/q.db", "sqlite:////var/q.db"),
    ):
        out = cli(env, "status", "--broker", given)
        assert out.returncode == EXIT["usage"], out.stderr
        line = one_clear_line(out)
        assert "E_BAD_BROKER_URL" in line and f"did you mean {meant}?" in line, line
    out = cli(env, "status", "--broker", "sqlit:///q.db")
    assert "did you mean" not in one_clear_line(out)


#: Issue 18, item 10: broker URLs and options a user mistypes. Each was an internal error
#: (exit 70, a bare ValueError from Python), "cannot reach Redis" with Redis up, or quietly
#: something else (``?prefix=`` the default queue; zero or negative intervals taken).
BAD_URLS = [
    ("redis://[bad", "not a URL"),
    ("rediss://[::1", "not a URL"),
    ("sqlite://[x/q.db", "not a URL"),
    ("redis://127.0.0.1:1?connect_timeout_s=-1", "connect_timeout_s"),
    ("redis://127.0.0.1:1?stream_timeout_s=0", "stream_timeout_s"),
    ("redis://127.0.0.1:1?settle_patience_s=-3", "settle_patience_s"),
    ("redis://127.0.0.1:1?poll_interval_s=0", "poll_interval_s"),
    ("redis://127.0.0.1:1?poll_interval_s=nan", "poll_interval_s"),
    ("redis://127.0.0.1:1?prefix=", "prefix"),
    ("sqlite:///q.db?poll_interval_s=-1", "poll_interval_s"),
    ("sqlite:///q.db?busy_timeout_s=0", "busy_timeout_s"),
    ("sqlite:///q.db?busy_timeout_s=inf", "busy_timeout_s"),
    ("sqlite:///q.db?synchronous=", "synchronous"),
    # Issue 18, item 12: the cluster and Sentinel forms.
    ("redis+cluster://", "a host is missing"),
    ("redis+cluster://127.0.0.1:7000,,127.0.0.1:7001", "a host is missing"),
    ("redis+cluster://127.0.0.1:x", "'127.0.0.1:x'"),
    ("redis+cluster://127.0.0.1:99999", "out of range"),
    ("redis+cluster://[::1", "not a URL"),
    ("redis+cluster://127.0.0.1:7000/3", "only database 0"),
    ("redis+cluster://127.0.0.1:7000?wait_replicas=-1", "wait_replicas"),
    ("redis+cluster://127.0.0.1:7000?wait_timeout_s=0", "wait_timeout_s"),
    ("redis+sentinel://127.0.0.1:26379", "names its service"),
    ("redis+sentinel://127.0.0.1:26379/svc/1/2", "names its service"),
    ("redis+sentinel://127.0.0.1:26379/svc/x", "database is a number"),
    ("redis+sentinel://127.0.0.1:26379/svc?sentinel_auth=yes&colour=red", "colour"),
    ("redis://127.0.0.1:7000,127.0.0.1:7001/0", "not a URL"),
]


@pytest.mark.parametrize(("url", "named"), BAD_URLS)
def test_a_malformed_broker_url_is_a_clear_usage_error_everywhere(
    env: dict[str, str],
    tmp_path: Path,
    url: str,
    named: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from metnos_exec.brokers import BadBrokerURL, open_broker

    work = tmp_path / "cwd"
    work.mkdir()
    with contextlib.chdir(work), pytest.raises(BadBrokerURL, match=re.escape(named)) as caught:
        open_broker(url)
    assert caught.value.code == "E_BAD_BROKER_URL"
    for command in (("status",), ("submit", "sleepy"), ("purge",)):
        out = cli(env, *command, "--broker", url, cwd=work)
        assert out.returncode == EXIT["usage"], (command, out.stderr)
        line = one_clear_line(out)
        assert "E_BAD_BROKER_URL" in line and named in line, line
    # Every command that takes --broker (in this process: a hundred processes are slow).
    assert set(BROKER_COMMANDS) == {
        name
        for name, parser in _commands().items()
        if any("--broker" in a.option_strings for a in parser._actions)
    }
    for command in BROKER_COMMANDS.values():
        with contextlib.chdir(work), pytest.raises(SystemExit) as exited:
            main([*command, "--broker", url])
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == EXIT["usage"], (command, err)
        assert len(err) == 1 and "E_BAD_BROKER_URL" in err[0] and named in err[0], err
    assert list(work.iterdir()) == []  # refused before anything was made


#: Each command that takes --broker, as typed with everything else it needs.
BROKER_COMMANDS = {
    "worker": ("worker", "--executors", ".", "--burst", "--log-file", "w.jsonl"),
    "submit": ("submit", "sleepy"),
    "result": ("result", "01JOB"),
    "cancel": ("cancel", "01JOB"),
    "status": ("status",),
    "purge": ("purge",),
    "undo": ("undo", "01JOB"),
    "approve": ("approve", "01JOB"),
    "reject": ("reject", "01JOB"),
    "checkpoint": ("checkpoint", "list"),
    "doctor": ("doctor",),
    "tools": ("tools", "--format", "openai"),
    "mcp": ("mcp", "--stdio", "--executors", "."),
    "web": ("web", "--bind", "127.0.0.1:0"),
    "top": ("top", "--once"),
}


def test_wait_refuses_negative_and_nan_seconds_and_zero_looks_once(env: dict[str, str]) -> None:
    # `--wait -1` said "no worker has leased it: is a worker running?" at once, `--wait nan`
    # waited forever, and `submit --wait 0` did not wait at all (it printed the id, exit 0).
    job = cli(env, "submit", "sleepy").stdout.strip()
    for command in (("submit", "sleepy"), ("result", job)):
        for bad in ("-1", "nan", "-inf"):
            out = cli(env, *command, f"--wait={bad}")
            assert out.returncode == EXIT["usage"], (command, bad, out.stderr)
            assert "--wait" in out.stderr and "Traceback" not in out.stderr
    once = cli(env, "submit", "sleepy", "--wait", "0")
    assert once.returncode == EXIT["pending"] and "no result" in once.stderr
    assert cli(env, "result", job, "--wait", "0").returncode == EXIT["pending"]


def test_status_counts_delayed_jobs_inside_queued_and_says_so(env: dict[str, str]) -> None:
    # "queued=2  delayed=1  running=0" read as three jobs; delayed is a part of queued.
    assert cli(env, "submit", "sleepy").returncode == 0
    assert cli(env, "submit", "sleepy", "--delay", "3600").returncode == 0
    out = cli(env, "status")
    assert out.returncode == 0, out.stderr
    counts = out.stdout.splitlines()[1]
    assert "queued=2 (1 delayed)" in counts and " delayed=" not in counts, counts
    doc = json.loads(cli(env, "status", "--json").stdout)["broker"]
    assert (doc["queued"], doc["delayed"]) == (2, 1)


def test_status_lists_workers_jobs_and_what_waits_for_a_worker(env: dict[str, str]) -> None:
    """Issue 18, item 4: the live and the gone workers with what they serve, the jobs
    (filtered), and executors whose queued jobs no live worker serves."""
    import time

    import anyio

    from metnos_exec.brokers import open_broker
    from metnos_exec.brokers.presence import WorkerInfo
    from metnos_exec.messages import Job

    now = time.time()

    async def setup() -> list[str]:
        async with open_broker(env["METNOS_BROKER"], create=True) as b:
            for wid, seen, stopped in (("live", now, None), ("lost", now - 60, None)):
                await b.register_worker(
                    WorkerInfo(
                        id=wid,
                        host="h",
                        pid=7,
                        device="server",
                        executors=("sleepy",),
                        slots=2,
                        started_at=now - 100,
                        seen_at=seen,
                        stopped_at=stopped,
                    )
                )
            ids = [(await b.submit(Job(executor=e))).job_id for e in ("sleepy", "gpu", "gpu")]
            return ids

    sleepy, gpu1, gpu2 = anyio.run(setup)
    doc = json.loads(cli(env, "status", "--json", "--jobs", "--state", "queued").stdout)
    assert [(w["id"], w["state"]) for w in doc["workers"]] == [("live", "live"), ("lost", "lost")]
    assert doc["waiting_for_a_worker"] == [{"device": "server", "executor": "gpu", "queued": 2}]
    assert [j["job_id"] for j in doc["jobs"]] == [gpu2, gpu1, sleepy]
    only = json.loads(cli(env, "status", "--json", "--jobs", "--executor", "sleepy").stdout)
    assert [j["job_id"] for j in only["jobs"]] == [sleepy]
    text = cli(env, "status", "--jobs", "--limit", "1").stdout
    assert "waiting for a worker" in text and "gpu on server: 2 queued" in text
    assert f"{gpu2}  queued  gpu" in text and gpu1 not in text
    assert cli(env, "status", "--executor", "gpu").returncode == EXIT["usage"]


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_and_argument_has_help_text() -> None:
    """Issue 18, item 11: `--log-level`, `--backend`, `--autonomy`, tail's filters and the
    job ids were listed bare. Every option and positional of every command says what it
    is (``-h`` aside; an option hidden with SUPPRESS is meant to be unlisted)."""
    parsers = {"metnos-exec": build_parser()} | _commands()
    bare = [
        f"{name} {(action.option_strings or [action.dest])[0]}"
        for name, parser in parsers.items()
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and not (action.help or "").strip()
    ]
    assert bare == []


def test_only_commands_that_use_a_broker_offer_broker(env: dict[str, str], tmp_path: Path) -> None:
    # `tail` reads a log file: a --broker it ignored was a lie.
    offered = {
        name
        for name, parser in _commands().items()
        if any("--broker" in a.option_strings for a in parser._actions)
    }
    uses = {"worker", "submit", "result", "cancel", "status", "purge", "undo", "doctor"}
    uses |= {"tools", "mcp"}  # the catalog the workers publish; the queue the calls go to
    uses |= {"web", "top"}  # the live view reads the queue
    uses |= {"checkpoint", "approve", "reject"}  # checkpoint and approval jobs go through the queue
    assert offered == uses
    log = tmp_path / "w.jsonl"
    log.write_text("")
    out = cli(env, "tail", str(log), "--broker", "sqlite:///q.db")
    assert out.returncode == EXIT["usage"] and "unrecognized arguments: --broker" in out.stderr


def test_cancel_of_a_finished_job_says_so_with_its_own_exit_code(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 18, item 11: cancelling a job that had finished exited 0 ("already finished")
    as if it had been cancelled; a script could not tell. It exits 8 and names the status."""
    job = cli(env, "submit", "sleepy").stdout.strip()
    work = cli(env, "worker", "--executors", str(tmp_path / "ex"), "--burst")
    assert work.returncode == 0, work.stderr
    out = cli(env, "cancel", job)
    assert out.returncode == EXIT["finished"] == 8, out.stderr
    line = one_clear_line(out)
    assert f"job {job} had already finished (succeeded)" in line and "nothing" in line, line
    assert out.stdout == ""
    assert cli(env, "result", job).returncode == 0  # its result stands
    gone = cli(env, "cancel", "01NOSUCHJOB")
    assert gone.returncode == EXIT["not_found"]
    assert "no job 01NOSUCHJOB in sqlite:///" in one_clear_line(gone)


def _cache_under_a_file(tmp: Path) -> Path:
    (tmp / "afile").write_text("")
    return tmp / "afile" / "cache"  # its parent is a file: refused for root too


def _cache_is_a_file(tmp: Path) -> Path:
    (tmp / "afile").write_text("")
    return tmp / "afile"


def _cache_not_writable(tmp: Path) -> Path:
    if os.geteuid() == 0:
        # Not a missing component (so not `need`, which CI turns into a failure): root
        # ignores permission bits; the two cases above hold the class for root.
        pytest.skip("permission bits do not stop root (the cases above do)")
    (tmp / "ro").mkdir(mode=0o500)
    return tmp / "ro" / "cache"


def _uses_verified(env: dict[str, str], tmp: Path) -> list[str]:
    """A worker checking signatures: it keeps verified copies in the cache."""
    assert cli(env, "keygen", "--out", str(tmp / "k.key")).returncode == 0
    return ["--trust-key", next(str(p) for p in tmp.glob("k.*") if p.name != "k.key")]


def _uses_wasm(env: dict[str, str], tmp: Path) -> list[str]:
    """A worker with a wasm executor: it keeps compiled modules in the cache."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "executors"
    shutil.copytree(examples / "wasm_hello", tmp / "ex" / "wasm_hello")
    return []


@pytest.mark.parametrize("uses", [_uses_verified, _uses_wasm])
@pytest.mark.parametrize("make", [_cache_under_a_file, _cache_is_a_file, _cache_not_writable])
def test_a_worker_whose_cache_folder_is_unusable_says_so_not_the_broker(
    env: dict[str, str], tmp_path: Path, make: object, uses: object
) -> None:
    """Issue 18, item 10: METNOS_CACHE_DIR under a file stopped the worker with
    "E_BROKER_UNAVAILABLE: the broker failed: Not a directory". It is configuration: the
    folder is named with the fix, and the worker refuses before it opens the queue (no
    queue file made) or makes any folder of the cache."""
    cache = make(tmp_path)  # type: ignore[operator]
    options = uses(env, tmp_path)  # type: ignore[operator]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    bad = {**env, "METNOS_CACHE_DIR": str(cache)}
    out = cli(bad, "worker", "--executors", str(tmp_path / "ex"), "--burst", *options)
    assert out.returncode == EXIT["usage"], out.stderr
    line = one_clear_line(out)
    assert "E_CONFIG" in line and "BROKER" not in line, line
    assert f"cache folder {cache}/" in line and "METNOS_CACHE_DIR" in line, line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_worker_that_needs_no_cache_serves_with_an_unusable_one(
    env: dict[str, str], tmp_path: Path
) -> None:
    # No signature checks, no wasm executor: nothing is kept in the cache, nothing refused.
    job = cli(env, "submit", "sleepy").stdout.strip()
    bad = {**env, "METNOS_CACHE_DIR": str(_cache_under_a_file(tmp_path))}
    out = cli(bad, "worker", "--executors", str(tmp_path / "ex"), "--burst")
    assert out.returncode == 0, out.stderr
    assert cli(env, "result", job).returncode == 0


@pytest.mark.parametrize(
    ("raised", "code", "words"),
    [
        (NotADirectoryError(20, "Not a directory", "/srv/logs/w.jsonl"), "usage", "E_CONFIG"),
        (PermissionError(13, "Permission denied", "/a", None, "/b"), "usage", "/a -> /b"),
        (ConnectionResetError(104, "Connection reset by peer"), "broker", "E_BROKER"),
    ],
)
def test_an_os_error_no_layer_wrapped_names_its_file_not_the_broker(
    raised: OSError, code: str, words: str
) -> None:
    """An OSError that reached a command's last resort was always "the broker failed"
    (exit 4), sending the operator to a healthy queue for a log file or folder of their
    own. With a file name it is that file's configuration (exit 2, the file named); only a
    nameless one (a socket's) is still the broker's."""
    from metnos_exec.cli._common import _Exit, _run

    async def fails() -> int:
        raise raised

    with pytest.raises(_Exit) as caught:
        _run(fails)
    assert caught.value.code == EXIT[code]
    assert words in caught.value.message, caught.value.message
    if raised.filename is not None:
        assert str(raised.filename) in caught.value.message and "broker" not in caught.value.message
