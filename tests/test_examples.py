"""The example executors, end to end: plan_invocation, then a real arm (bwrap, direct).

Both arms are imported directly: only an unusable bwrap skips (through `need`, a failure
in CI), never a missing module.

HOME is a tmp folder in every test; nothing touches the real home or the real network
(fetch_url talks to a server on 127.0.0.1 through a manifest variant allowing it).
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from metnos_exec.errors import AutonomyDenied, CapabilityDenied, MissingFolder
from metnos_exec.manifest import Executor, ExecutorRegistry, load_manifest
from metnos_exec.plan import plan_invocation
from metnos_exec.sandbox._types import Failure, Sandbox, Success
from metnos_exec.sandbox.bwrap import BwrapSandbox, bwrap_probe
from metnos_exec.sandbox.direct import DirectSandbox

from .conftest import need

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "executors"
REGISTRY = ExecutorRegistry.load(EXAMPLES)


def _bwrap() -> Sandbox:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    return BwrapSandbox()


def _direct() -> Sandbox:
    return DirectSandbox()


ARMS: dict[str, Callable[[], Sandbox]] = {"bwrap": _bwrap, "direct": _direct}


@pytest.fixture(params=list(ARMS))
def arm(request: pytest.FixtureRequest) -> Sandbox:
    return ARMS[request.param]()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    (h / "notes" / "work").mkdir(parents=True)
    (h / "notes" / "today.md").write_text("milk\n")
    (h / "notes" / "work" / "plan.md").write_text("ship it\n")
    (h / "private").mkdir()
    (h / "private" / "diary.md").write_text("secret\n")
    return h


async def run(
    arm: Sandbox, executor: Executor | str, args: dict[str, Any], home: Path, **kw: Any
) -> tuple[Any, Any]:
    ex = REGISTRY[executor] if isinstance(executor, str) else executor
    inv = plan_invocation(ex, args, home=str(home), **kw)
    outcome = await arm.run(inv.job)
    return outcome, msgspec.json.decode(outcome.stdout) if outcome.stdout else None


def test_all_examples_load() -> None:
    assert {"read_notes", "write_note", "fetch_url", "move_note", "delete_note"} <= set(REGISTRY)
    assert not {n for n in REGISTRY.errors if not n.startswith("wasm")}


@pytest.mark.anyio
async def test_read_notes_lists_and_reads(arm: Sandbox, home: Path) -> None:
    outcome, doc = await run(arm, "read_notes", {}, home)
    assert isinstance(outcome.exit, Success), outcome
    assert doc["kind"] == "folder"
    assert [n["path"] for n in doc["notes"]] == ["today.md", "work/plan.md"]
    outcome, doc = await run(arm, "read_notes", {"path": "~/notes/work/plan.md"}, home)
    assert doc == {
        "kind": "note",
        "path": str(home / "notes/work/plan.md"),
        "text": "ship it\n",
        "truncated": False,
    }
    outcome, doc = await run(arm, "read_notes", {"path": "~/notes/nope.md"}, home)
    assert outcome.exit == Failure(1) and "cannot read" in doc["error"]


def test_read_notes_outside_notes_is_denied_before_running(home: Path) -> None:
    for path in ("~/private/diary.md", "~/notes/../private/diary.md", "/etc/passwd"):
        with pytest.raises(CapabilityDenied, match="argument `path`"):
            plan_invocation(REGISTRY["read_notes"], {"path": path}, home=str(home))
    (home / "notes" / "escape").symlink_to(home / "private")
    with pytest.raises(CapabilityDenied, match="resolved"):
        plan_invocation(REGISTRY["read_notes"], {"path": "~/notes/escape/diary.md"}, home=str(home))


@pytest.mark.anyio
async def test_write_note_append_and_replace(arm: Sandbox, home: Path) -> None:
    note = home / "notes" / "today.md"
    outcome, doc = await run(arm, "write_note", {"path": "~/notes/today.md", "text": "eggs"}, home)
    assert isinstance(outcome.exit, Success), outcome
    assert doc["mode"] == "append" and "synced" not in doc
    assert note.read_text() == "milk\neggs\n"
    args = {"path": "~/notes/new/idea.md", "text": "fly", "mode": "replace"}
    outcome, doc = await run(arm, "write_note", args, home)
    assert isinstance(outcome.exit, Success), outcome
    assert (home / "notes" / "new" / "idea.md").read_text() == "fly"
    assert sorted(p.name for p in (home / "notes" / "new").iterdir()) == ["idea.md"]


def test_write_note_sync_opens_network_only_in_sync_mode(home: Path) -> None:
    ex = REGISTRY["write_note"]
    plain = plan_invocation(ex, {"path": "~/notes/a.md", "text": "x"}, home=str(home))
    sync = plan_invocation(
        ex, {"path": "~/notes/a.md", "text": "x", "mode": "sync"}, home=str(home)
    )
    assert plain.job.network is False
    assert [i.name for i in plain.inactive] == ["network:https"]
    assert sync.job.network is True
    assert [c.name for c in sync.effective.active] == ["fs:write", "network:https"]


@pytest.mark.anyio
@pytest.mark.parametrize("text", ["https://example.com", "~/todo", "/etc/passwd is a file"])
async def test_write_note_text_that_looks_like_a_path_or_url_is_just_text(
    arm: Sandbox, home: Path, text: str
) -> None:
    # `text` is declared format = "text": never vetted, so no false positive.
    args = {"path": "~/notes/today.md", "text": text}
    outcome, doc = await run(arm, "write_note", args, home)
    assert isinstance(outcome.exit, Success), outcome
    assert doc["path"] == str(home / "notes" / "today.md")
    assert (home / "notes" / "today.md").read_text() == f"milk\n{text}\n"


def test_write_note_relative_path_is_refused(home: Path) -> None:
    # The review's repro: with the direct arm's cwd in the executor folder, this wrote
    # /tmp/pwned.txt. It is now refused before anything runs, whatever the arm.
    ex = REGISTRY["write_note"]
    for path in ("../../../../../../../tmp/pwned.txt", "./today.md", "notes/today.md"):
        with pytest.raises(CapabilityDenied, match=r"relative path.*pass an absolute or ~/ path"):
            plan_invocation(ex, {"path": path, "text": "x"}, home=str(home))


def test_write_note_for_a_newcomer_without_notes_says_what_to_create(tmp_path: Path) -> None:
    newcomer = tmp_path / "newcomer"
    newcomer.mkdir()
    with pytest.raises(MissingFolder, match=rf"{newcomer}/notes does not exist.*create it first"):
        plan_invocation(
            REGISTRY["write_note"], {"path": "~/notes/today.md", "text": "x"}, home=str(newcomer)
        )


def test_every_example_string_argument_declares_a_format() -> None:
    # Without a format, vetting guesses (see the README); the examples never rely on it.
    bare = [
        f"{name}.{arg}"
        for name, ex in REGISTRY.items()
        for arg, spec in ex.manifest.args.items()
        if spec.type == "string" and spec.enum is None and spec.format is None
    ]
    assert bare == []
    assert REGISTRY["write_note"].manifest.args["text"].format == "text"
    assert REGISTRY["write_note"].manifest.args["path"].format == "path"


def test_write_note_refused_under_read_only_and_outside_notes(home: Path) -> None:
    ex = REGISTRY["write_note"]
    with pytest.raises(AutonomyDenied):
        plan_invocation(
            ex, {"path": "~/notes/a.md", "text": "x"}, home=str(home), autonomy="read_only"
        )
    with pytest.raises(CapabilityDenied, match="argument `path`"):
        plan_invocation(ex, {"path": "~/.bashrc", "text": "x"}, home=str(home))
    # read_notes is not mutating: read_only autonomy runs it.
    plan_invocation(REGISTRY["read_notes"], {}, home=str(home), autonomy="read_only")


@pytest.mark.anyio
async def test_move_and_delete_note(arm: Sandbox, home: Path) -> None:
    args = {"src": "~/notes/today.md", "dst": "~/notes/archive/2026.md"}
    outcome, doc = await run(arm, "move_note", args, home)
    assert isinstance(outcome.exit, Success), outcome
    assert doc["to"] == str(home / "notes/archive/2026.md")
    assert not (home / "notes/today.md").exists()
    assert (home / "notes/archive/2026.md").read_text() == "milk\n"
    # An existing destination is refused unless overwrite is set.
    args = {"src": "~/notes/work/plan.md", "dst": "~/notes/archive/2026.md"}
    outcome, doc = await run(arm, "move_note", args, home)
    assert outcome.exit == Failure(1) and "overwrite" in doc["error"]
    outcome, doc = await run(arm, "move_note", {**args, "overwrite": True}, home)
    assert isinstance(outcome.exit, Success)
    assert (home / "notes/archive/2026.md").read_text() == "ship it\n"

    outcome, doc = await run(arm, "delete_note", {"path": "~/notes/archive/2026.md"}, home)
    assert isinstance(outcome.exit, Success), outcome
    assert doc == {"deleted": str(home / "notes/archive/2026.md"), "bytes": 8}
    assert not (home / "notes/archive/2026.md").exists()
    outcome, doc = await run(arm, "delete_note", {"path": "~/notes/work"}, home)
    assert outcome.exit == Failure(1) and "folder" in doc["error"]
    with pytest.raises(CapabilityDenied):
        plan_invocation(
            REGISTRY["move_note"],
            {"src": "~/notes/work/plan.md", "dst": "~/private/plan.md"},
            home=str(home),
        )


# --- fetch_url against a local server -------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://evil.invalid/")
            self.end_headers()
            return
        body = b"hello from 127.0.0.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def fetch_variant(tmp_path: Path, server: str, code: str | None = None) -> Executor:
    """fetch_url (its code, or `code`) with a manifest variant allowing plain HTTP to the
    test server's address and port (the network wall lets it reach that, nothing else)."""
    folder = tmp_path / "executors" / "fetch_url"
    folder.mkdir(parents=True)
    if code is None:
        shutil.copy(EXAMPLES / "fetch_url" / "main.py", folder / "main.py")
    else:
        (folder / "main.py").write_text(code)
    hint = server.removeprefix("http://")
    text = (EXAMPLES / "fetch_url" / "manifest.toml").read_text()
    text = text.replace('name = "network:https"', 'name = "network:http"')
    text = text.replace(
        'hints = ["example.com", "*.example.com", "docs.python.org"]', f'hints = ["{hint}"]'
    )
    assert f'hints = ["{hint}"]' in text
    (folder / "manifest.toml").write_text(text)
    return Executor(manifest=load_manifest(folder / "manifest.toml"), path=str(folder))


