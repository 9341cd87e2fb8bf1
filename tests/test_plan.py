"""The invocation planner: manifest + arguments + autonomy → a vetted SandboxJob."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from metnos_exec.errors import (
    AutonomyDenied,
    BadArguments,
    CapabilityDenied,
    MetnosError,
    SymlinkedFolder,
)
from metnos_exec.manifest import CapabilitySpec, Executor, load_manifest
from metnos_exec.plan import default_skills_root, plan_invocation
from metnos_exec.policy import Policy
from metnos_exec.sandbox._types import PYTHON_WASM_MODULE, Mount
from metnos_exec.sandbox.flags import PYTHON_FLAGS


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    for d in ("notes", "notes/archive", "pics", "skills/google_mail"):
        (h / d).mkdir(parents=True)
    return h


def make_executor(root: Path, body: str, *, runtime: str = "python", name: str = "t") -> Executor:
    folder = root / "executors" / name
    folder.mkdir(parents=True)
    entry = {"python": "main.py", "wasm": "t.wasm", "wasm-python": "main.py"}[runtime]
    (folder / entry).write_bytes(b"")
    (folder / "manifest.toml").write_text(
        f'name = "{name}"\nversion = "1"\nruntime = "{runtime}"\nentry = "{entry}"\n' + body
    )
    return Executor(manifest=load_manifest(folder / "manifest.toml"), path=str(folder))


WRITE_NOTE = """
[args.path]
type = "string"
format = "path"
required = true
[args.mode]
enum = ["append", "sync"]
default = "append"

[[capabilities]]
name = "fs:write"
hints = ["~/notes/**"]

[[capabilities]]
name = "network:https"
hints = ["notes.example.com"]
when = { arg = "mode", values = ["sync"] }

[limits]
timeout_s = 20
memory_mb = 128
pids = 16
output_kb = 64
fuel = 1000
"""


def test_python_job_shape(tmp_path: Path, home: Path) -> None:
    ex = make_executor(tmp_path, WRITE_NOTE)
    inv = plan_invocation(ex, {"path": "~/notes/today.md"}, home=str(home))
    job = inv.job
    folder = os.path.realpath(ex.path)
    assert job.argv == (os.path.realpath(sys.executable), "-E", "-s", "-S", f"{folder}/main.py")
    assert job.wasm is None
    assert job.env == {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(home),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    assert msgspec.json.decode(job.stdin) == {
        "path": str(home / "notes" / "today.md"),
        "mode": "append",
    }
    assert inv.args["path"] == str(home / "notes" / "today.md")
    assert job.cwd == folder
    assert job.network is False
    lim = job.limits
    assert (lim.wall_time_s, lim.memory_bytes, lim.pids, lim.output_bytes) == (
        20.0,
        128 * 1024 * 1024,
        16,
        64 * 1024,
    )
    assert lim.fuel is None  # fuel means nothing to a native interpreter
    assert inv.runtime == "python" and inv.executor == "t"
    assert not inv.server_pinned
    assert inv.require_sandbox is True  # default policy: active fs:write needs the wall
    assert [c.hint for c in inv.checked] == ["~/notes/**"]


def test_base_interpreter_runs_stdlib_isolated() -> None:
    # The sandbox runs the resolved interpreter with -E -s -S: stdlib must import, and no
    # venv or user site-packages may be on sys.path.
    out = subprocess.run(
        [
            os.path.realpath(sys.executable),
            *PYTHON_FLAGS,
            "-c",
            "import json, sys, urllib.request, pathlib; print(json.dumps(sys.path))",
        ],
        capture_output=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    path = msgspec.json.decode(out.stdout)
    assert not any("site-packages" in p for p in path)


def test_job_timeout_only_shortens(tmp_path: Path, home: Path) -> None:
    ex = make_executor(tmp_path, WRITE_NOTE)
    args = {"path": "~/notes/a.md"}
    assert plan_invocation(ex, args, home=str(home), timeout_s=5).job.limits.wall_time_s == 5
    assert plan_invocation(ex, args, home=str(home), timeout_s=500).job.limits.wall_time_s == 20


def test_mounts_executor_ro_hints_rw_and_skip_missing(tmp_path: Path, home: Path) -> None:
    ex = make_executor(
        tmp_path,
        """
