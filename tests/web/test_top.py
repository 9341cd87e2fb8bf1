"""``metnos-exec top``: the overview in a terminal, with job data made inert."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import need_import
from tests.helpers.web_queue import fill_queue

need_import("rich", "web")


def test_top_once_shows_the_queue_with_escapes_spelled_out(tmp_path: Path) -> None:
    url, ids = fill_queue(tmp_path / "q.db")
    env = {**os.environ, "COLUMNS": "1000", "TERM": "dumb"}
    out = subprocess.run(
        [sys.executable, "-m", "metnos_exec", "top", "--once", "--broker", url],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "queued 1 (0 delayed)  running 1  done 4  dead 1" in text
    for name in ("ok", "degraded", "refused", "hostile", "running"):
        assert ids[name] in text, name
    assert "E_CAPABILITY_DENIED: path /etc/shadow is outside" in text  # the refusal's reason
    assert "E_LEASE_EXPIRED" in text and "w1" in text and "1/4" in text
    # The hostile job's message: every escape spelled out, none sent to the terminal.
    assert not {"\x1b", "\x07", "\u202e"} & set(text)
    assert "\\x1b[2J\\x1b]0;owned\\x07\\u202e" in text
    # ... and rich markup in job data is text, not a style.
    assert "[bold red]forged[/]" in text


def test_top_on_a_missing_queue_says_so(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "metnos_exec", "top", "--once", "--broker",
         f"sqlite:///{tmp_path / 'none.db'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 4 and "E_BROKER_UNAVAILABLE" in out.stderr