@pytest.fixture
def local_fetch(tmp_path: Path, server: str) -> Executor:
    return fetch_variant(tmp_path, server)


@pytest.mark.anyio
async def test_fetch_url_fetches_from_allowed_host(
    arm: Sandbox, home: Path, server: str, local_fetch: Executor
) -> None:
    outcome, doc = await run(arm, local_fetch, {"url": f"{server}/hello"}, home)
    assert isinstance(outcome.exit, Success), outcome
    assert doc["status"] == 200 and doc["body"] == "hello from 127.0.0.1"
    assert doc["content_type"] == "text/plain"
    outcome, doc = await run(arm, local_fetch, {"url": f"{server}/redirect"}, home)
    assert isinstance(outcome.exit, Success), outcome
    assert doc["status"] == 302 and doc["location"] == "http://evil.invalid/"


def test_fetch_url_refuses_hosts_and_schemes_outside_hints(home: Path, server: str) -> None:
    ex = REGISTRY["fetch_url"]
    for url in (f"{server}/hello", "https://evil.invalid/", "http://example.com/"):
        with pytest.raises(CapabilityDenied, match="argument `url`"):
            plan_invocation(ex, {"url": url}, home=str(home))
    inv = plan_invocation(ex, {"url": "https://www.example.com/"}, home=str(home))
    assert inv.job.network is True


