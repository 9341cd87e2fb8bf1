"""Untrusted text never drives the operator's terminal; ``--json`` stays exact.

The end-to-end test runs a real executor on real bubblewrap that writes terminal escapes
to its stderr and its output, and reads them back through ``result``, ``submit --wait``
and ``tail``, as an operator would.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
import unicodedata
from pathlib import Path

import msgspec
import pytest

from metnos_exec._terminal import visible
from metnos_exec.cli import _print_result
from metnos_exec.logs import tail
from metnos_exec.messages import ErrorInfo, Result
from metnos_exec.sandbox._types import Trap
from tests.cli.test_cli import cli

from .conftest import need

HIDDEN = {"Cc", "Cf", "Zl", "Zp", "Cs"}
#: What an attacker would print: retitle, clear screen, carriage return, bell, a C1 CSI,
#: a bidi override, a line separator, a zero-width joiner, NUL.
NASTY = "\x1b]0;pwned\x07\x1b[2J\rfake line\x07\x9b31m\u202egnp.exe\u2028\u200d\x00"


def raw_controls(text: str) -> set[str]:
    """Characters of `text` that would act on a terminal (line breaks and tabs aside)."""
    return {c for c in text if c not in "\n\t" and unicodedata.category(c) in HIDDEN}


def test_visible_spells_out_every_control_format_and_separator_character() -> None:
    every = "".join(
        chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) in HIDDEN
    )
    shown = visible(every)
    assert raw_controls(shown) == set() and "\n" not in shown
    assert visible(NASTY) == (
        "\\x1b]0;pwned\\x07\\x1b[2J\\rfake line\\x07\\x9b31m\\u202egnp.exe\\u2028\\u200d\\x00"
    )
    # Ordinary text, accents, CJK, emoji and tabs are left alone; newlines only on request.
    plain = "café 東京 🙂\tdone"
    assert visible(plain) == plain
    assert visible("a\nb") == "a\\nb" and visible("a\nb", newlines=True) == "a\nb"


def test_a_result_shows_untrusted_fields_spelled_out() -> None:
    result = Result(
        job_id="01JOB",
        status="failed",
        error=ErrorInfo(code="E_TRAP", message=f"the guest trapped: {NASTY}"),
        exit=Trap(message=NASTY),
        output={"note": NASTY, NASTY: [NASTY]},
        stderr=f"line 1\n{NASTY}\nline 3",
        finished_at=0.0,
    )
    out = io.StringIO()
    _print_result(result, as_json=False, out=out)
    text = out.getvalue()
    assert raw_controls(text) == set(), text
    assert "\\x1b]0;pwned" in text and "\\u202e" in text
    # One-line fields cannot forge lines: the error stays on its own line.
    error_lines = [ln for ln in text.splitlines() if ln.startswith("  error:")]
    assert len(error_lines) == 1 and "\\u2028" in error_lines[0]
    out = io.StringIO()
    _print_result(result, as_json=True, out=out)
    assert msgspec.json.decode(out.getvalue(), type=Result) == result  # exact


def test_tail_spells_out_what_records_carry(tmp_path: Path) -> None:
    log = tmp_path / "w.jsonl"
    # structlog repr()s most values already; the event name and the level it prints as is.
    rec = {"ts": "t", "level": "warning", "event": f"job.{NASTY}", "job_id": "a", "note": NASTY}
    log.write_bytes(msgspec.json.encode(rec) + b"\n" + NASTY.encode() + b"\n")
    for color in (False, True):
        out = io.StringIO()
        assert tail(log, out=out, color=color) == 2
        text = out.getvalue()
        controls = raw_controls(text)
        # Colour codes are ours (ESC [ ... m); nothing else may be raw.
        assert controls <= ({"\x1b"} if color else set()), controls
        assert text.count("\\x1b]0;pwned") == 3, text
    out = io.StringIO()
    tail(log, raw=True, out=out)
    first, second = out.getvalue().rstrip("\n").split("\n")
    assert msgspec.json.decode(first)["note"] == NASTY  # --json stays exact
    assert second == NASTY


ATTACKER = """\
import json, sys
NASTY = {nasty!r}
sys.stderr.write("before\\n" + NASTY + "\\nafter\\n")
print(json.dumps({{"note": NASTY}}))
sys.exit(3)
"""


def test_result_and_submit_wait_on_a_real_bwrap_job(tmp_path: Path) -> None:
    from metnos_exec.sandbox.bwrap import bwrap_probe

    need(shutil.which("bwrap") is not None and bwrap_probe().working, "bubblewrap not usable")
    ex = tmp_path / "ex" / "noisy"
    ex.mkdir(parents=True)
    (ex / "manifest.toml").write_text(
        'name = "noisy"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
    )
    (ex / "main.py").write_text(ATTACKER.format(nasty=NASTY))
    env = {
        "PATH": "/usr/bin:/bin",
        "METNOS_BROKER": f"sqlite:///{tmp_path / 'q.db'}",
        "HOME": str(tmp_path),
    }
    job_id = cli(env, "submit", "noisy", "--idempotency-key", "k1").stdout.strip()
    log = tmp_path / "w.jsonl"
    work = cli(env, "worker", "--executors", str(ex.parent), "--burst", "--log-file", str(log))
    assert work.returncode == 0, work.stderr
    exact = json.loads(cli(env, "result", job_id, "--json").stdout)
    assert exact["stderr"] == f"before\n{NASTY}\nafter\n", exact
    assert exact["output"] == {"note": NASTY}
    human = cli(env, "result", job_id)
    assert human.returncode == 1 and human.stdout.startswith("failed"), human
    assert raw_controls(human.stdout + human.stderr) == set(), human.stdout
    assert "\\x1b]0;pwned\\x07" in human.stdout and "\\u202egnp.exe" in human.stdout
    # submit --wait prints the same way (the key names the job already served).
    waited = cli(env, "submit", "noisy", "--idempotency-key", "k1", "--wait", "30")
    assert waited.returncode == 1 and "\\x1b]0;pwned" in waited.stdout, waited
    assert raw_controls(waited.stdout + waited.stderr) == set(), waited.stdout
    tailed = cli(env, "tail", str(log), "--no-color")
    assert tailed.returncode == 0 and raw_controls(tailed.stdout) == set(), tailed.stdout


@pytest.mark.parametrize("as_json", [False, True])
def test_status_dead_letters_are_spelled_out(tmp_path: Path, as_json: bool) -> None:
    import anyio

    from metnos_exec.brokers import open_broker
    from metnos_exec.messages import Job

    url = f"sqlite:///{tmp_path / 'q.db'}"

    async def plant() -> None:
        async with open_broker(url, create=True) as broker:
            await broker.submit(Job(executor="x"))
            (lease,) = await broker.lease("w", visibility_s=30)
            await broker.dead_letter(lease, error=ErrorInfo(code="E_EXIT", message=NASTY))

    anyio.run(plant)
    env = {"PATH": "/usr/bin:/bin", "METNOS_BROKER": url, "HOME": str(tmp_path)}
    out = cli(env, "status", *(["--json"] if as_json else []))
    assert out.returncode == 0, out.stderr
    if as_json:
        assert json.loads(out.stdout)["recent_dead_letters"][0]["message"] == NASTY
    else:
        assert raw_controls(out.stdout) == set() and "\\x1b]0;pwned" in out.stdout
