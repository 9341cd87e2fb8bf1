"""Landlock in the bwrap arm: the in-guest step on its own (on the host: landlock needs no
privilege), then through the arm on real bubblewrap, each denial next to a control run
without landlock that shows the same guest getting through."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from metnos_exec.sandbox._types import Failure, Mount, SandboxJob, Success
from metnos_exec.sandbox.bwrap import BwrapSandbox
from metnos_exec.sandbox.flags import SYSTEM_PATHS, guest_python
from metnos_exec.sandbox.hardening import Hardening, annotate, host_hardening
from metnos_exec.sandbox.landlock import (
    EXECUTE,
    READ,
    READ_FILE,
    SCOPE,
    SCRIPT_ENV,
    STEP_ENV,
    TRUNCATE,
    WRITE,
    WRITE_FILE,
    compiled_script,
    guest_program,
    guest_source,
    landlock_abi,
    landlock_rules,
    landlock_support,
    wrap_argv,
)
from tests.conftest import need
from tests.sandbox.test_bwrap import need_bwrap, py_job, report

PY = guest_python()


def need_landlock() -> None:
    abi, why = landlock_abi()
    need(abi is not None, f"the kernel has no landlock: {why}")


# --- the rules ---------------------------------------------------------------------------


def test_rules_mirror_the_mounts() -> None:
    job = SandboxJob(
        argv=(PY, "-I", "-S", "/x/exe/main.py"),
        mounts=(
            Mount("/x/exe", "/x/exe"),
            Mount("/home/u/notes", "/home/u/notes", writable=True),
            Mount("/home/u/ref", "/home/u/ref"),
        ),
    )
    rules = {
        p: r
        for r, p in landlock_rules(
            job, interpreter_roots=("/opt/py",), exists=lambda _: True, isdir=lambda _: True
        )
    }
    assert rules["/x/exe"] == READ
    assert rules["/home/u/ref"] == READ
    assert rules["/home/u/notes"] == READ | WRITE
    assert rules["/tmp"] == rules["/dev/shm"] == READ | WRITE
    assert rules["/proc"] == READ  # never written
    assert rules["/usr"] == rules["/opt/py"] == READ | EXECUTE
    # Nowhere else may the guest execute, make a socket or a device node.
    for path, rights in rules.items():
        if path not in (*SYSTEM_PATHS, "/opt/py"):
            assert not rights & EXECUTE, path
        assert not rights & ((1 << 9) | (1 << 6) | (1 << 11)), path  # MAKE_SOCK/CHAR/BLOCK
    # A symlinked system tree (merged /usr) is covered by its target's rule.
    links = {"/bin": "usr/bin", "/lib": "usr/lib"}
    linked = landlock_rules(
        job, interpreter_roots=(), exists=lambda _: True, readlink=links.get, isdir=lambda _: True
    )
    assert {p for _, p in linked}.isdisjoint(links) and (READ | EXECUTE, "/usr") in linked
    # The read-only mount holding the job's command (a standalone interpreter) executes.
    standalone = SandboxJob(
        argv=("/cache/py/bin/python3", "-I", "-S", "/x/exe/main.py"),
        mounts=(Mount("/x/exe", "/x/exe"), Mount("/cache/py", "/cache/py")),
    )
    got = dict(
        (p, r) for r, p in landlock_rules(standalone, interpreter_roots=(), isdir=lambda _: True)
    )
    assert got["/cache/py"] == READ | EXECUTE and got["/x/exe"] == READ
    # A staged writable folder (an overlay the worker cannot see) is a folder.
    staged = SandboxJob(
        argv=("/bin/true",), mounts=(Mount("/ns/ov/0", "/home/u/notes", True, staged=True),)
    )
    assert (READ | WRITE, "/home/u/notes") in landlock_rules(
        staged, interpreter_roots=(), isdir=lambda _: False
    )
    # A mount of a single file gets only what a file can hold (the kernel refuses more).
    files = landlock_rules(job, interpreter_roots=(), isdir=lambda path: path == "/x/exe")
    assert (READ_FILE | WRITE_FILE | TRUNCATE, "/home/u/notes") in files
    assert (READ_FILE, "/home/u/ref") in files and (READ, "/x/exe") in files


def test_wrap_runs_a_python_script_in_place_and_execs_anything_else(tmp_path: Path) -> None:
    rules = ((READ, "/a"),)
    main = tmp_path / "main.py"
    main.write_text("print(1)\n")
    run, env = wrap_argv((PY, "-I", "-S", str(main), "arg"), rules, python=PY, ctypes_path="")
    loader, step_env = guest_program(PY)
    assert run[:5] == (PY, "-I", "-S", "-c", loader)
    assert run[5:] == ("run", "", str(SCOPE), str(READ), "/a", "--", str(main), "arg")
    # The step's code and the compiled script travel in the environment, not the argv.
    assert env == {**step_env, SCRIPT_ENV: compiled_script(str(main))}
    assert env[STEP_ENV] and env[SCRIPT_ENV]
    other, other_env = wrap_argv(("/bin/sh", "-c", "echo"), rules, python=PY, ctypes_path="")
    assert other[5] == "exec" and other[-4:] == ("--", "/bin/sh", "-c", "echo")
    assert other_env == step_env
    flags, _ = wrap_argv((PY, "-I", "-S", "-u", str(main)), rules, python=PY, ctypes_path="")
    assert flags[5] == "exec"  # other interpreter flags: run it as given
    # Another interpreter gets the source (a marshalled program is the worker's own's).
    src, src_env = wrap_argv(("/bin/true",), rules, python="/usr/bin/python3.9", ctypes_path="")
    assert src[4:6] == (guest_source(), "exec") and src_env == {}


# --- the in-guest step, on the host ---------------------------------------------------------


def step(
    tmp_path: Path,
    target: list[str],
    *,
    rules: list[tuple[int, str]] | None = None,
    program: str | None = None,
    ctypes_path: str | None = None,
    compiled: bool = True,
) -> subprocess.CompletedProcess[bytes]:
    """Run the in-guest step directly (no sandbox): read and execute everywhere, write in
    ``tmp_path/w`` only, unless `rules` says otherwise. Without `compiled`, the step
    compiles the script itself."""
    need_landlock()
    if rules is None:
        rules = [(READ | EXECUTE, "/"), (READ | WRITE, str(tmp_path / "w"))]
    (tmp_path / "w").mkdir(exist_ok=True)
    if ctypes_path is None:
        ctypes_path = landlock_support().ctypes_path
    wrapped, env = wrap_argv(target, rules, python=PY, ctypes_path=ctypes_path)
    argv = list(wrapped)
    if not compiled:
        env.pop(SCRIPT_ENV, None)
    if program is not None:  # a test's own version of the step, from source
        argv[4] = program
    return subprocess.run(
        argv,
        capture_output=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", **env},
    )


def script(tmp_path: Path, code: str, name: str = "main.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


PROBE = """
import json, os, sys
def attempt(fn):
    try:
        fn(); return "ok"
    except OSError as e:
        return e.errno