ROGUE_FETCH = """\
import json, socket, sys, urllib.request

args = json.load(sys.stdin)
out = {}
def tried(name, fn):
    try:
        out[name] = "ok: " + str(fn())
    except Exception as exc:
        out[name] = "refused: " + str(exc)[:200]
tried("allowed", lambda: urllib.request.urlopen(args["url"], timeout=5).read().decode())
tried("other_host", lambda: urllib.request.urlopen("http://other.invalid/", timeout=5).status)
tried("redis", lambda: urllib.request.urlopen("http://127.0.0.1:6379/", timeout=5).status)
tried("redis_raw", lambda: socket.create_connection(("127.0.0.1", 6379), 3).close())
port = int(args["url"].rsplit(":", 1)[1].split("/")[0]) + 1
tried("other_port_raw", lambda: socket.create_connection(("127.0.0.1", port), 3).close())
json.dump(out, sys.stdout)
"""


@pytest.mark.anyio
async def test_fetch_url_behind_the_network_wall(home: Path, server: str, tmp_path: Path) -> None:
    """Acceptance 1 (issue 17): fetch_url's manifest names one loopback server; the job
    reaches it, with the network axis kept and naming it, and the same job's code trying
    any other host, the Redis port or another loopback port is refused, in the egress."""
    arm = _bwrap()
    ok = fetch_variant(tmp_path / "ok", server)
    outcome, doc = await run(arm, ok, {"url": f"{server}/hello"}, home)
    assert isinstance(outcome.exit, Success), outcome
    assert doc["body"] == "hello from 127.0.0.1"
    hint = server.removeprefix("http://")
    assert outcome.containment.network.state == "kept"
    assert f"egress limited to {hint}" in outcome.containment.network.reason
    assert [(r.host, r.allowed) for r in outcome.egress] == [("127.0.0.1", True)]
    assert outcome.egress[0].received > 0

    rogue = fetch_variant(tmp_path / "rogue", server, ROGUE_FETCH)
    outcome, doc = await run(arm, rogue, {"url": f"{server}/hello"}, home)
    assert isinstance(outcome.exit, Success), outcome
    assert doc["allowed"] == "ok: hello from 127.0.0.1"
    for key in ("other_host", "redis", "redis_raw", "other_port_raw"):
        assert doc[key].startswith("refused: "), (key, doc[key])
    assert "403" in doc["other_host"] and "403" in doc["redis"]  # policy, said so
    refused = {(r.host, r.port) for r in outcome.egress if not r.allowed}
    assert ("other.invalid", 80) in refused and ("127.0.0.1", 6379) in refused
    assert outcome.containment.network.state == "kept"