[[capabilities]]
name = "fs:read"
hints = ["~/pics/*.jpg", "~/missing/**", "~/notes/**"]
[[capabilities]]
name = "fs:write"
hints = ["~/notes/**", "~/notes/archive/*"]
""",
    )
    inv = plan_invocation(ex, {}, home=str(home))
    folder = os.path.realpath(ex.path)
    assert set(inv.job.mounts) == {
        Mount(folder, folder, False),
        Mount(str(home / "pics"), str(home / "pics"), False),
        # declared both read and write: one writable mount
        Mount(str(home / "notes"), str(home / "notes"), True),
        # below another mount: stays separate
        Mount(str(home / "notes/archive"), str(home / "notes/archive"), True),
    }
    hosts = [m.host for m in inv.job.mounts]
    assert hosts.index(str(home / "notes")) < hosts.index(str(home / "notes/archive"))
    assert any("~/missing/**" in n and "does not exist" in n for n in inv.notes)


def test_executor_folder_stays_read_only_under_write_hint(tmp_path: Path, home: Path) -> None:
    ex = make_executor(
        tmp_path, f'[[capabilities]]\nname = "fs:write"\nhints = ["{tmp_path}/executors/**"]\n'
    )
    inv = plan_invocation(ex, {}, home=str(home))
    by_host = {m.host: m.writable for m in inv.job.mounts}
    assert by_host[os.path.realpath(ex.path)] is False
    assert by_host[str(tmp_path / "executors")] is True


def test_root_hint_is_not_mounted(tmp_path: Path, home: Path) -> None:
    # load_manifest refuses such a hint; a manifest built by hand must still mount nothing.
    ex = make_executor(tmp_path, "")
    caps = (msgspec.convert({"name": "fs:read", "hints": ["/**"]}, CapabilitySpec),)
    ex = msgspec.structs.replace(
        ex, manifest=msgspec.structs.replace(ex.manifest, capabilities=caps)
    )
    inv = plan_invocation(ex, {}, home=str(home))
    assert [m.host for m in inv.job.mounts] == [os.path.realpath(ex.path)]
    assert any("host root" in n for n in inv.notes)


def test_symlinked_hint_folder_is_refused_not_followed(tmp_path: Path, home: Path) -> None:
    # Until issue 8 a symlinked hint folder was mounted at its target: the very move a job
    # with write access next to it used to have another executor's job mount the home.
    real = tmp_path / "real-notes"
    real.mkdir()
    (home / "linked").symlink_to(real)
    ex = make_executor(
        tmp_path,
        '[args.p]\nformat = "path"\n[[capabilities]]\nname = "fs:read"\nhints = ["~/linked/**"]\n',
    )
    for args in ({"p": "~/linked/x"}, {"p": str(real / "x")}):
        with pytest.raises(SymlinkedFolder, match="linked") as ei:
            plan_invocation(ex, args, home=str(home))
        assert ei.value.code == "E_SYMLINKED_FOLDER"
    # Declaring the real path works.
    ex = make_executor(
        tmp_path,
        f'[args.p]\nformat = "path"\n[[capabilities]]\nname = "fs:read"\nhints = ["{real}/**"]\n',
        name="t2",
    )
    inv = plan_invocation(ex, {"p": str(real / "x")}, home=str(home))
    assert Mount(str(real), str(real), False) in inv.job.mounts


def test_a_symlink_above_a_hint_folder_is_refused_too(tmp_path: Path, home: Path) -> None:
    # The swap of issue 8: executor A may write ~/X/**; a job of A replaced ~/X/inner, the
    # folder of B's hint, by a link to the home.
    (home / "X").mkdir()
    (home / "X" / "inner").symlink_to(home)
    ex = make_executor(
        tmp_path,
        '[[capabilities]]\nname = "fs:write"\nhints = ["~/X/inner/deeper/**"]\n',
    )
    with pytest.raises(SymlinkedFolder, match="X/inner"):
        plan_invocation(ex, {}, home=str(home))


def test_read_only_autonomy_refuses_mutating(tmp_path: Path, home: Path) -> None:
    ex = make_executor(tmp_path, WRITE_NOTE)
    with pytest.raises(AutonomyDenied, match="mutates files") as ei:
        plan_invocation(ex, {"path": "~/notes/a.md"}, autonomy="read_only", home=str(home))
    assert ei.value.code == "E_AUTONOMY"


def test_read_only_autonomy_forces_read_only_mounts(tmp_path: Path, home: Path) -> None:
    ex = make_executor(
        tmp_path,
        'mutating = false\n[[capabilities]]\nname = "fs:write"\nhints = ["~/notes/**"]\n',
    )
    sup = plan_invocation(ex, {}, home=str(home))
    ro = plan_invocation(ex, {}, autonomy="read_only", home=str(home))
    notes = str(home / "notes")
    assert {m.host: m.writable for m in sup.job.mounts}[notes] is True
    assert {m.host: m.writable for m in ro.job.mounts}[notes] is False
    assert ro.autonomy.level == "read_only"


def test_unknown_autonomy_is_refused(tmp_path: Path, home: Path) -> None:
    ex = make_executor(tmp_path, "")
    with pytest.raises(AutonomyDenied, match="unknown autonomy"):
        plan_invocation(ex, {}, autonomy="root", home=str(home))


def test_network_follows_when_clause_and_full_override(tmp_path: Path, home: Path) -> None:
    ex = make_executor(tmp_path, WRITE_NOTE)
    h = str(home)
    assert plan_invocation(ex, {"path": "~/notes/a"}, home=h).job.network is False
    inv = plan_invocation(ex, {"path": "~/notes/a", "mode": "sync"}, home=h)
    assert inv.job.network is True
    assert [i.name for i in plan_invocation(ex, {"path": "~/notes/a"}, home=h).inactive] == [
        "network:https"
    ]
    plain = make_executor(tmp_path, "", name="plain")
    assert plan_invocation(plain, {}, home=h).job.network is False
    assert plan_invocation(plain, {}, home=h, autonomy="full").job.network is True


def test_provider_binding_mounts_skill_home_and_pins(tmp_path: Path, home: Path) -> None:
    ex = make_executor(
        tmp_path, '[[capabilities]]\nname = "provider:access"\nhints = ["google_mail"]\n'
    )
    skills = home / "skills"
    inv = plan_invocation(ex, {}, home=str(home), skills_root=str(skills))
    assert inv.job.network is True
    assert inv.server_pinned is True
    skill_home = str(skills / "google_mail")
    assert Mount(skill_home, skill_home, True) in inv.job.mounts
    # Only that skill's home: not the skills root, not a sibling skill.
    assert str(skills) not in {m.host for m in inv.job.mounts}
    # Under read_only the skill's own state stays writable (token refresh).
    ro = plan_invocation(ex, {}, home=str(home), skills_root=str(skills), autonomy="read_only")
    assert Mount(skill_home, skill_home, True) in ro.job.mounts


def test_a_skill_home_swapped_for_a_symlink_is_refused(tmp_path: Path, home: Path) -> None:
    # A skill's home is mounted read-write: a link in its place (planted by a job that may
    # write the skills root) would hand the job its target instead.
    (home / "skills").mkdir(exist_ok=True)
    (home / "skills" / "github").symlink_to(home)
    ex = make_executor(tmp_path, '[[capabilities]]\nname = "provider:access"\nhints = ["github"]\n')
    with pytest.raises(SymlinkedFolder, match="github"):
        plan_invocation(ex, {}, home=str(home), skills_root=str(home / "skills"))


def test_provider_skill_home_missing_is_noted(tmp_path: Path, home: Path) -> None:
    ex = make_executor(tmp_path, '[[capabilities]]\nname = "provider:access"\nhints = ["github"]\n')
    inv = plan_invocation(ex, {}, home=str(home), skills_root=str(home / "skills"))
    assert inv.server_pinned and inv.job.network
    assert any("'github'" in n for n in inv.notes)


def test_invalid_provider_grants_nothing(tmp_path: Path, home: Path) -> None:
    ex = make_executor(
        tmp_path, '[[capabilities]]\nname = "provider:access"\nhints = ["dropbox"]\n'
    )
    inv = plan_invocation(ex, {}, home=str(home), skills_root=str(home / "skills"))
    assert inv.job.network is False
    assert inv.server_pinned is False
    assert [m.host for m in inv.job.mounts] == [os.path.realpath(ex.path)]
    assert "PROVIDER_SKILLS" in inv.inactive[0].reason


def test_non_packable_is_pinned(tmp_path: Path, home: Path) -> None:
    ex = make_executor(tmp_path, "packable = false\n")
    assert plan_invocation(ex, {}, home=str(home)).server_pinned is True


def test_default_skills_root() -> None:
    assert default_skills_root("/h", {}) == "/h/.metnos/skills"
    assert default_skills_root("/h", {"METNOS_SKILLS_ROOT": "/s"}) == "/s"


def test_require_sandbox_follows_policy(tmp_path: Path, home: Path) -> None:
    ex = make_executor(tmp_path, WRITE_NOTE)
    args = {"path": "~/notes/a"}
    assert (
        plan_invocation(ex, args, home=str(home), policy=Policy("never")).require_sandbox is False
    )
    ro = make_executor(tmp_path, "", name="ro")
    assert plan_invocation(ro, {}, home=str(home)).require_sandbox is False
    assert plan_invocation(ro, {}, home=str(home), policy=Policy("always")).require_sandbox is True


def test_refusals_propagate_before_any_job(tmp_path: Path, home: Path) -> None:
    ex = make_executor(tmp_path, WRITE_NOTE)
    with pytest.raises(CapabilityDenied, match="argument `path`"):
        plan_invocation(ex, {"path": "/etc/passwd"}, home=str(home))
    with pytest.raises(BadArguments, match="required"):
        plan_invocation(ex, {}, home=str(home))


def test_wasm_job_shapes(tmp_path: Path, home: Path) -> None:
    body = '[limits]\nfuel = 5000\n[[capabilities]]\nname = "fs:read"\nhints = ["~/notes/**"]\n'
    w = make_executor(tmp_path, body, runtime="wasm", name="w")
    inv = plan_invocation(w, {}, home=str(home))
    folder = os.path.realpath(w.path)
    assert inv.job.argv == ()
    assert inv.job.wasm is not None
    assert inv.job.wasm.module == f"{folder}/t.wasm"
    assert inv.job.wasm.args == ("w",)
    assert inv.job.limits.fuel == 5000
    assert Mount(str(home / "notes"), str(home / "notes"), False) in inv.job.mounts

    wp = make_executor(tmp_path, body, runtime="wasm-python", name="wp")
    inv = plan_invocation(wp, {}, home=str(home))
    folder = os.path.realpath(wp.path)
    assert inv.job.wasm is not None
    assert inv.job.wasm.module == PYTHON_WASM_MODULE
    # Like native: isolated, no site; -u first, where the arm looks before adding its own.
    assert inv.job.wasm.args == ("python", "-u", "-E", "-s", "-S", f"{folder}/main.py")
    from metnos_exec.sandbox.wasm import _python_argv

    assert _python_argv(inv.job.wasm.args) == list(inv.job.wasm.args)  # -u not doubled
    # main.py must be readable by the guest interpreter: the folder is a read-only preopen.
    assert Mount(folder, folder, False) in inv.job.mounts


def test_wasm_skips_file_hints(tmp_path: Path, home: Path) -> None:
    (home / "notes" / "one.md").write_text("x")
    body = '[[capabilities]]\nname = "fs:read"\nhints = ["~/notes/one.md"]\n'
    w = make_executor(tmp_path, body, runtime="wasm", name="w")
    inv = plan_invocation(w, {}, home=str(home))
    assert [m.host for m in inv.job.mounts] == [os.path.realpath(w.path)]
    assert any("is not a folder" in n for n in inv.notes)
    # The native arms bind single files fine.
    p = make_executor(tmp_path, body, name="p")
    one = str(home / "notes" / "one.md")
    assert Mount(one, one, False) in plan_invocation(p, {}, home=str(home)).job.mounts


def test_missing_hint_folder_is_refused_before_launch(tmp_path: Path) -> None:
    # A newcomer without ~/notes: refused with the fix, not "Read-only file system" later.
    from metnos_exec.errors import MissingFolder

    h = tmp_path / "newcomer"
    h.mkdir()
    ex = make_executor(tmp_path, WRITE_NOTE)
    with pytest.raises(MissingFolder, match=r"create it first") as ei:
        plan_invocation(ex, {"path": "~/notes/today.md"}, home=str(h))
    assert ei.value.code == "E_MISSING_FOLDER"
    assert f"{h}/notes does not exist" in ei.value.message
    (h / "notes").mkdir()
    inv = plan_invocation(ex, {"path": "~/notes/today.md"}, home=str(h))
    assert Mount(host=str(h / "notes"), guest=str(h / "notes"), writable=True) in inv.job.mounts


ONE_PATH = """
[args.path]
type = "string"
format = "path"
required = true
[[capabilities]]
name = "fs:write"
hints = ["{hint}"]
"""

#: Hint and argument shapes (issue 15 item 15): (hint, what the host has at
#: ~/notes/todo.txt, the argument) -> the writable mount, or the refusal's code. A hint
#: naming one file binds that file alone (the job sees nothing beside it; its writes are
#: backed up, not staged: tests/undo/test_reversible_jobs.py); a literal hint admits
#: only itself; a glob hint mounts the folder before its first glob segment.
SHAPES = [
    ("~/notes/todo.txt", "file", "~/notes/todo.txt", "~/notes/todo.txt"),
    ("~/notes/todo.txt", "file", "~/notes/other.txt", "E_CAPABILITY_DENIED"),
    ("~/notes/todo.txt", "file", "~/notes", "E_CAPABILITY_DENIED"),
    ("~/notes/todo.txt", "file", "~/notes/todo.txt/x", "E_CAPABILITY_DENIED"),
    ("~/notes/todo.txt", "nothing", "~/notes/todo.txt", "E_MISSING_FOLDER"),
    ("~/notes/todo.txt", "folder", "~/notes/todo.txt", "~/notes/todo.txt"),
    ("~/notes/todo.txt", "folder", "~/notes/todo.txt/a", "E_CAPABILITY_DENIED"),
    ("~/notes/**", "file", "~/notes/todo.txt", "~/notes"),
    ("~/notes/*.txt", "file", "~/notes/todo.txt", "~/notes"),
    ("~/notes/*.txt", "file", "~/notes/a.md", "E_CAPABILITY_DENIED"),
]


@pytest.mark.parametrize(("hint", "has", "arg", "outcome"), SHAPES)
def test_hint_and_argument_shapes(
    tmp_path: Path, home: Path, hint: str, has: str, arg: str, outcome: str
) -> None:
    target = home / "notes" / "todo.txt"
    if has == "file":
        target.write_text("x")
    elif has == "folder":
        target.mkdir()
    ex = make_executor(tmp_path, ONE_PATH.format(hint=hint))
    if outcome.startswith("E_"):
        with pytest.raises(MetnosError) as refused:
            plan_invocation(ex, {"path": arg}, home=str(home))
        assert refused.value.code == outcome
        return
    inv = plan_invocation(ex, {"path": arg}, home=str(home))
    mounted = outcome.replace("~", str(home))
    assert inv.write_roots == (mounted,)
    assert Mount(host=mounted, guest=mounted, writable=True) in inv.job.mounts
    assert inv.write_targets == (arg.replace("~", str(home)),)