out = {"argv": sys.argv, "name": __name__, "file": __file__, "doc": __doc__,
       "main_is_me": sys.modules["__main__"].__dict__ is globals(),
       "write_w": attempt(lambda: open(sys.argv[1] + "/w/f", "w").close()),
       "write_here": attempt(lambda: open(sys.argv[1] + "/f", "w").close())}
print(json.dumps(out))
"""


def test_step_restricts_itself_then_runs_the_script_as_python_would(tmp_path: Path) -> None:
    main = script(tmp_path, '"""doc"""\n' + PROBE)
    done = step(tmp_path, [PY, "-I", "-S", main, str(tmp_path)])
    assert done.returncode == 0, done.stderr.decode()
    got = json.loads(done.stdout)
    assert got["argv"] == [main, str(tmp_path)]
    assert (got["name"], got["file"], got["doc"], got["main_is_me"]) == (
        "__main__",
        main,
        "doc",
        True,
    )
    assert got["write_w"] == "ok"
    assert got["write_here"] == 13  # EACCES: landlock, not the file mode (we may write there)
    assert os.access(tmp_path, os.W_OK)


def test_step_fallbacks_still_restrict(tmp_path: Path) -> None:
    # No _ctypes.call_function (newer CPython), no known path to _ctypes, and no
    # Py_CompileStringExFlags symbol: the slower paths must give the same result.
    handicap = textwrap.dedent(
        """
        import _ctypes
        del _ctypes.call_function
        _dlsym = _ctypes.dlsym
        def _no_compile(handle, name):
            if name == "Py_CompileStringExFlags":
                raise OSError("gone")
            return _dlsym(handle, name)
        _ctypes.dlsym = _no_compile
        """
    )
    main = script(tmp_path, PROBE)
    done = step(
        tmp_path,
        [PY, "-I", "-S", main, str(tmp_path)],
        program=handicap + guest_source(),
        ctypes_path="",
        compiled=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    got = json.loads(done.stdout)
    assert (got["write_w"], got["write_here"]) == ("ok", 13)
    bad_path = step(tmp_path, [PY, "-I", "-S", main, str(tmp_path)], ctypes_path="/nonexistent")
    assert json.loads(bad_path.stdout)["write_here"] == 13


def test_the_worker_compiles_the_script_once_per_version(tmp_path: Path) -> None:
    main = Path(script(tmp_path, "print('one')"))
    first = compiled_script(str(main))
    assert first and compiled_script(str(main)) == first  # cached
    main.write_text("print('two, longer')")
    assert compiled_script(str(main)) not in ("", first)  # changed: compiled again
    assert step(tmp_path, [PY, "-I", "-S", str(main)]).stdout == b"two, longer\n"
    # What the compiler would say, the guest says itself, on the job's stderr.
    noisy = Path(script(tmp_path, "x = '\\d'\nprint(x)\n", "noisy.py"))
    assert compiled_script(str(noisy)) == ""
    out = step(tmp_path, [PY, "-I", "-S", str(noisy)])
    plain = subprocess.run([PY, "-I", "-S", str(noisy)], capture_output=True, check=False)
    assert (out.stdout, out.stderr) == (plain.stdout, plain.stderr)
    assert compiled_script(str(tmp_path / "missing.py")) == ""


@pytest.mark.parametrize("compiled", [True, False])
def test_step_keeps_the_scripts_exit_status_and_traceback(tmp_path: Path, compiled: bool) -> None:
    exits = step(
        tmp_path, [PY, "-I", "-S", script(tmp_path, "import sys; sys.exit(3)")], compiled=compiled
    )
    assert exits.returncode == 3
    main = script(tmp_path, "def f():\n    raise KeyError('boom')\nf()\n", "crash.py")
    crash = step(tmp_path, [PY, "-I", "-S", main], compiled=compiled)
    plain = subprocess.run([PY, "-I", "-S", main], capture_output=True, check=False)
    assert crash.returncode == plain.returncode == 1
    # The same traceback as without the step: no frame of the step itself.
    assert crash.stderr == plain.stderr, crash.stderr.decode()
    bad = script(tmp_path, "x = (\n", "bad.py")
    syntax = step(tmp_path, [PY, "-I", "-S", bad])
    assert syntax.returncode == 1 and b"bad.py" in syntax.stderr and b"SyntaxError" in syntax.stderr
    missing = step(tmp_path, [PY, "-I", "-S", str(tmp_path / "nope.py")])
    assert missing.returncode == 2 and b"can't open file" in missing.stderr


def test_step_decodes_the_source_as_python_does(tmp_path: Path) -> None:
    path = tmp_path / "latin.py"
    path.write_bytes(b"# -*- coding: latin-1 -*-\nprint(ascii('\xe9'))\n")
    done = step(tmp_path, [PY, "-I", "-S", str(path)])
    assert done.stdout == b"'\\xe9'\n", done.stderr.decode()
    nul = tmp_path / "nul.py"
    nul.write_bytes(b"x = 1\0\n")
    failed = step(tmp_path, [PY, "-I", "-S", str(nul)])
    assert failed.returncode == 1 and b"null bytes" in failed.stderr


def test_the_jobs_own_garbage_is_collected_as_usual(tmp_path: Path) -> None:
    # The step freezes what exists before the script (start-up objects, its own): the
    # script's objects, cycles included, are the collector's as in a plain interpreter.
    main = script(
        tmp_path,
        """
        import gc, json
        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        print(json.dumps({"enabled": gc.isenabled(), "collected": gc.collect() >= 2}))
        """,
    )
    assert json.loads(step(tmp_path, [PY, "-I", "-S", main]).stdout) == {
        "enabled": True,
        "collected": True,
    }


def test_step_pickles_functions_of_the_main_script(tmp_path: Path) -> None:
    main = script(
        tmp_path,
        """
        import pickle
        def f():
            return 42
        print(pickle.loads(pickle.dumps(f))())
        """,
    )
    done = step(tmp_path, [PY, "-I", "-S", main])
    assert done.stdout == b"42\n", done.stderr.decode()


def test_step_execs_other_commands_restricted(tmp_path: Path) -> None:
    sh = shutil.which("sh", path="/usr/bin:/bin")
    assert sh is not None
    out = step(tmp_path, ["sh", "-c", f"echo x > {tmp_path}/w/a && echo ok; echo x > {tmp_path}/b"])
    assert out.stdout == b"ok\n" and b"Permission denied" in out.stderr
    assert (tmp_path / "w" / "a").exists() and not (tmp_path / "b").exists()
    assert step(tmp_path, ["no-such-command-here"]).returncode == 127
    notexec = tmp_path / "w" / "data"
    notexec.write_text("x")
    assert step(tmp_path, [str(notexec)]).returncode == 126


def test_step_fails_closed(tmp_path: Path) -> None:
    main = script(tmp_path, "print('ran')")
    # The kernel refuses to restrict the process (simulated): the job must not run.
    refuse = textwrap.dedent(
        """
        import _ctypes
        _call = _ctypes.call_function
        def _refuse_restrict(addr, args):
            return -1 if args[:1] == (446,) else _call(addr, args)
        _ctypes.call_function = _refuse_restrict
        """
    )
    done = step(
        tmp_path,
        [PY, "-I", "-S", main],
        program=refuse + guest_source(),
        ctypes_path="",
    )
    assert done.returncode == 126 and done.stdout == b"", done
    assert b"landlock_restrict_self failed" in done.stderr


# --- through the arm, on real bubblewrap ----------------------------------------------------


def arm_with(*, landlock: bool = True, seccomp: bool = True) -> BwrapSandbox:
    need_bwrap()
    need_landlock()
    hard = host_hardening()
    assert hard.landlock_active and hard.seccomp_active, hard
    if not landlock:
        hard = msgspec.structs.replace(hard, landlock_abi=None, landlock="off (control)")
    if not seccomp:
        hard = msgspec.structs.replace(hard, seccomp_arch=None, seccomp="off (control)")
    return BwrapSandbox(hardening=hard)


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_proc_is_read_only_for_the_guest(tmp_path: Path) -> None:
    code = """
        import json
        try:
            open("/proc/self/comm", "w").write("renamed"); print(json.dumps("wrote"))
        except OSError as e:
            print(json.dumps(e.errno))
        """
    job = py_job(tmp_path, code)
    assert report(await arm_with().run(job)) == 13  # EACCES from landlock
    assert report(await arm_with(landlock=False).run(job)) == "wrote"  # control


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_nothing_written_by_the_job_can_be_executed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)
    true = shutil.which("true", path="/usr/bin:/bin")
    assert true is not None
    code = f"""
        import json, os, shutil, subprocess
        shutil.copy({true!r}, {str(data / "t")!r})
        os.chmod({str(data / "t")!r}, 0o755)
        try:
            print(json.dumps(subprocess.run([{str(data / "t")!r}]).returncode))
        except OSError as e:
            print(json.dumps(e.errno))
        """
    job = py_job(tmp_path, code, mounts=(Mount(str(data), str(data), writable=True),))
    assert report(await arm_with().run(job)) == 13
    assert report(await arm_with(landlock=False).run(job)) == 0


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_no_socket_file_in_a_writable_folder(tmp_path: Path) -> None:
    # mknod(S_IFSOCK) needs no capability: only landlock's MAKE_SOCK stops it (seccomp
    # stops socket(AF_UNIX), so this is the path a socket file could still take).
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)
    code = f"""
        import json, os, stat
        out = {{}}
        for kind, mode in (("sock", stat.S_IFSOCK), ("fifo", stat.S_IFIFO)):
            try:
                os.mknod({str(data)!r} + "/" + kind, mode | 0o600); out[kind] = "made"
            except OSError as e:
                out[kind] = e.errno
        print(json.dumps(out))
        """
    job = py_job(tmp_path, code, mounts=(Mount(str(data), str(data), writable=True),))
    assert report(await arm_with().run(job)) == {"sock": 13, "fifo": "made"}
    for leftover in data.iterdir():
        leftover.unlink()
    assert report(await arm_with(landlock=False).run(job)) == {"sock": "made", "fifo": "made"}
    assert stat.S_ISSOCK((data / "sock").lstat().st_mode)


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_no_signal_leaves_the_job(tmp_path: Path) -> None:
    code = """
        import json, os
        try:
            os.kill(1, 0); print(json.dumps("reached"))   # bubblewrap's init
        except OSError as e:
            print(json.dumps(e.errno))
        """
    job = py_job(tmp_path, code)
    assert report(await arm_with().run(job)) == 1  # EPERM: scoped (ABI >= 6)
    assert report(await arm_with(landlock=False).run(job)) == "reached"


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_host_abstract_socket_unreachable_even_with_the_host_network(
    tmp_path: Path,
) -> None:
    addr = f"\0metnos-ll-{os.getpid()}-{time.monotonic_ns()}"
    code = f"""
        import json, socket
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect({addr!r}); print(json.dumps("connected"))
        except OSError as e:
            print(json.dumps(e.errno))
        """
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(addr)
        srv.listen(4)
        job = py_job(tmp_path, code, network=True)
        # Landlock's scope alone (the seccomp filter, which refuses the socket, is off).
        assert report(await arm_with(seccomp=False).run(job)) == 1
        assert report(await arm_with(seccomp=False, landlock=False).run(job)) == "connected"


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_the_job_still_works_where_its_rules_allow(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    notes.chmod(0o777)
    (notes / "in.md").write_text("hello")
    code = f"""
        import json, os, subprocess, tempfile, multiprocessing
        src = open({str(notes / "in.md")!r}).read()
        os.makedirs({str(notes)!r} + "/sub/deep")
        tmp = {str(notes)!r} + "/sub/deep/.tmp"
        open(tmp, "w").write(src.upper())
        os.replace(tmp, {str(notes)!r} + "/out.md")          # a rename across folders
        with tempfile.TemporaryDirectory() as d:
            open(d + "/x", "w").write("scratch")
        open("/dev/null", "w").write("x")
        sh = subprocess.run(["sh", "-c", "echo from-sh"], capture_output=True, text=True)
        lock = multiprocessing.Lock()                        # a POSIX semaphore in /dev/shm
        print(json.dumps({{"sh": sh.stdout.strip(), "listing": sorted(os.listdir("/"))[:1]}}))
        """
    job = py_job(
        tmp_path,
        code,
        mounts=(Mount(str(notes), str(notes), writable=True),),
        env={"PATH": "/usr/bin:/bin"},
    )
    got = report(await arm_with().run(job))
    assert got["sh"] == "from-sh"
    assert (notes / "out.md").read_text() == "HELLO"


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_python_jobs_keep_their_exit_and_traceback(tmp_path: Path) -> None:
    arm = arm_with()
    assert (await arm.run(py_job(tmp_path, "import sys; sys.exit(7)"))).exit == Failure(7)
    out = await arm.run(py_job(tmp_path, "def f():\n    1/0\nf()\n"))
    assert out.exit == Failure(1)
    text = out.stderr.decode()
    assert "ZeroDivisionError" in text and "<string>" not in text, text
    assert text.count("File ") == 2  # the script's <module> and f: nothing of the step
    ok = await arm.run(SandboxJob(argv=("/bin/sh", "-c", "echo $0", "named")))
    assert (ok.exit, ok.stdout) == (Success(), b"named\n")


# --- the report -----------------------------------------------------------------------------


def test_report_names_landlock_or_its_absence() -> None:
    need_bwrap()
    job = SandboxJob(argv=("/bin/true",))
    hard = host_hardening()
    on = BwrapSandbox(hardening=hard).containment(job)
    if hard.landlock_active:
        assert f"landlock ABI {hard.landlock_abi}" in on.files.reason
    off = Hardening(
        seccomp_arch=hard.seccomp_arch,
        seccomp=hard.seccomp,
        landlock_abi=None,
        landlock="landlock unavailable (landlock_create_ruleset: Operation not supported)",
    )
    report_off = BwrapSandbox(hardening=off).containment(job)
    assert "landlock unavailable" in report_off.files.reason
    # The mounts still hold: landlock's absence alone weakens no axis.
    assert report_off.files.state == on.files.state
    assert annotate(on, job, off).files.state == on.files.state


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_the_step_leaves_no_fd_and_fits_a_small_fd_budget(tmp_path: Path) -> None:
    from metnos_exec.sandbox._types import ResourceLimits

    code = """
        import json, os
        print(json.dumps(sorted(int(fd) for fd in os.listdir("/proc/self/fd"))))
        """
    for limit in (256, 16):
        job = py_job(tmp_path, code, limits=ResourceLimits(open_files=limit))
        # stdio, and the fd the listing itself opened
        assert report(await arm_with().run(job)) == [0, 1, 2, 3], limit