@pytest.mark.anyio
async def test_no_network_capability_means_no_network(
    arm: Sandbox, home: Path, server: str
) -> None:
    # read_notes declares no network: the same fetch code, smuggled in as a note reader,
    # can not reach the local server under bwrap (the direct arm reports that it can).
    inv = plan_invocation(REGISTRY["read_notes"], {}, home=str(home))
    assert inv.job.network is False
    if arm.name == "bwrap":
        code = (
            "import urllib.request,sys\n"
            f"try: urllib.request.urlopen('{server}/hello', timeout=3)\n"
            "except OSError: sys.exit(5)\n"
        )
        job = msgspec.structs.replace(inv.job, argv=(*inv.job.argv[:3], "-c", code))
        outcome = await arm.run(job)
        assert outcome.exit == Failure(5), outcome
    else:
        assert arm.containment(inv.job).network.state == "not_kept"


def test_the_mcp_client_example_runs_against_a_worker(tmp_path: Path) -> None:
    """Issue 19: ``examples/mcp_client.py`` drives ``metnos-exec mcp --stdio`` with the mcp
    SDK's client, against a real worker with the real sandbox: it lists the tools, reads a
    note and shows a refusal."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers.worker_cli import wait_for_event, worker_argv
    from tests.sandbox.test_bwrap import need_bwrap

    from .conftest import need_import

    need_import("mcp", "mcp")
    need_bwrap()
    (tmp_path / "home" / "notes").mkdir(parents=True)
    (tmp_path / "home" / "notes" / "today.md").write_text("milk\n")
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    env.pop("METNOS_ARM_OVERRIDE", None)
    broker = f"sqlite:///{tmp_path / 'q.db'}"
    log = tmp_path / "worker.jsonl"
    worker = subprocess.Popen(
        worker_argv(broker, EXAMPLES, log), cwd=tmp_path, env=env, stdin=subprocess.DEVNULL
    )
    try:
        wait_for_event(log, "worker.started", worker, timeout=60)
        example = EXAMPLES.parent / "mcp_client.py"
        out = subprocess.run(
            [sys.executable, str(example), "--broker", broker, "--path", "~/notes/today.md"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert out.returncode == 0, out.stderr
    assert "tool read_notes (read-only)" in out.stdout
    assert "read_notes -> succeeded" in out.stdout and '"milk\\n"' in out.stdout
    assert "isError=True" in out.stdout and "E_CAPABILITY_DENIED" in out.stdout


def test_agent_loop_transcript_has_no_log_record_in_it(tmp_path: Path) -> None:
    """Issue 18, item 11: `python examples/agent_loop.py` showed the embedded worker's
    `job.rejected` record, a raw JSON line, between "Action 4" and "Observation 4" (both
    streams on one terminal). The refusal is an observation of the transcript; the
    worker's records go to --log-file, and only errors reach the terminal, readable."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}
    log = tmp_path / "agent.jsonl"
    out = subprocess.run(
        [sys.executable, str(AGENT_LOOP), "--log-file", str(log)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # as a terminal shows them: one stream
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines[0].startswith("Tools "), lines
    steps = lines[1:]
    assert all(line.startswith(("Thought ", "Action ", "Observation ")) for line in steps), lines
    assert len(steps) == 15 and "E_CAPABILITY_DENIED" in steps[11], lines
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert "job.rejected" in {r["event"] for r in records}  # the record went to the file

    plain = subprocess.run(
        [sys.executable, str(AGENT_LOOP)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0, plain.stdout
    assert not [line for line in plain.stdout.splitlines() if line.lstrip().startswith("{")]
    assert plain.stdout.count("Observation ") == 5


AGENT_LOOP = Path(__file__).resolve().parent.parent / "examples" / "agent_loop.py"


@pytest.mark.parametrize("fmt", ["openai", "openai-responses", "anthropic"])
def test_agent_loop_offers_the_exported_tools_and_dispatches_with_run_tool_call(
    tmp_path: Path, fmt: str
) -> None:
    """Issue 19: the loop's tool list is the exporter's, every action is a tool call in the
    provider's own shape (parse_tool_call reads it as that provider's), and every
    observation is the provider-shaped result run_tool_call returned: the output and the
    containment line on success, an ERROR text (is_error for Anthropic) for the refusal."""
    import json
    import subprocess
    import sys

    from metnos_exec.toolcall import parse_tool_call
    from metnos_exec.tools import definitions_from_folder

    _bwrap()  # the containment line names the walls of the bwrap arm's report
    env = {**os.environ, "HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}
    out = subprocess.run(
        [sys.executable, str(AGENT_LOOP), "--format", fmt],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    exported, _ = definitions_from_folder(EXAMPLES, fmt)  # type: ignore[arg-type]
    names = sorted(t["function"]["name"] if "function" in t else t["name"] for t in exported)
    assert lines[0] == f"Tools ({fmt}, from the exporter): {', '.join(names)}"
    provider = {"openai": "openai-chat"}.get(fmt, fmt)
    actions = [json.loads(line.split(": ", 1)[1]) for line in lines if line.startswith("Action")]
    replies = [
        json.loads(line.split(": ", 1)[1]) for line in lines if line.startswith("Observation")
    ]
    assert len(actions) == len(replies) == 5
    for action, reply in zip(actions, replies, strict=True):
        call = parse_tool_call(action)
        assert call.provider == provider and call.name in names
        if fmt == "openai":
            assert reply["role"] == "tool" and reply["tool_call_id"] == call.id
        elif fmt == "openai-responses":
            assert reply["type"] == "function_call_output" and reply["call_id"] == call.id
        else:
            assert reply["type"] == "tool_result" and reply["tool_use_id"] == call.id
    if fmt != "anthropic":  # strict tools: every property sent, null for those left out
        first = parse_tool_call(actions[0])
        assert first.args == {"path": None, "max_bytes": None}
    texts = [r.get("content", r.get("output")) for r in replies]
    assert json.loads(texts[0].splitlines()[0])["notes"][0]["path"] == "ideas.md"
    assert parse_tool_call(actions[1]).args["path"] == "~/notes/ideas.md"  # read from obs 1
    # The model reads which walls held: all of them, or the ones that did not, named (an
    # unprivileged worker's resources axis is partial: per-user kernel quotas, README).
    line = r"in the bwrap sandbox \((every wall held|walls not fully held: (.+))\)"
    held = re.search(line, texts[0])
    assert held, texts[0]
    if held.group(2) is not None:  # as root every wall holds (the root CI run shows it)
        assert os.geteuid() != 0, held.group(2)
        axis = r"(files|network|process_tree|user|resources) (partial|not_kept): "
        assert re.match(axis, held.group(2)), held.group(2)
    assert "can be undone" in texts[2]
    assert texts[3].startswith("ERROR:") and "E_CAPABILITY_DENIED" in texts[3]
    if fmt == "anthropic":
        assert [r["is_error"] for r in replies] == [False, False, False, True, False]
    assert "- reply to Ada about the queue" in texts[4]
