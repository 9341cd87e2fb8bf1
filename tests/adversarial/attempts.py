"""The table of attempts: one row each, id, axis, mechanism, script, what must become of it.

Rows marked *helper* prepare a later phase (plant a link, rewrite an executor) and are not
rows themselves: their own job is within its hints. Issue 8's defects are marked
``(issue 8 #N)``; the spec's syscall list (section 3) is one row per system call family.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

from metnos_exec.messages import Result

from .harness import Attempt, World, _processes_with

WRITE_OWN = (("fs:write", ("{own}/**",)),)
READ_NOTES = (("fs:read", ("~/notes/**",)),)
MiB = 1 << 20


# --- host-side checks ---------------------------------------------------------------------


def _absent(*rel: str):  # type: ignore[no-untyped-def]
    def check(world: World, _result: Result | None) -> str | None:
        for r in rel:
            p = world.home / r.replace("{token}", world.token)
            if os.path.lexists(p):
                return f"{p} exists on the host"
        return None

    return check


def _no_special_files(name: str):  # type: ignore[no-untyped-def]
    """After the commit: nothing setuid/setgid, no device, fifo or socket in the folder."""

    def check(world: World, _result: Result | None) -> str | None:
        own = world.home / "w" / name
        for top, dirs, files in os.walk(own):
            for entry in [*dirs, *files]:
                p = os.path.join(top, entry)
                st = os.lstat(p)
                if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                    return f"{p} is mode {st.st_mode:o} on the host"
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)) and not (
                    stat.S_ISLNK(st.st_mode)
                ):
                    return f"{p} is a special file (mode {st.st_mode:o}) on the host"
        return None

    return check


def _no_processes(suffix: str):  # type: ignore[no-untyped-def]
    def check(world: World, result: Result | None) -> str | None:
        left = _processes_with(f"{world.token}-{suffix}")
        if left:
            return f"processes survived the job: {left}"
        wall = result.usage.wall_s if result is not None and result.usage else 0.0
        if result is not None and result.status == "succeeded" and wall > 10:
            return f"the job lasted {wall:.1f} s: its leftovers kept it running"
        return None

    return check


def _no_connection(key: str):  # type: ignore[no-untyped-def]
    def check(world: World, _result: Result | None) -> str | None:
        seen = world.notes[f"accepted:{key}"] = world.notes.get(f"accepted:{key}", 0) + (
            world.accepted(key)
        )
        return f"{seen} connection(s) reached the host's {key} listener" if seen else None

    return check


def _queue_within(budget_mib: int):  # type: ignore[no-untyped-def]
    def check(world: World, _result: Result | None) -> str | None:
        files = [world.db, world.db.with_name(world.db.name + "-wal")]
        total = sum(p.stat().st_size for p in files if p.exists())
        return f"the queue holds {total / MiB:.0f} MiB" if total > budget_mib * MiB else None

    return check


def _core_pattern_unchanged(world: World, _result: Result | None) -> str | None:
    now = Path("/proc/sys/kernel/core_pattern").read_text()
    return None if now == world.notes["core_pattern"] else f"core_pattern is now {now!r}"


def _hostname_unchanged(world: World, _result: Result | None) -> str | None:
    now = socket.gethostname()
    return None if now == world.notes["hostname"] else f"hostname is now {now!r}"


def _canary_alive(world: World, _result: Result | None) -> str | None:
    assert world.canary is not None
    return None if world.canary.poll() is None else "the host canary process was killed"


def _disk_within(name: str, budget_mib: int):  # type: ignore[no-untyped-def]
    def check(world: World, _result: Result | None) -> str | None:
        own = world.home / "w" / name
        total = sum(p.stat().st_size for p in own.rglob("*") if p.is_file())
        return f"{total / MiB:.1f} MiB on the host" if total > budget_mib * MiB else None

    return check


def _executor_unchanged(name: str):  # type: ignore[no-untyped-def]
    def check(world: World, result: Result | None) -> str | None:
        out = result.output if result is not None else None
        if isinstance(out, dict) and out.get("rewritten"):
            return "the victim ran the code an earlier job wrote"
        return None

    return check


def _result_renders_safely(world: World, result: Result | None) -> str | None:
    """`metnos-exec result` on the job: no raw control character reaches the terminal."""
    assert result is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("METNOS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "metnos_exec", "result", result.job_id,
         "--broker", f"sqlite:///{world.db}"],
        capture_output=True, env=env, timeout=30, check=False,
    )  # fmt: skip
    shown = proc.stdout + proc.stderr
    if b"pwned" not in shown:
        return f"the test is broken: the job's text is not shown ({shown[-300:]!r})"
    # The log, as `tail` shows it: the uncommitted fifo's name (commit.filtered).
    proc = subprocess.run(
        [sys.executable, "-m", "metnos_exec", "tail", str(world.root / "worker.jsonl"),
         "--job", result.job_id, "--no-color"],
        capture_output=True, env=env, timeout=30, check=False,
    )  # fmt: skip
    if b"pwned" not in proc.stdout:
        return f"the test is broken: the log does not name the fifo ({proc.stdout[-300:]!r})"
    shown += proc.stdout + proc.stderr
    bad = sorted({chr(c).encode() for c in shown if (c < 32 and c not in (9, 10)) or c == 127})
    return f"raw control characters reached the terminal: {bad}" if bad else None


# --- set-ups ------------------------------------------------------------------------------


def _other_users_file(world: World) -> None:
    p = world.home / "notes" / "other-user"
    p.write_text("another user's secret")
    os.chown(p, 4242, 4242)
    p.chmod(0o600)


def _swap_target(world: World) -> None:
    inner = world.home / "X" / "swap" / "inner"
    inner.mkdir(parents=True)
    (inner / "b-data").write_text("B's own file")


def _host_socket(world: World) -> None:
    d = world.home / "sockdir"
    d.mkdir()
    world.listen_unix("mounted", str(d / "agent.sock"))
    (d / "agent.sock").chmod(0o777)


def _abstract_socket(world: World) -> None:
    world.listen_unix("abstract", f"\0metnos-adv-{world.token}")


def _tcp(world: World) -> None:
    if "tcp" not in world.listeners:
        world.ctx["port"] = world.listen_tcp("tcp")


def _outside_listeners(world: World) -> None:
    """The host's listeners the job's namespace must not reach (network.no_route_out)."""
    world.ctx["outside"] = {
        "tcp 127.0.0.2": world.listen_tcp("outside tcp4", "127.0.0.2"),
        "tcp [::1]": world.listen_tcp("outside tcp6", "::1"),
        "udp 127.0.0.3": world.listen_udp("outside udp", "127.0.0.3"),
    }


def _nothing_reached_outside(world: World, _result: Result | None) -> str | None:
    got = {key: world.accepted(key) for key in ("outside tcp4", "outside tcp6")}
    got["outside udp"] = world.received("outside udp")
    reached = {k: n for k, n in got.items() if n}
    return f"the host's listeners were reached: {reached}" if reached else None


def _granted_tcp(world: World) -> None:
    world.ctx["granted_port"] = world.listen_tcp("granted")


def _wall(world: World) -> None:
    """The network wall's rows: a listener the manifest names, and one it does not."""
    if "wall_ok" not in world.listeners:
        world.ctx["wall_port"] = world.listen_tcp("wall_ok")
        world.ctx["wall_secret"] = world.listen_tcp("wall_secret")


def _root_only_system_file(world: World) -> None:
    """A root-only file in a read-only system tree (as root; else nothing to plant)."""
    if os.geteuid() != 0:
        return
    p = Path("/usr/local/share") / f"metnos-adv-{world.token}"
    p.write_text("root only")
    p.chmod(0o600)
    world.cleanup.append(p)


def _shared_link_folder(world: World) -> None:
    (world.home / "w" / "shared").mkdir(parents=True, exist_ok=True)


MEMORY_ACROSS_PROCESSES = r"""
        import mmap
        held, pids = 0, []
        for _ in range(8):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    m = mmap.mmap(-1, 24 << 20)
                    for i in range(0, 24 << 20, 4096):
                        m[i] = 1
                    os.write(w, b"1")
                except BaseException:
                    os.write(w, b"0")
                import time; time.sleep(30)
                os._exit(0)
            os.close(w)
            held += 24 if os.read(r, 1) == b"1" else 0
            pids.append(pid)
        # A child may have been killed (out of memory) after it reported: count the living.
        alive = sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in pids)
        for pid in pids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        done(min(held, 24 * alive) > 96, reported_mib=held, alive=alive)
        """


def _no_capabilities(name: str):  # type: ignore[no-untyped-def]
    def check(world: World, _result: Result | None) -> str | None:
        for p in (world.home / "w" / name).iterdir():
            try:
                os.getxattr(p, "security.capability", follow_symlinks=False)
            except OSError:
                continue
            return f"{p} carries file capabilities on the host"
        return None

    return check


def _capability_tool(world: World) -> None:
    """A root-only file with capabilities (root only can set them: else nothing)."""
    if os.geteuid() != 0:
        return
    tool = world.home / "w" / "files_capability_tool_made_executable" / "tool"
    tool.write_bytes(b"#!/bin/sh\nid\n")
    tool.chmod(0o700)
    # VFS_CAP_REVISION_2, CAP_SETUID permitted + effective
    os.setxattr(tool, "security.capability", struct.pack("<IIIII", 0x02000001, 1 << 7, 0, 0, 0))


def _tool_not_exposed(name: str):  # type: ignore[no-untyped-def]
    def check(world: World, _result: Result | None) -> str | None:
        tool = world.home / "w" / name / "tool"
        if not tool.exists():
            return None  # not planted (an unprivileged run)
        mode = tool.stat().st_mode
        try:
            os.getxattr(tool, "security.capability")
        except OSError:
            return None
        return f"{tool} is mode {mode:o} with its capabilities" if mode & 0o011 else None

    return check


def _all_committed(name: str, folders: int):  # type: ignore[no-untyped-def]
    def check(world: World, result: Result | None) -> str | None:
        got = len(list((world.home / "w" / name).iterdir()))
        if result is not None and result.status == "succeeded" and got != folders:
            return f"succeeded with {got} of {folders} folders on the host"
        return None

    return check


def _single_file(world: World) -> None:
    (world.home / "w" / "files_single_file_write_hint" / "note.txt").write_text("original")


def _only_the_file(name: str):  # type: ignore[no-untyped-def]
    def check(world: World, _result: Result | None) -> str | None:
        got = sorted(p.name for p in (world.home / "w" / name).iterdir())
        return None if got == ["note.txt"] else f"the folder now holds {got}"

    return check


def _ro_inside_rw(world: World) -> None:
    ro = world.home / "w" / "files_read_hint_inside_write_hint" / "ro"
    ro.mkdir()
    (ro / "keep.txt").write_text("keep")


def _ro_inside_rw_intact(world: World, _result: Result | None) -> str | None:
    ro = world.home / "w" / "files_read_hint_inside_write_hint" / "ro"
    got = sorted(p.name for p in ro.iterdir()) if ro.is_dir() else None
    return None if got == ["keep.txt"] else f"the read-only folder now holds {got}"


def _shared2_folder(world: World) -> None:
    (world.home / "w" / "shared2").mkdir(parents=True, exist_ok=True)


def _skill_token(world: World) -> None:
    d = world.home / ".metnos" / "skills" / "mail"
    d.mkdir(parents=True)
    (d / "token").write_text("oauth refresh token")


def _state_untouched(world: World, _result: Result | None) -> str | None:
    p = Path(world.ctx["state"]) / "planted"
    return f"{p} was written on the host" if p.exists() else None


def _host_ipc(world: World) -> None:
    """A SysV shared memory segment and a POSIX one on the host, for jobs to look for."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key = int(world.token[:6], 16) | 0x10000000
    shmid = libc.shmget(key, 4096, 0o1000 | 0o666)  # IPC_CREAT
    assert shmid >= 0, ctypes.get_errno()
    world.ctx["shm_key"] = key
    world.on_close.append(lambda: libc.shmctl(shmid, 0, None))  # IPC_RMID
    shm = Path("/dev/shm") / f"metnos-adv-{world.token}"
    shm.write_text("host")
    world.cleanup.append(shm)


# --- the rows ----------------------------------------------------------------------------

FILES = [
    Attempt(
        "files.read_outside_hints",
        "files",
        "mount namespace (only hinted folders mounted)",
        r"""
        r = {p: attempt(lambda p=p: open(p, "rb").read()) for p in
             (HOME + "/secret/x", HOME + "/.ssh/id_rsa", HOME + "/notes/esc-rel",
              HOME + "/notes/esc-abs")}
        done(any(v == "ok" for v in r.values()), reads=r, home=sorted(os.listdir(HOME)))
        """,
        caps=READ_NOTES,
    ),
    Attempt(
        "files.queue_database",
        "files",
        "private /tmp, mount namespace",
        r"""
        r = {p: attempt(lambda p=p: open(p, "rb").read(16)) for p in
             (CTX["db"], CTX["db"] + "-wal", CTX["state"])}
        done(any(v == "ok" for v in r.values()), reads=r)
        """,
    ),
    Attempt(
        "files.system_secrets",
        "files",
        "slot uid / uid 65534, masked /etc private files",
        r"""
        def content(p):
            with open(p, "rb") as f:
                if f.read(1) == b"":
                    raise OSError(errno.ENODATA, "empty (masked)")
        r = {p: attempt(lambda p=p: content(p)) for p in
             ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/ssh/ssh_host_ed25519_key")}
        # /root may hold the path down to the interpreter (pyenv), and nothing else
        def root_home():
            seen = set(os.listdir("/root")) - {sys.base_prefix.split("/")[2]}
            if not seen:
                raise OSError(errno.ENOENT, "only the interpreter's path")
        r["/root"] = attempt(root_home)
        done(any(v == "ok" for v in r.values()), reads=r)
        """,
    ),
    Attempt(
        "files.other_users_file_in_hint",
        "files",
        "slot uid (idmapped mount maps only root)",
        r"""
        done(attempt(lambda: open(HOME + "/notes/other-user").read()) == "ok")
        """,
        caps=READ_NOTES,
        setup=_other_users_file,
        needs_root=True,
    ),
    Attempt(
        "files.argument_traversal",
        "files",
        "argument vetting (normalised), then the mounts",
        r"""
        done(attempt(lambda: open(ARGS["path"]).read()) == "ok", path=ARGS["path"])
        """,
        caps=READ_NOTES,
        path_arg="~/notes/../secret/x",
        stopped_by=frozenset({"E_CAPABILITY_DENIED"}),
    ),
    Attempt(
        "files.argument_through_a_link",
        "files",
        "argument vetting (links resolved), then the mounts",
        r"""
        done(attempt(lambda: open(ARGS["path"]).read()) == "ok", path=ARGS["path"])
        """,
        caps=READ_NOTES,
        path_arg="~/notes/esc-rel",
        stopped_by=frozenset({"E_CAPABILITY_DENIED"}),
    ),
    Attempt(
        "files.single_file_write_hint",
        "files",
        "a file hint binds that file alone (not staged: a file cannot be overlaid)",
        r"""
        r = {"the file": attempt(lambda: open(OWN + "/note.txt", "w").write("changed")),
             "a sibling": attempt(lambda: open(OWN + "/other.txt", "w").write("x")),
             "rename": attempt(lambda: os.rename(OWN + "/note.txt", OWN + "/moved.txt"))}
        # (a sibling may land in the sandbox's own /tmp when the home lies below /tmp:
        # the host decides)
        done(r["rename"] == "ok", calls=r)
        """,
        caps=(("fs:write", ("{own}/note.txt",)),),
        setup=_single_file,
        host_check=_only_the_file("files_single_file_write_hint"),
    ),
    Attempt(
        "files.read_hint_inside_write_hint",
        "files",
        "the deeper read-only mount wins",
        r"""
        r = {"write": attempt(lambda: open(OWN + "/ro/planted", "w").write("x")),
             "rename": attempt(lambda: os.rename(OWN + "/ro", OWN + "/moved")),
             "rmtree": attempt(lambda: os.unlink(OWN + "/ro/keep.txt"))}
        done(any(v == "ok" for v in r.values()), calls=r)
        """,
        caps=(("fs:write", ("{own}/**",)), ("fs:read", ("{own}/ro/**",))),
        setup=_ro_inside_rw,
        host_check=_ro_inside_rw_intact,
    ),
    Attempt(
        "files.write_read_only_hint",
        "files",
        "read-only bind (fs:read)",
        r"""
        r = {"create": attempt(lambda: open(HOME + "/notes/planted", "w").write("x"))}
        fd = os.open(HOME + "/notes/today.md", os.O_RDONLY)
        r["reopen for write"] = attempt(lambda: os.open(f"/proc/self/fd/{fd}", os.O_WRONLY))
        r["chmod"] = attempt(lambda: os.chmod(HOME + "/notes/today.md", 0o666))
        r["rename"] = attempt(lambda: os.rename(HOME + "/notes/today.md", HOME + "/notes/x"))
        done(any(v == "ok" for v in r.values()), calls=r)
        """,
        caps=READ_NOTES,
        host_check=_absent("notes/planted"),
    ),
    Attempt(
        "files.write_outside_hints",
        "files",
        "mount namespace, read-only system trees",
        r"""
        targets = [HOME + "/secret/planted", HOME + "/planted", "/var/tmp/planted",
                   "/etc/planted", "/usr/bin/planted", "/opt/planted"]
        r = {p: attempt(lambda p=p: open(p, "w").write("x")) for p in targets}
        # The home's own path may lie in the sandbox's private /tmp: the host decides there.
        done(any(v == "ok" for p, v in r.items() if not p.startswith(HOME)), writes=r)
        """,
        caps=WRITE_OWN,
        host_check=_absent("secret/planted", "planted"),
    ),
    Attempt(
        "files.executor_modifies_itself",
        "files",
        "executor folder bound read-only",
        r"""
        me = os.path.abspath(__file__)
        r = {"self": attempt(lambda: open(me, "a").write("\n# PLANTED")),
             "sibling": attempt(lambda: open(os.path.join(os.path.dirname(me), "x.py"), "w"))}
        done(any(v == "ok" for v in r.values()), writes=r)
        """,
        caps=(("fs:write", ("{own}/**",)),),
    ),
    Attempt(
        "files.symlink_out_of_writable_root",
        "files",
        "mount namespace; commit keeps links as links",
        r"""
        os.symlink(HOME + "/secret/x", OWN + "/ln")
        os.symlink(HOME + "/secret", OWN + "/dir")
        r = {"read": attempt(lambda: open(OWN + "/ln").read()),
             "write": attempt(lambda: open(OWN + "/dir/planted", "w").write("x"))}
        done(any(v == "ok" for v in r.values()), via_links=r)
        """,
        caps=WRITE_OWN,
        host_check=_absent("secret/planted"),
    ),
    Attempt(
        "files.hardlink_out_of_writable_root",
        "files",
        "separate mounts (EXDEV), staging overlay",
        r"""
        r = {}
        for src in (HOME + "/notes/today.md", "/etc/passwd", sys.executable):
            dst = OWN + "/hl-" + os.path.basename(src)
            r[src] = attempt(lambda src=src, dst=dst: os.link(src, dst))
            if r[src] == "ok":
                r[src + " written"] = attempt(lambda dst=dst: open(dst, "a").write("PLANTED"))
        done(any(v == "ok" for k, v in r.items() if k.endswith("written")), links=r)
        """,
        caps=(("fs:write", ("{own}/**",)), ("fs:read", ("~/notes/**",))),
    ),
    Attempt(
        "files.symlink_swap_hint.plant",
        "files",
        "helper (issue 8 #2): swaps inner for a link",
        r"""
        import shutil
        inner = HOME + "/X/swap/inner"
        shutil.rmtree(inner)
        os.symlink(HOME, inner)
        done(False, swapped=True)
        """,
        caps=(("fs:write", ("~/X/swap/**",)),),
        setup=_swap_target,
    ),
    Attempt(
        "files.symlink_swap_hint",
        "files",
        "mount sources opened without following links (issue 8 #2)",
        r"""
        inner = HOME + "/X/swap/inner"
        seen = sorted(os.listdir(inner))
        wrote = attempt(lambda: open(inner + "/planted", "w").write("x"))
        done("secret" in seen or ".ssh" in seen or wrote == "ok" and "b-data" not in seen,
             seen=seen, wrote=wrote)
        """,
        caps=(("fs:write", ("~/X/swap/inner/**",)),),
        phase=2,
        stopped_by=frozenset({"E_SYMLINKED_FOLDER"}),
        host_check=_absent("planted"),
    ),
    Attempt(
        "files.symlink_planted_then_followed.plant",
        "files",
        "helper: plants a link to ~/secret",
        r"""
        os.symlink(HOME + "/secret", HOME + "/w/shared/ln")
        done(False)
        """,
        caps=(("fs:write", ("~/w/shared/**",)),),
        setup=_shared_link_folder,
    ),
    Attempt(
        "files.symlink_planted_then_followed",
        "files",
        "mount namespace; commit never follows links",
        r"""
        r = attempt(lambda: open(HOME + "/w/shared/ln/planted", "w").write("x"))
        done(r == "ok", write=r)
        """,
        caps=(("fs:write", ("~/w/shared/**",)),),
        phase=2,
        stopped_by=frozenset({"E_SYMLINKED_FOLDER"}),
        host_check=_absent("secret/planted"),
    ),
    Attempt(
        "files.commit_through_planted_link.plant",
        "files",
        "helper: plants ln -> ~/secret",
        r"""
        os.symlink(HOME + "/secret", HOME + "/w/shared2/ln")
        done(False)
        """,
        caps=(("fs:write", ("~/w/shared2/**",)),),
        setup=_shared2_folder,
    ),
    Attempt(
        "files.commit_through_planted_link",
        "files",
        "commit replaces a link, never follows it",
        r"""
        # Inside, the link leads nowhere; replaced by a real folder, the commit must not
        # create the folder's content through the link still on the host.
        os.unlink(HOME + "/w/shared2/ln")
        os.mkdir(HOME + "/w/shared2/ln")
        with open(HOME + "/w/shared2/ln/planted", "w") as f:
            f.write("x")
        done(False)
        """,
        caps=(("fs:write", ("~/w/shared2/**",)),),
        phase=2,
        stopped_by=frozenset({"E_COMMIT_CONFLICT"}),
        host_check=_absent("secret/planted"),
    ),
    Attempt(
        "files.names_that_are_not_utf8",
        "files",
        "the commit refuses what its journal cannot record",
        r"""
        own = OWN.encode()
        r = {}
        for name in (b"\xff\xfe-not-utf8", b"new\nline", b"\x1b]0;pwned\x07"):
            r[repr(name)] = attempt(lambda name=name: open(own + b"/" + name, "w").write("x"))
        r["folder"] = attempt(lambda: os.mkdir(own + b"/\xff-dir"))
        r["link"] = attempt(lambda: os.symlink(b"\xfe-target", own + b"/link"))
        done(False, created=r)  # a host fault (a dead letter) is what fails the row
        """,
        caps=WRITE_OWN,
        stopped_by=frozenset({"E_COMMIT_CONFLICT"}),
    ),
    Attempt(
        "files.folders_nested_without_end",
        "files",
        "the commit refuses what it cannot walk",
        r"""
        os.chdir(OWN)
        for _ in range(1500):
            os.mkdir("d")
            os.chdir("d")
        with open("leaf", "w") as f:
            f.write("x")
        done(False)  # a host fault (a dead letter) is what fails the row
        """,
        caps=WRITE_OWN,
        stopped_by=frozenset({"E_COMMIT_CONFLICT"}),
    ),
    Attempt(
        "files.many_folders",
        "files",
        "the commit's open folders within the worker's fd limit",
        r"""
        # 1,500 folders with a file each: within the disk budget (the files are over the
        # size a commit keeps in memory, 64 KiB), and past the 1,024 open files a service
        # gets by default (the commit held an fd per folder, and one per larger file).
        for i in range(1500):
            os.mkdir(f"{OWN}/{i}")
            with open(f"{OWN}/{i}/f", "wb") as f:
                f.write(b"x" * (65 << 10))
        done(False)  # a failed commit, or a host fault, is what fails the row
        """,
        caps=WRITE_OWN,
        host_check=_all_committed("files_many_folders", 1500),
    ),
    Attempt(
        "files.setuid_chmod",
        "files",
        "seccomp (chmod family), commit strips bits (issue 8 #3)",
        r"""
        import shutil, stat
        py = OWN + "/py"
        shutil.copyfile(os.path.realpath(sys.executable), py)
        os.mkdir(OWN + "/d")
        r = {"chmod": attempt(lambda: os.chmod(py, 0o6755)),
             "fchmod": attempt(lambda: os.fchmod(os.open(py, os.O_RDONLY), 0o4755)),
             "fchmodat2": str(sc("fchmodat2", -100, py.encode(), 0o4755, 0)[1]),
             "setgid dir": attempt(lambda: os.chmod(OWN + "/d", 0o2775))}
        bits = os.stat(py).st_mode & (stat.S_ISUID | stat.S_ISGID)
        done(bits != 0, calls=r, mode=oct(os.stat(py).st_mode))
        """,
        caps=WRITE_OWN,
        host_check=_no_special_files("files_setuid_chmod"),
    ),
    Attempt(
        "files.file_capabilities",
        "files",
        "no CAP_SETFCAP; the commit carries content and mode, never xattrs",
        r"""
        import shutil
        py = OWN + "/py"
        shutil.copyfile(os.path.realpath(sys.executable), py)
        # VFS_CAP_REVISION_2, CAP_SETUID|CAP_DAC_OVERRIDE permitted+effective
        cap = struct.pack("<IIIII", 0x02000001, (1 << 7) | (1 << 1), 0, 0, 0)
        r = {"security.capability": attempt(lambda: os.setxattr(py, "security.capability", cap)),
             "trusted.x": attempt(lambda: os.setxattr(py, "trusted.x", b"1")),
             "user.x": attempt(lambda: os.setxattr(py, "user.x", b"1"))}
        done(r["security.capability"] == "ok", calls=r)
        """,
        caps=WRITE_OWN,
        host_check=_no_capabilities("files_file_capabilities"),
    ),
    Attempt(
        "files.capability_tool_made_executable",
        "files",
        "the commit refuses to widen the exec bits of a file with capabilities",
        r"""
        # A root-only tool with file capabilities in the folder (0700, cap_setuid): the
        # job owns root's files here, so it may chmod it; the commit applied the mode to
        # the host's inode, capabilities and all, for every local user to run.
        r = attempt(lambda: os.chmod(OWN + "/tool", 0o755))
        done(False, chmod=r)  # what reaches the host is what counts
        """,
        caps=WRITE_OWN,
        setup=_capability_tool,
        needs_root=True,
        stopped_by=frozenset({"E_COMMIT_CONFLICT"}),
        host_check=_tool_not_exposed("files_capability_tool_made_executable"),
    ),
    Attempt(
        "files.setuid_by_create_mode",
        "files",
        "commit strips setuid/setgid bits",
        r"""
        def create():
            fd = os.open(OWN + "/suid", os.O_CREAT | os.O_WRONLY, 0o6755)
            os.write(fd, b"#!/bin/sh\nid\n"); os.close(fd)
        r = {"open 6755": attempt(create),
             "mkdir 2775": attempt(lambda: os.mkdir(OWN + "/sgid", 0o2775)),
             "mknod 4755": attempt(lambda: os.mknod(OWN + "/n", 0o104755))}
        done(False, calls=r)  # what reaches the host is what counts
        """,
        caps=WRITE_OWN,
        host_check=_no_special_files("files_setuid_by_create_mode"),
    ),
    Attempt(
        "files.device_nodes",
        "files",
        "no CAP_MKNOD, commit skips special files",
        r"""
        import stat
        r = {"chr": attempt(lambda: os.mknod(OWN + "/mem", stat.S_IFCHR | 0o666, os.makedev(1, 1))),
             "blk": attempt(lambda: os.mknod(OWN + "/sda", stat.S_IFBLK | 0o666, os.makedev(8, 0))),
             "fifo": attempt(lambda: os.mkfifo(OWN + "/fifo"))}
        done(r["chr"] == "ok" or r["blk"] == "ok", nodes=r)
        """,
        caps=WRITE_OWN,
        host_check=_no_special_files("files_device_nodes"),
    ),
    Attempt(
        "files.disk_budget",
        "files",
        "staging tmpfs sized to disk_mb (issue 8 #6)",
        r"""
        wrote = 0
        try:
            for i in range(40):  # 80 MiB in files under the per-file limit
                with open(OWN + "/f%d" % i, "wb") as f:
                    f.write(b"\1" * (2 << 20))
                wrote += 2
        except OSError as e:
            err = en(e)
        else:
            err = None
        done(wrote > 16, wrote_mib=wrote, error=err)
        """,
        caps=WRITE_OWN,
        limits={"disk_mb": 16, "file_size_mb": 4},
        host_check=_disk_within("files_disk_budget", 16),
    ),
    Attempt(
        "files.open_by_handle",
        "files",
        "no CAP_DAC_READ_SEARCH (shocker), seccomp",
        r"""
        buf = ctypes.create_string_buffer(8 + 128)
        struct.pack_into("I", buf, 0, 128)
        mount_id = ctypes.c_int()
        r1 = sc("name_to_handle_at", -100, b"/etc/passwd", buf, ctypes.byref(mount_id), 0)
        fd = os.open("/etc", os.O_RDONLY)
        r2 = sc("open_by_handle_at", fd, buf, 0)
        done(r2[0] >= 0, name_to_handle=r1[1], open_by_handle=r2[1])
        """,
    ),
    Attempt(
        "files.chroot_breakout",
        "files",
        "no CAP_SYS_CHROOT in the guest",
        r"""
        os.makedirs("/tmp/jail", exist_ok=True)
        r = attempt(lambda: os.chroot("/tmp/jail"))
        if r == "ok":
            for _ in range(64):
                os.chdir("..")
            os.chroot(".")
        done(os.path.exists(HOME + "/secret/x"), chroot=r)
        """,
    ),
    Attempt(
        "files.mount_over_the_view",
        "files",
        "seccomp (mount family), no CAP_SYS_ADMIN",
        r"""
        r = {"mount tmpfs": sc("mount", b"none", b"/usr", b"tmpfs", 0, None),
             "bind": sc("mount", b"/", b"/tmp", None, 4096, None),
             "umount": sc("umount2", b"/usr", 2),
             "fsopen": sc("fsopen", b"tmpfs", 0),
             "open_tree": sc("open_tree", -100, b"/", 1)}
        done(any(v[0] >= 0 for v in r.values()), calls={k: v[1] for k, v in r.items()})
        """,
    ),
    Attempt(
        "files.kernel_info_masked",
        "files",
        "masked /proc files, /sys left out",
        r"""
        def content(p):
            with open(p, "rb") as f:
                if f.read(64) == b"":
                    raise OSError(errno.ENODATA, "empty (masked)")
        r = {p: attempt(lambda p=p: content(p)) for p in
             ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug",
              "/sys/kernel/notes", "/sys/fs/cgroup/cgroup.procs")}
        r["/sys"] = "ok" if os.path.exists("/sys/kernel") else "absent"
        done(any(v == "ok" for v in r.values()), reads=r)
        """,
    ),
    Attempt(
        "files.host_devices",
        "files",
        "minimal private /dev (no host device nodes)",
        r"""
        devs = ["/dev/mem", "/dev/kmem", "/dev/port", "/dev/kmsg", "/dev/sda", "/dev/vda",
                "/dev/nvme0n1", "/dev/tty0", "/dev/console", "/dev/fuse", "/dev/kvm",
                "/dev/net/tun", "/dev/loop-control", "/dev/dri/card0", "/dev/input/event0"]
        r = {d: attempt(lambda d=d: os.close(os.open(d, os.O_RDONLY))) for d in devs}
        done(any(v == "ok" for v in r.values()), opens=r, dev=sorted(os.listdir("/dev")))
        """,
    ),
    Attempt(
        "files.provider_tokens_of_skills",
        "files",
        "only a bound skill's folder is mounted",
        r"""
        tok = HOME + "/.metnos/skills/mail/token"
        done(attempt(lambda: open(tok).read()) == "ok")
        """,
        caps=READ_NOTES,
        setup=_skill_token,
    ),
    Attempt(
        "files.state_dir_through_hint",
        "files",
        "worker state outside every hint (walls b)",
        r"""
        r = attempt(lambda: open(CTX["state"] + "/planted", "w").write("x"))
        done(False, write=r)  # the host's state folder is what counts
        """,
        caps=(("fs:write", ("~/.metnos/state/**",)),),
        stopped_by=frozenset({"E_CAPABILITY_DENIED"}),
        host_check=_state_untouched,
    ),
    Attempt(
        "files.later_executor_rewritten.plant",
        "files",
        "helper (walls b): rewrites the victim",
        r"""
        victim = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "files_later_executor_rewritten")
        r = attempt(lambda: open(victim + "/main.py", "w").write(
            "import json\nprint(json.dumps({'escaped': True, 'rewritten': True}))\n"))
        done(False, rewrite=r)
        """,
        caps=(("fs:write", ("~/.metnos/**",)),),
    ),
    Attempt(
        "files.later_executor_rewritten",
        "files",
        "executors root outside every writable hint (walls b)",
        r"""
        done(False, ran="the original code")
        """,
        phase=2,
        host_check=_executor_unchanged("files_later_executor_rewritten"),
    ),
    Attempt(
        "files.executor_folder_swapped.plant",
        "files",
        "helper (walls a): victim's folder -> a link",
        r"""
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        victim = os.path.join(root, "files_executor_folder_swapped")
        evil = HOME + "/.metnos/evil"
        r = {}
        try:
            os.makedirs(evil)
            with open(os.path.join(victim, "manifest.toml")) as f:
                manifest = f.read()
            with open(evil + "/manifest.toml", "w") as f:
                f.write(manifest)
            with open(evil + "/main.py", "w") as f:
                f.write("import json\nprint(json.dumps({'escaped': True, 'rewritten': True}))\n")
            import shutil
            shutil.rmtree(victim)  # (a rename of a folder is EXDEV on the overlay)
            os.symlink(evil, victim)
            r["swap"] = "ok"
        except OSError as e:
            r["swap"] = en(e)
        done(False, **r)
        """,
        caps=(("fs:write", ("~/.metnos/**",)),),
    ),
    Attempt(
        "files.executor_folder_swapped",
        "files",
        "executor folder opened without links (walls a)",
        r"""
        done(False, ran="the original code")
        """,
        phase=2,
        host_check=_executor_unchanged("files_executor_folder_swapped"),
        stopped_by=frozenset({"E_SYMLINKED_FOLDER", "E_UNKNOWN_EXECUTOR", "E_BAD_MANIFEST"}),
    ),
]

HOST = [
    Attempt(
        "host.core_pattern",
        "files",
        "/proc/sys read-only, slot uid (issue 8 #1)",
        r"""
        r = attempt(lambda: os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY)))
        done(r == "ok", open_for_write=r)
        """,
        host_check=_core_pattern_unchanged,
    ),
    Attempt(
        "host.sysctls",
        "files",
        "/proc/sys read-only, /proc/sysrq-trigger masked (issue 8 #1)",
        r"""
        paths = ["/proc/sys/kernel/modprobe", "/proc/sys/vm/drop_caches", "/proc/sys/fs/file-max",
                 "/proc/sys/kernel/panic", "/proc/sysrq-trigger", "/proc/sys/kernel/hostname"]
        r = {p: attempt(lambda p=p: os.close(os.open(p, os.O_WRONLY))) for p in paths}
        done(any(v == "ok" for v in r.values()), open_for_write=r)
        """,
    ),
    Attempt(
        "host.sethostname",
        "user",
        "own UTS namespace, no CAP_SYS_ADMIN",
        r"""
        r = sc("sethostname", b"pwned", 5)
        done(False, sethostname=r[1])  # the host's name is what counts
        """,
        host_check=_hostname_unchanged,
    ),
    Attempt(
        "host.kernel_modules_and_kexec",
        "user",
        "seccomp (spec list), no capabilities",
        r"""
        import time
        now = time.time()
        empty = ctypes.create_string_buffer(16)
        r = {"init_module": sc("init_module", empty, 16, b""),
             "finit_module": sc("finit_module", 0, b"", 0),
             "delete_module": sc("delete_module", b"loop", 0),
             "kexec_load": sc("kexec_load", 0, 0, None, 0),
             "kexec_file_load": sc("kexec_file_load", -1, -1, 0, b"", 4),
             "reboot": sc("reboot", 0xfee1dead, 0x28121969, 0, None),  # CAD_OFF: harmless
             "swapon": sc("swapon", b"/tmp/none", 0),
             "acct": sc("acct", None),
             "syslog": sc("syslog", 3, ctypes.create_string_buffer(64), 64),
             "iopl": sc("iopl", 3),
             "quotactl": sc("quotactl", 0x800001, b"/", 0, None),
             # the host's clock, set to what it is (harmless even if it were allowed)
             "settimeofday": sc("settimeofday", struct.pack("qq", int(now), 0), None)}
        done(any(v[0] >= 0 for v in r.values()), calls={k: v[1] for k, v in r.items()})
        """,
    ),
]

NETWORK = [
    Attempt(
        "network.tcp_to_host_loopback",
        "network",
        "own network namespace (--unshare-net)",
        r"""
        r = {}
        for port in (CTX["port"], 6379):  # a listener of the harness; Redis's usual port
            s = socket.socket()
            s.settimeout(2)
            r[port] = attempt(lambda s=s, port=port: s.connect(("127.0.0.1", port)))
        done(any(v == "ok" for v in r.values()), connect=r)
        """,
        setup=_tcp,
        host_check=_no_connection("tcp"),
    ),
    Attempt(
        "network.no_route_out",
        "network",
        "own network namespace (--unshare-net)",
        r"""
        # The host's listeners on loopback addresses other than the one the row above
        # tries (127.0.0.2 and ::1 over TCP, 127.0.0.3 over UDP): a job without the
        # network reaches none of them, as it reaches no other host. A UDP send "works"
        # into the job's own loopback: what the host received is what counts.
        r = {}
        for key, family, host in (("tcp 127.0.0.2", socket.AF_INET, "127.0.0.2"),
                                  ("tcp [::1]", socket.AF_INET6, "::1")):
            s = socket.socket(family); s.settimeout(2)
            r[key] = attempt(lambda s=s, host=host, key=key:
                             s.connect((host, CTX["outside"][key])))
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp = ("127.0.0.3", CTX["outside"]["udp 127.0.0.3"])
        r["udp 127.0.0.3"] = attempt(lambda: u.sendto(b"\0" * 12, udp))
        r["interfaces"] = [n for _, n in socket.if_nameindex()]
        done(r["tcp 127.0.0.2"] == "ok" or r["tcp [::1]"] == "ok" or r["interfaces"] != ["lo"], **r)
        """,
        setup=_outside_listeners,
        host_check=_nothing_reached_outside,
    ),
    Attempt(
        "network.abstract_unix_socket",
        "network",
        "own network namespace; seccomp (AF_UNIX)",
        r"""
        def connect():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0metnos-adv-" + CTX["token"])
        r = attempt(connect)
        done(r == "ok", connect=r)
        """,
        setup=_abstract_socket,
        host_check=_no_connection("abstract"),
    ),
    Attempt(
        "network.host_unix_socket_in_mount",
        "network",
        "seccomp (AF_UNIX), landlock (issue 8 #5)",
        r"""
        def connect():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(HOME + "/sockdir/agent.sock")
        r = attempt(connect)
        done(r == "ok", connect=r)
        """,
        caps=(("fs:read", ("~/sockdir/**",)),),
        setup=_host_socket,
        host_check=_no_connection("mounted"),
    ),
    Attempt(
        "network.netlink_and_raw",
        "network",
        "own network namespace, no CAP_NET_RAW/ADMIN",
        r"""
        def raw(family, kind, proto):
            socket.socket(family, kind, proto).close()
        r = {"packet": attempt(lambda: raw(socket.AF_PACKET, socket.SOCK_RAW, 0)),
             "icmp raw": attempt(lambda: raw(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
             "netlink route": attempt(lambda: raw(socket.AF_NETLINK, socket.SOCK_RAW, 0))}
        # netlink itself is the namespace's own; what it shows is what counts
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        import fcntl
        up = attempt(lambda: fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", 1)))
        done(r["packet"] == "ok" or r["icmp raw"] == "ok" or up == "ok"
             or [n for _, n in socket.if_nameindex()] != ["lo"], calls=r, lo_up=up)
        """,
    ),
    Attempt(
        "network.granted_names_only",
        "network",
        "the network wall: a hint naming localhost:80 opens no other loopback port",
        r"""
        s = socket.socket(); s.settimeout(2)
        r = attempt(lambda: s.connect(("127.0.0.1", CTX["granted_port"])))
        done(r == "ok", connect=r)
        """,
        caps=(("network:http", ("localhost",)),),
        setup=_granted_tcp,
        host_check=_no_connection("granted"),
    ),
]

# The network wall (issue 17): a job whose manifest names 127.0.0.1:<wall_port> (a host
# listener) and localhost (port 80) tries every other way out. Targets are loopback only;
# names are the worker's /etc/hosts (localhost) or refused before any lookup.
WALL_CAPS = (("network:http", ("127.0.0.1:{ctx:wall_port}", "localhost")),)
WALL_HELPERS = r"""
import os, subprocess
def proxy_port(var):
    return int(os.environ[var].rsplit(":", 1)[1])
def via_connect(host, port, then=b""):
    s = socket.create_connection(("127.0.0.1", proxy_port("HTTP_PROXY")), 3)
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n".encode())
    head = s.recv(4096)
    if not head.startswith(b"HTTP/1.1 200"):
        s.close()
        raise PermissionError(head[:80])
    if then:
        s.sendall(then)
        s.settimeout(3)
        head = s.recv(4096)
        s.close()
        if not head.startswith(b"HTTP/1.1 200"):
            raise PermissionError(b"inner: " + head[:80])
    s.close()
def via_socks(host, port):
    s = socket.create_connection(("127.0.0.1", proxy_port("ALL_PROXY")), 3)
    s.sendall(b"\x05\x01\x00"); s.recv(2)
    name = host.encode()
    s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", port))
    reply = s.recv(10); s.close()
    if reply[1:2] != b"\x00":
        raise PermissionError(f"socks reply {reply[1:2]!r}")
def via_get(host, port):
    s = socket.create_connection(("127.0.0.1", proxy_port("HTTP_PROXY")), 3)
    s.sendall(f"GET http://{host}:{port}/ HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    s.settimeout(3)
    head = s.recv(4096); s.close()
    if head.startswith(b"HTTP/1.1 403") or not head:
        raise PermissionError(head[:80])
def direct(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family); s.settimeout(3)
    try:
        s.connect((host, port))
    finally:
        s.close()
def run(argv):
    p = subprocess.run(argv, capture_output=True, timeout=20)
    if p.returncode:
        raise ConnectionError(p.returncode)
SECRET, OK = CTX["wall_secret"], CTX["wall_port"]
"""

EGRESS = [
    Attempt(
        "network.wall_raw_sockets",
        "network",
        "network wall: own network namespace, listeners only for what the manifest names",
        WALL_HELPERS
        + r"""
r = {"secret": attempt(lambda: direct("127.0.0.1", SECRET)),
     "redis 6379": attempt(lambda: direct("127.0.0.1", 6379)),
     "another loopback address": attempt(lambda: direct("127.0.0.2", OK)),
     "ipv6 loopback": attempt(lambda: direct("::1", OK)),
     "the proxy's port elsewhere": attempt(lambda: direct("127.0.0.3", proxy_port("HTTP_PROXY")))}
r["allowed (control)"] = attempt(lambda: direct("127.0.0.1", OK))
done(any(v == "ok" for k, v in r.items() if k != "allowed (control)"), connect=r)
""",
        caps=WALL_CAPS,
        setup=_wall,
        host_check=_no_connection("wall_secret"),
    ),
    Attempt(
        "network.wall_proxies_refuse_other_targets",
        "network",
        "network wall: one decision point for CONNECT, absolute-form and SOCKS5",
        WALL_HELPERS
        + r"""
r = {}
for name, fn in (("connect", via_connect), ("socks", via_socks), ("get", via_get)):
    for port in (SECRET, 6379):
        r[f"{name} 127.0.0.1:{port}"] = attempt(lambda fn=fn, port=port: fn("127.0.0.1", port))
    r[f"{name} 127.0.0.2:{OK}"] = attempt(lambda fn=fn: fn("127.0.0.2", OK))
    v6 = "::1" if fn is via_socks else "[::1]"
    r[f"{name} {v6}:{OK}"] = attempt(lambda fn=fn, v6=v6: fn(v6, OK))
done(any(v == "ok" for v in r.values()), tried=r)
""",
        caps=WALL_CAPS,
        setup=_wall,
        host_check=_no_connection("wall_secret"),
    ),
    Attempt(
        "network.wall_tools",
        "network",
        "network wall: curl, wget, bash /dev/tcp, --noproxy",
        WALL_HELPERS
        + r"""
url = f"http://127.0.0.1:{SECRET}/"
tcp = f"exec 3<>/dev/tcp/127.0.0.1/{SECRET}"
r = {"bash /dev/tcp": attempt(lambda: run(["/bin/bash", "-c", tcp]))}
if os.path.exists("/usr/bin/curl"):
    r["curl"] = attempt(lambda: run(["/usr/bin/curl", "-sf", "--max-time", "5", url]))
    r["curl --noproxy"] = attempt(
        lambda: run(["/usr/bin/curl", "-sf", "--noproxy", "*", "--max-time", "5", url]))
if os.path.exists("/usr/bin/wget"):
    r["wget"] = attempt(lambda: run(["/usr/bin/wget", "-q", "-O-", "-T", "5", "-t", "1", url]))
done(any(v == "ok" for v in r.values()), tried=r)
""",
        caps=WALL_CAPS,
        setup=_wall,
        host_check=_no_connection("wall_secret"),
    ),
    Attempt(
        "network.wall_names",
        "network",
        "network wall: names resolved and checked by the worker, an allow-listed DNS stub",
        WALL_HELPERS
        + r"""
def udp_53(address):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(1)
    q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x09localhost\x00\x00\x01\x00\x01"
    u.sendto(q, (address, 53)); u.recvfrom(512)
r = {
    # allowed by name, but it resolves to 127.0.0.1, which the hint does not name
    "connect localhost:80": attempt(lambda: via_connect("localhost", 80)),
    "socks localhost:80": attempt(lambda: via_socks("localhost", 80)),
    "look-alike": attempt(lambda: via_connect("localhost.evil.example", 80)),
    "getent other name": attempt(lambda: run(["getent", "hosts", "evil.example.org"])),
    "udp 127.0.0.2:53": attempt(lambda: udp_53("127.0.0.2")),
}
done(any(v == "ok" for v in r.values()), tried=r)
""",
        caps=WALL_CAPS,
        setup=_wall,
        host_check=_no_connection("wall_secret"),
    ),
    Attempt(
        "network.wall_relayed_connect",
        "network",
        "network wall: a tunnel goes to the allowed host only, a CONNECT inside is its bytes",
        WALL_HELPERS
        + r"""
inner = f"CONNECT 127.0.0.1:{SECRET} HTTP/1.1\r\n\r\n".encode()
r = {"connect in connect": attempt(lambda: via_connect("127.0.0.1", OK, then=inner))}
done(r["connect in connect"] == "ok", tried=r)
""",
        caps=WALL_CAPS,
        setup=_wall,
        host_check=_no_connection("wall_secret"),
    ),
]

PROCESS = [
    Attempt(
        "process_tree.ptrace_and_vm_writev",
        "process_tree",
        "seccomp (ptrace, process_vm_*), pid namespace",
        r"""
        buf = ctypes.create_string_buffer(8)
        iov = struct.pack("PN", ctypes.addressof(buf), 8)
        liov = ctypes.create_string_buffer(iov)
        r = {}
        for pid in (1, CTX["worker_pid"], os.getppid()):
            r[f"attach {pid}"] = sc("ptrace", 16, pid, 0, 0)  # PTRACE_ATTACH
            r[f"seize {pid}"] = sc("ptrace", 0x4206, pid, 0, 0)
            r[f"vm_writev {pid}"] = sc("process_vm_writev", pid, liov, 1, liov, 1, 0)
            r[f"vm_readv {pid}"] = sc("process_vm_readv", pid, liov, 1, liov, 1, 0)
        done(any(v[0] >= 0 for v in r.values()), calls={k: v[1] for k, v in r.items()})
        """,
    ),
    Attempt(
        "process_tree.proc_1_mem",
        "process_tree",
        "landlock (scoped ptrace), seccomp (walls e)",
        r"""
        r = {"mem": attempt(lambda: os.close(os.open("/proc/1/mem", os.O_RDWR))),
             "environ": attempt(lambda: open("/proc/1/environ", "rb").read()),
             "root": attempt(lambda: os.listdir("/proc/1/root/proc/1/root")),
             "worker": attempt(lambda: os.close(
                 os.open(f"/proc/{CTX['worker_pid']}/mem", os.O_RDWR)))}
        done(r["mem"] == "ok" or r["worker"] == "ok", opens=r)
        """,
    ),
    Attempt(
        "process_tree.kill_host_processes",
        "process_tree",
        "pid namespace, slot uid",
        r"""
        import signal
        r = {}
        for name, pid in (("canary", CTX["canary_pid"]), ("worker", CTX["worker_pid"]),
                          ("pytest", CTX["pytest_pid"])):
            r[name] = attempt(lambda pid=pid: os.kill(pid, 0))
        r["kill -1"] = attempt(lambda: os.kill(-1, signal.SIGKILL))
        r["canary SIGKILL"] = attempt(lambda: os.kill(CTX["canary_pid"], signal.SIGKILL))
        done(False, signals=r)  # the canary and the worker are what counts
        """,
        host_check=_canary_alive,
    ),
    Attempt(
        "process_tree.forged_host_fault",
        "process_tree",
        "seccomp (pidfd_getfd), landlock (issue 8 #8)",
        r"""
        import time
        # The issue's way first: bubblewrap's init's status eventfd through /proc/1/fd/N.
        for n in range(3, 8):
            try:
                fd = os.open(f"/proc/1/fd/{n}", os.O_WRONLY)
            except OSError:
                continue
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]":
                print(json.dumps({"escaped": True, "forged": "/proc/1/fd"}), flush=True)
                os.write(fd, struct.pack("Q", 5000))
                time.sleep(5)
            os.close(fd)
        try:
            init = os.pidfd_open(1)
            for event in (3, 4, 5):
                fd = sc("pidfd_getfd", init, event, 0)[0]
                if fd >= 0 and os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]":
                    break
            else:
                raise OSError(ctypes.get_errno(), "no eventfd reached")
        except OSError as exc:
            done(False, error=en(exc))
        print(json.dumps({"escaped": True, "forged": True}), flush=True)
        os.write(fd, struct.pack("Q", 5000))
        time.sleep(5)
        """,
        stopped_by=frozenset({"E_TRAP"}),
    ),
    Attempt(
        "process_tree.new_namespaces",
        "process_tree",
        "seccomp (unshare, clone3), userns disabled",
        r"""
        CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x20000
        CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
        r = {"unshare user": sc("unshare", CLONE_NEWUSER),
             "unshare mnt+pid+net": sc("unshare", CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET)}
        pid = os.fork()
        if pid == 0:
            os._exit(0 if libc.unshare(CLONE_NEWUSER) == 0 else 1)
        _, status = os.waitpid(pid, 0)
        r["child unshare user"] = (0 if os.waitstatus_to_exitcode(status) == 0 else -1, None)
        # clone(2) itself with CLONE_NEWUSER (what a filter on unshare alone would miss)
        libc.syscall.argtypes = None
        got = libc.syscall(56 if os.uname().machine == "x86_64" else 220,
                           ctypes.c_long(CLONE_NEWUSER | 17), 0, 0, 0, 0)
        if got == 0:
            os._exit(0)
        if got > 0:
            os.waitpid(got, 0)
        r["clone NEWUSER"] = (got, None if got >= 0 else errno.errorcode.get(ctypes.get_errno()))
        done(any(v[0] >= 0 for v in r.values()), calls={k: v[1] for k, v in r.items()})
        """,
    ),
    Attempt(
        "process_tree.setns_into_init",
        "process_tree",
        "seccomp (setns), no capabilities",
        r"""
        r = {}
        for ns in ("mnt", "net", "pid", "user", "uts", "ipc"):
            try:
                fd = os.open(f"/proc/1/ns/{ns}", os.O_RDONLY)
            except OSError as e:
                r[ns] = (-1, en(e)); continue
            r[ns] = sc("setns", fd, 0)
        done(any(v[0] >= 0 for v in r.values()), calls={k: v[1] for k, v in r.items()})
        """,
    ),
    Attempt(
        "process_tree.pivot_root",
        "process_tree",
        "seccomp (pivot_root), no CAP_SYS_ADMIN",
        r"""
        os.makedirs("/tmp/new/old", exist_ok=True)
        r = sc("pivot_root", b"/tmp/new", b"/tmp/new/old")
        done(r[0] >= 0, pivot_root=r[1])
        """,
    ),
    Attempt(
        "process_tree.host_ipc_objects",
        "process_tree",
        "own IPC namespace, private /dev/shm",
        r"""
        libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
        got = libc.shmget(CTX["shm_key"], 0, 0)
        posix = os.path.exists(f"/dev/shm/metnos-adv-{CTX['token']}")
        r = {"shmget": errno.errorcode.get(ctypes.get_errno()) if got < 0 else "ok",
             "posix shm": "ok" if posix else "absent"}
        done(any(v == "ok" for v in r.values()), **r)
        """,
        setup=_host_ipc,
    ),
    Attempt(
        "process_tree.inherited_fds",
        "process_tree",
        "close-on-exec everywhere: only the job's own pipes reach it",
        r"""
        import fcntl
        got = {}
        for n in os.listdir("/proc/self/fd"):
            try:
                got[n] = os.readlink(f"/proc/self/fd/{n}")
            except OSError:
                pass  # the listing's own fd
        extra = {n: t for n, t in got.items() if n not in ("0", "1", "2")}
        # The documented progress channel (METNOS_PROGRESS_FD) is the job's own pipe too,
        # but only as the write end of a pipe: anything else under that number got through.
        pfd = os.environ.get("METNOS_PROGRESS_FD")
        if pfd in extra and extra[pfd].startswith("pipe:"):
            if fcntl.fcntl(int(pfd), fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
                del extra[pfd]
        stdio = [got.get(n, "") for n in ("0", "1", "2")]
        done(bool(extra) or not all(t.startswith("pipe:") for t in stdio), fds=got)
        """,
    ),
    Attempt(
        "process_tree.orphan_survives_the_job",
        "process_tree",
        "pid namespace killed with its init",
        r"""
        import subprocess
        subprocess.Popen(["sh", "-c", f"exec -a sleep-{CTX['token']}-orphan sleep 300"],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp("sh", ["sh", "-c", f"exec -a sleep-{CTX['token']}-orphan sleep 300"])
            os._exit(0)
        os.waitpid(pid, 0)
        # (the double-forked one keeps stdout and stderr open: the job still ends now,
        # not at its 20 s budget, and its output is this line)
        done(False)  # what survives on the host is what counts
        """,
        host_check=_no_processes("orphan"),
        limits={"timeout_s": 20},
    ),
    Attempt(
        "process_tree.timeout_kills_the_tree",
        "process_tree",
        "wall-time budget, tree killed",
        r"""
        import subprocess, time
        for _ in range(3):
            tree = f"trap '' TERM HUP INT; exec -a sleep-{CTX['token']}-tree sleep 300"
            subprocess.Popen(["sh", "-c", tree], start_new_session=True)
        time.sleep(300)
        """,
        limits={"timeout_s": 2},
        stopped_by=frozenset({"E_TIMEOUT"}),
        host_check=_no_processes("tree"),
    ),
    Attempt(
        "process_tree.tiocsti",
        "process_tree",
        "--new-session, no controlling terminal",
        r"""
        import fcntl, termios
        r = {"/dev/tty": attempt(lambda: os.open("/dev/tty", os.O_RDWR))}
        for fd in (0, 1, 2):
            r[fd] = attempt(lambda fd=fd: fcntl.ioctl(fd, termios.TIOCSTI, b"x"))
        done(any(v == "ok" for v in r.values()), ioctl=r)
        """,
    ),
    Attempt(
        "process_tree.deep_json_output",
        "process_tree",
        "the worker's output parser (issue 8 #10)",
        r"""
        sys.stdout.write("[" * 400000 + "]" * 400000)
        """,
        stopped_by=frozenset({"E_BAD_OUTPUT"}),
    ),
    Attempt(
        "process_tree.output_flood",
        "process_tree",
        "capped stdout and stderr",
        r"""
        chunk = b"A" * (1 << 20)
        for _ in range(64):
            os.write(2, chunk)
        for _ in range(64):
            os.write(1, chunk)
        """,
        limits={"output_kb": 64},
        stopped_by=frozenset({"E_BAD_OUTPUT"}),
    ),
    Attempt(
        "process_tree.huge_result",
        "process_tree",
        "capped output; the result always stored",
        r"""
        sys.stderr.write("E" * (4 << 20))
        print(json.dumps({"escaped": False, "pad": "x" * ((1 << 20) - 64)}))
        """,
        stopped_by=frozenset({"E_BAD_OUTPUT"}),
    ),
    Attempt(
        "process_tree.terminal_escapes",
        "process_tree",
        "terminal-safe rendering (issue 8 #9)",
        r"""
        sys.stderr.write("\x1b]0;pwned\x07\x1b[2J\x1b[H\rpwned\x1b[31m\x9b31m\x08\x7f\n")
        # A fifo is not committed, and the log says which: its name reaches `tail`.
        os.mkfifo(OWN + "/\x1b]0;pwned\x07\x1b[2J\r")
        done(False, note="\x1b]0;pwned\x07\r")
        """,
        caps=WRITE_OWN,
        host_check=_result_renders_safely,
    ),
]

USER = [
    Attempt(
        "user.keyrings",
        "user",
        "seccomp (keyctl, add_key, request_key) (issue 8 #4)",
        r"""
        buf = ctypes.create_string_buffer(256)
        r = {"session id": sc("keyctl", 0, -3, 0),        # KEYCTL_GET_KEYRING_ID
             "read user keyring": sc("keyctl", 11, -4, buf, 256),  # KEYCTL_READ
             "join session": sc("keyctl", 1, None)}
        r["add_key"] = sc("add_key", b"user", ("adv-" + CTX["token"]).encode(), b"p", 1, -4)
        done(any(v[0] >= 0 for v in r.values()), calls={k: v[1] for k, v in r.items()})
        """,
    ),
    Attempt(
        "user.keyring_shared_between_jobs",
        "user",
        "seccomp (request_key, keyctl) (issue 8 #4)",
        r"""
        r = {"request_key": sc("request_key", b"user", ("adv-" + CTX["token"]).encode(), None, 0),
             "search": sc("keyctl", 10, -4, b"user", ("adv-" + CTX["token"]).encode(), 0)}
        done(any(v[0] >= 0 for v in r.values()), calls={k: v[1] for k, v in r.items()})
        """,
        phase=2,
    ),
    Attempt(
        "user.capabilities_and_setuid",
        "user",
        "uid 65534 without capabilities, no_new_privs",
        r"""
        status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines()
                      if ":\t" in l)
        caps = {k: status[k].strip() for k in ("CapEff", "CapPrm", "CapAmb")}
        r = {"setuid(0)": sc("setuid", 0)[1], "NoNewPrivs": status["NoNewPrivs"].strip(),
             "Seccomp": status["Seccomp"].strip()}
        # The system trees hold setuid-root programs (su, mount, passwd): without
        # no_new_privs (or nosuid) one exec would give the job root's euid.
        import stat
        setuid = [p for p in ("/usr/bin/su", "/usr/bin/mount", "/usr/bin/passwd", "/bin/su")
                  if os.path.exists(p) and os.stat(p).st_mode & stat.S_ISUID]
        done(any(int(v, 16) for v in caps.values()) or r["setuid(0)"] is None
             or (setuid and r["NoNewPrivs"] != "1"), caps=caps, setuid_programs=setuid, **r)
        """,
    ),
    Attempt(
        "user.root_only_system_file",
        "user",
        "slot uid for a root worker (not host root)",
        r"""
        r = attempt(lambda: open(f"/usr/local/share/metnos-adv-{CTX['token']}").read())
        done(r == "ok", read=r)
        """,
        setup=_root_only_system_file,
        through="root",
        reason="as host root",
    ),
    Attempt(
        "user.env_secrets",
        "user",
        "clean environment (allow-list)",
        r"""
        seen = dict(os.environ)
        r = {}
        for p in ("/proc/self/environ", "/proc/1/environ", f"/proc/{os.getppid()}/environ"):
            try:
                seen[p] = open(p, "rb").read().decode(errors="replace")
            except OSError as e:
                r[p] = en(e)
        blob = json.dumps(seen)
        done(CTX["token"] in blob.replace(json.dumps(CTX), ""), names=sorted(os.environ), errors=r)
        """,
    ),
    Attempt(
        "user.perf_event_open",
        "user",
        "seccomp (perf_event_open)",
        r"""
        attr = ctypes.create_string_buffer(128)
        struct.pack_into("IIQQ", attr, 0, 1, 128, 0, 0)  # PERF_TYPE_SOFTWARE, cpu-clock
        r = sc("perf_event_open", attr, 0, -1, -1, 0)
        done(r[0] >= 0, perf_event_open=r[1])
        """,
    ),
    Attempt(
        "user.bpf",
        "user",
        "seccomp (bpf)",
        r"""
        attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 8, 1), 128)  # ARRAY map
        r = sc("bpf", 0, attr, 128)  # BPF_MAP_CREATE
        done(r[0] >= 0, bpf=r[1])
        """,
    ),
    Attempt(
        "user.userfaultfd",
        "user",
        "seccomp (userfaultfd)",
        r"""
        r = sc("userfaultfd", 0)
        dev = attempt(lambda: os.open("/dev/userfaultfd", os.O_RDWR))
        done(r[0] >= 0 or dev == "ok", userfaultfd=r[1], dev=dev)
        """,
    ),
    Attempt(
        "user.io_uring",
        "user",
        "seccomp (io_uring_setup) (issue 8 #11)",
        r"""
        params = ctypes.create_string_buffer(120)
        r = sc("io_uring_setup", 8, params)
        done(r[0] >= 0, io_uring_setup=r[1])
        """,
    ),
    Attempt(
        "user.kernel_surface_misc",
        "user",
        "seccomp (rarely needed, often exploited)",
        r"""
        r = {"fanotify_init": sc("fanotify_init", 0, 0),
             "lookup_dcookie": sc("lookup_dcookie", 0, None, 0),
             "personality READ_IMPLIES_EXEC": sc("personality", 0x0400000),
             "memfd_secret": sc("memfd_secret", 0)}
        got = {k: v[1] for k, v in r.items()}
        done(r["fanotify_init"][0] >= 0 or r["lookup_dcookie"][0] >= 0, calls=got)
        """,
    ),
]

RESOURCES = [
    Attempt(
        "resources.one_big_allocation",
        "resources",
        "RLIMIT_AS, memory cgroup",
        r"""
        try:
            b = bytearray(512 << 20)
            done(True, allocated_mib=512)
        except MemoryError:
            done(False, error="MemoryError")
        """,
        limits={"memory_mb": 64},
        stopped_by=frozenset({"E_MEMORY", "E_KILLED"}),
    ),
    Attempt(
        "resources.memory_across_processes",
        "resources",
        "memory cgroup (root); else partial",
        MEMORY_ACROSS_PROCESSES,
        limits={"memory_mb": 64},
        stopped_by=frozenset({"E_MEMORY", "E_KILLED"}),
        through="unprivileged",
        reason="no memory cgroup",
    ),
    Attempt(
        "resources.dev_shm_fill",
        "resources",
        "sized /dev/shm tmpfs (issue 8 #7)",
        r"""
        wrote = 0
        try:
            with open("/dev/shm/fill", "wb") as f:
                for _ in range(128):
                    f.write(b"\1" * (1 << 20)); f.flush(); wrote += 1
        except OSError as e:
            err = en(e)
        else:
            err = None
        done(wrote > 64, wrote_mib=wrote, error=err)
        """,
        limits={"memory_mb": 64, "file_size_mb": 256},
        stopped_by=frozenset({"E_MEMORY", "E_KILLED"}),
    ),
    Attempt(
        "resources.tmp_fill",
        "resources",
        "sized /tmp tmpfs",
        r"""
        wrote = 0
        try:
            with open("/tmp/fill", "wb") as f:
                for _ in range(128):
                    f.write(b"\1" * (1 << 20)); f.flush(); wrote += 1
        except OSError as e:
            err = en(e)
        else:
            err = None
        done(wrote > 64, wrote_mib=wrote, error=err)
        """,
        limits={"memory_mb": 64, "file_size_mb": 256},
        stopped_by=frozenset({"E_MEMORY", "E_KILLED"}),
    ),
    Attempt(
        "resources.tmpfs_file_count",
        "resources",
        "memory cgroup (kernel memory); else partial",
        r"""
        # Empty files cost no tmpfs block, only kernel memory (~1 KiB each: inode, dentry):
        # 120,000 of them are ~120 MiB against a 64 MiB budget.
        n, err = 0, None
        try:
            for i in range(120_000):
                os.close(os.open(f"/tmp/{i}", os.O_CREAT | os.O_WRONLY, 0o600))
                n += 1
        except OSError as e:
            err = en(e)
        done(n >= 120_000, files=n, error=err)
        """,
        limits={"memory_mb": 64},
        stopped_by=frozenset({"E_MEMORY", "E_KILLED"}),
        through="unprivileged",
        reason="number of files",
    ),
    Attempt(
        "resources.fork_bomb",
        "resources",
        "pids cgroup / RLIMIT_NPROC on the slot uid",
        r"""
        import time
        n, err = 0, None
        pids = []
        try:
            for _ in range(200):
                pid = os.fork()
                if pid == 0:
                    time.sleep(30); os._exit(0)
                pids.append(pid); n += 1
        except OSError as e:
            err = en(e)
        for pid in pids:
            os.kill(pid, 9); os.waitpid(pid, 0)
        done(n > 16, forked=n, error=err)
        """,
        limits={"pids": 16},
        stopped_by=frozenset({"E_KILLED"}),
        # Unprivileged there is no pids cgroup: RLIMIT_NPROC counts every process of the
        # worker's uid, set at the job's start to what runs plus the budget, so when the
        # worker's other jobs end meanwhile this one may fork a few more (seen: 19 of 16;
        # still refused, EAGAIN). The report says so; as root the slot uid's own holds.
        through="unprivileged",
        reason="counted per user",
    ),
    Attempt(
        "resources.raise_own_limits",
        "resources",
        "hard rlimits (soft = hard), no CAP_SYS_RESOURCE",
        r"""
        import resource
        r, over = {}, []
        # The manifest's limits (+1 s: RLIMIT_CPU's hard limit is the SIGKILL after SIGXCPU)
        bound = {"RLIMIT_AS": 128 << 20, "RLIMIT_FSIZE": 64 << 20, "RLIMIT_NOFILE": 256,
                 "RLIMIT_CPU": 6}
        for name in ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CPU"):
            which = getattr(resource, name)
            try:
                resource.setrlimit(which, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                r[name] = "raised to unlimited"
                over.append(name)
            except (OSError, ValueError):
                r[name] = "refused"
            hard = resource.getrlimit(which)[1]
            if name in bound and (hard == resource.RLIM_INFINITY or hard > bound[name]):
                over.append(f"{name} hard {hard}")
        # prlimit on bubblewrap's init (the same uid)
        r["prlimit init"] = attempt(lambda: resource.prlimit(
            1, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)))
        done(bool(over) or r["prlimit init"] == "ok", limits=r, over=over)
        """,
        limits={"memory_mb": 128, "cpu_s": 5, "pids": 32},
    ),
    Attempt(
        "resources.oom_score_adj",
        "resources",
        "no CAP_SYS_RESOURCE: cannot make itself unkillable",
        r"""
        r = attempt(lambda: open("/proc/self/oom_score_adj", "w").write("-1000"))
        done(r == "ok", write=r)
        """,
    ),
    Attempt(
        "resources.cpu_time",
        "resources",
        "RLIMIT_CPU (SIGXCPU)",
        r"""
        import time
        t = time.process_time()
        while time.process_time() - t < 8:
            pass
        done(True, cpu_s=time.process_time() - t)
        """,
        limits={"cpu_s": 1},
        stopped_by=frozenset({"E_KILLED"}),
    ),
    Attempt(
        "resources.file_size",
        "resources",
        "RLIMIT_FSIZE",
        r"""
        wrote, err = 0, None
        try:
            with open("/tmp/big", "wb") as f:
                for _ in range(4):
                    f.write(b"\1" * (1 << 20)); f.flush(); wrote += 1
        except OSError as e:
            err = en(e)
        done(wrote > 1, wrote_mib=wrote, error=err)
        """,
        limits={"file_size_mb": 1},
        stopped_by=frozenset({"E_KILLED"}),
    ),
    Attempt(
        "resources.commit_record_size",
        "resources",
        "the commit refuses a change set it cannot record in bounded memory",
        r"""
        # Empty files cost the staging tmpfs an inode each, but their names go into the
        # journal and the undo entry, held several times in the worker's memory: 4,000
        # files below 120 folders with 255-byte names are ~120 MB of paths (30,000 made a
        # 940 MB undo entry and took the worker from 38 MB to 3.7 GB).
        os.chdir(OWN)
        for i in range(120):
            os.mkdir(("D%03d" % i) + "d" * 251)
            os.chdir(("D%03d" % i) + "d" * 251)
        for i in range(4000):
            os.close(os.open(("%06d" % i) + "f" * 249, os.O_CREAT | os.O_WRONLY, 0o600))
        done(False)  # what the worker stored is what counts
        """,
        caps=WRITE_OWN,
        limits={"timeout_s": 60},
        stopped_by=frozenset({"E_COMMIT_CONFLICT"}),
        host_check=_queue_within(64),
    ),
    Attempt(
        "resources.sparse_files_past_the_disk_budget",
        "resources",
        "the commit refuses files larger in all than the disk budget",
        r"""
        # Holes cost the staging tmpfs nothing, but the commit copied every byte: 40
        # files of 64 MiB (the default file size limit) on a 256 MiB budget wrote 2.6 GB
        # on the host in 8 s (65,536 of them: 4 TiB).
        for i in range(10):
            with open(OWN + "/s%d" % i, "wb") as f:
                f.truncate((4 << 20) - 1)
        done(False)  # what reaches the host is what counts
        """,
        caps=WRITE_OWN,
        limits={"disk_mb": 16, "file_size_mb": 4},
        stopped_by=frozenset({"E_COMMIT_CONFLICT"}),
        host_check=_disk_within("resources_sparse_files_past_the_disk_budget", 16),
    ),
    Attempt(
        "resources.hard_links_past_the_disk_budget",
        "resources",
        "the commit refuses files larger in all than the disk budget",
        r"""
        # One 4 MiB file and 20 more names for it: 4 MiB staged, but the commit writes
        # each name as a file of its own.
        with open(OWN + "/f0", "wb") as f:
            f.write(b"" * (4 << 20))
        for i in range(1, 21):
            os.link(OWN + "/f0", OWN + "/f%d" % i)
        done(False)  # what reaches the host is what counts
        """,
        caps=WRITE_OWN,
        limits={"disk_mb": 16, "file_size_mb": 4},
        stopped_by=frozenset({"E_COMMIT_CONFLICT"}),
        host_check=_disk_within("resources_hard_links_past_the_disk_budget", 16),
    ),
    Attempt(
        "resources.open_files",
        "resources",
        "RLIMIT_NOFILE",
        r"""
        fds, err = [], None
        try:
            for _ in range(2000):
                fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as e:
            err = en(e)
        done(len(fds) > 64, opened=len(fds), error=err)
        """,
        limits={"open_files": 64},
    ),
]

#: What every exec row starts with: an ELF of the system (``true``) to copy, and the
#: ways to run a file: by fd (fexecve: execveat AT_EMPTY_PATH), by path, and through a
#: loader (``ld.so FILE``: the loader maps the file, nothing execs it). Each returns the
#: program's exit status (0: it ran), or 100 + errno when exec refused it.
EXEC_PREAMBLE = r"""
        import glob, shutil, subprocess
        TRUE = os.path.realpath(shutil.which("true"))
        ELF = open(TRUE, "rb").read()
        LD = sorted(glob.glob("/lib64/ld-linux*.so*") + glob.glob("/lib/ld-linux*.so*"))[0]

        def fexecve(fd):
            pid = os.fork()
            if pid == 0:
                try:
                    os.execve(fd, ["t"], {})
                except OSError as e:
                    os._exit(100 + e.errno)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

        def run(argv, **kw):
            try:
                return subprocess.run(argv, stdin=subprocess.DEVNULL, **kw).returncode
            except OSError as e:
                return 100 + e.errno

        def written(path, data=None, mode=0o755):
            with open(path, "wb") as f:
                f.write(ELF if data is None else data)
            os.chmod(path, mode)
            return path
        """

#: Issue 15 #13: every way a job could execute bytes it wrote. The rule that holds: exec
#: (``execve``, ``execveat``, a script's ``#!``) starts only files of the system trees, the
#: interpreter's prefix and the mount of the job's own command (landlock's execute
#: right), and no memory file can be executable (seccomp row 24: ``memfd_create`` only
#: with ``MFD_NOEXEC_SEAL``). A loader mapping a written file (``ld.so FILE``) is not
#: refused: that is code running in the job's own process, as a ``python`` job's
#: ``ctypes`` already allows, and it keeps the job's domain (the last row shows it).
EXEC = [
    Attempt(
        "files.exec_memfd",
        "files",
        "seccomp (memfd_create without MFD_NOEXEC_SEAL), landlock (/proc: no execute)",
        EXEC_PREAMBLE
        + r"""
        r = {}
        for what, flags in (("memfd", 0), ("memfd cloexec", os.MFD_CLOEXEC),
                            ("memfd MFD_EXEC", 0x10), ("memfd sealed", os.MFD_CLOEXEC | 0x8)):
            try:
                fd = os.memfd_create("t", flags)
            except OSError as e:
                r[what] = en(e)
                continue
            os.write(fd, ELF)
            r[what + " chmod"] = attempt(lambda: os.fchmod(fd, 0o755))
            r[what + " fexecve"] = fexecve(fd)
            r[what + " /proc/self/fd"] = run([f"/proc/self/fd/{fd}"], pass_fds=(fd,))
            r[what + " /dev/fd"] = run([f"/dev/fd/{fd}"], pass_fds=(fd,))
            # Reopened through its magic link (a second open file of the same memory file).
            again = attempt(lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDONLY))
            if again == "ok":
                r[what + " reopened fexecve"] = fexecve(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY))
        # memfd_secret: another memory file (of a noexec internal mount).
        sfd, err = sc("memfd_secret", 0)
        if sfd >= 0:
            import mmap
            try:
                os.ftruncate(sfd, len(ELF))
                mmap.mmap(sfd, len(ELF))[:] = ELF  # secret memory is locked: RLIMIT_MEMLOCK
            except OSError as e:
                r["secret filled"] = en(e)
            r["secret chmod"] = attempt(lambda: os.fchmod(sfd, 0o755))
            r["secret fexecve"] = fexecve(sfd)
        else:
            r["secret"] = err
        done(any(v == 0 for v in r.values()), calls=r)
        """,
    ),
    Attempt(
        "files.exec_tmpfile",
        "files",
        "landlock (no execute in /tmp, /dev/shm or a writable folder)",
        EXEC_PREAMBLE
        + r"""
        r = {}
        for d in ("/tmp", "/dev/shm", OWN):
            try:
                fd = os.open(d, os.O_TMPFILE | os.O_RDWR, 0o755)
            except OSError as e:
                r[d] = en(e)
                continue
            os.write(fd, ELF)
            r[d + " fexecve"] = fexecve(fd)
            r[d + " /proc/self/fd"] = run([f"/proc/self/fd/{fd}"], pass_fds=(fd,))
            # Given a name (linkat through the magic link), then run by that name.
            name = f"{d}/linked"
            r[d + " linkat"] = attempt(lambda: os.link(f"/proc/self/fd/{fd}", name))
            if r[d + " linkat"] == "ok":
                r[d + " linked exec"] = run([name])
        done(any(v == 0 for v in r.values()), calls=r)
        """,
        caps=WRITE_OWN,
    ),
    Attempt(
        "files.exec_written_file",
        "files",
        "landlock (execute only in the system trees and the interpreter's prefix)",
        EXEC_PREAMBLE
        + r"""
        r = {}
        for d in ("/tmp", "/dev/shm", OWN):
            t = written(d + "/t")
            r[d + " exec"] = run([t])
            r[d + " fexecve"] = fexecve(os.open(t, os.O_RDONLY))
            r[d + " execveat O_PATH"] = fexecve(os.open(t, os.O_PATH))
            # A script: the kernel execs the script itself, then its interpreter.
            r[d + " #!/bin/sh"] = run([written(d + "/s.sh", b"#!/bin/sh\nexit 0\n")])
            r[d + " #! written"] = run([written(d + "/s2", b"#!" + t.encode() + b"\n")])
            # Renamed and moved about: the rule is where the file is, not its name.
            os.rename(t, d + "/true")
            r[d + " renamed"] = run([d + "/true"])
            r[d + " via PATH"] = run(["true"], env={"PATH": d})
        done(any(v == 0 for v in r.values()), calls=r)
        """,
        caps=WRITE_OWN,
    ),
    Attempt(
        "files.loader_runs_written_elf",
        "files",
        "no_new_privs, seccomp and landlock bind what a loader maps (mmap is not exec)",
        EXEC_PREAMBLE
        + r"""
        # `ld.so FILE` runs a written ELF without exec of it (landlock's execute right is
        # about exec, not mmap): allowed, and worth nothing. The program it runs is still
        # this job: the same filter, no new privileges, the same landlock domain.
        cat = written("/tmp/cat", open(os.path.realpath(shutil.which("cat")), "rb").read())
        sh = written("/tmp/sh", open(os.path.realpath("/bin/sh"), "rb").read())
        t = written("/tmp/t")
        status = subprocess.run([LD, cat, "/proc/self/status"], capture_output=True,
                                text=True).stdout
        got = dict(l.split(":", 1) for l in status.splitlines() if ":" in l)
        fields = {k: got.get(k, "").strip() for k in ("Seccomp", "NoNewPrivs", "CapEff")}
        secret = subprocess.run([LD, cat, HOME + "/secret/x"], capture_output=True).returncode
        # The loaded shell tries to exec a written file: still refused.
        inner = subprocess.run([LD, sh, "-c", t], capture_output=True).returncode
        ran = run([LD, t])
        done(fields != {"Seccomp": "2", "NoNewPrivs": "1", "CapEff": "0000000000000000"}
             or secret == 0 or inner == 0,
             loaded_true=ran, status=fields, secret=secret, inner_exec=inner)
        """,
    ),
]

#: The bwrap half: every row above, one worker.
BWRAP = [*FILES, *EXEC, *HOST, *NETWORK, *PROCESS, *USER, *RESOURCES, *EGRESS]


def is_helper(a: Attempt) -> bool:
    return a.id.endswith(".plant")


# --- the direct arm: the axes it reports not_kept really are open ------------------------

DIRECT = [
    Attempt(
        "direct.files_open",
        "files",
        "none (the direct arm)",
        r"""
        done(attempt(lambda: open(HOME + "/secret/x").read()) == "ok")
        """,
        caps=READ_NOTES,
        through="always",
        reason="no mount namespace",
    ),
    Attempt(
        "direct.network_open",
        "network",
        "none (the direct arm)",
        r"""
        s = socket.socket(); s.settimeout(2)
        done(attempt(lambda: s.connect(("127.0.0.1", CTX["port"]))) == "ok")
        """,
        setup=_tcp,
        through="always",
        reason="no network namespace",
    ),
    Attempt(
        "direct.process_tree_open",
        "process_tree",
        "none (the direct arm)",
        r"""
        done(attempt(lambda: os.kill(CTX["canary_pid"], 0)) == "ok"
             and os.path.exists(f"/proc/{CTX['worker_pid']}"))
        """,
        through="always",
        reason="no pid namespace",
    ),
    Attempt(
        "direct.user_open",
        "user",
        "none (the direct arm)",
        r"""
        done(open("/proc/self/uid_map").read().split()[:2] == ["0", "0"]
             and os.geteuid() == os.stat(HOME).st_uid)
        """,
        through="always",
        reason="the worker's own identity",
    ),
    Attempt(
        "direct.resources_open",
        "resources",
        "none (the direct arm)",
        MEMORY_ACROSS_PROCESSES,
        limits={"memory_mb": 64},
        through="always",
        reason="no memory cgroup",
    ),
]


def prepare(world: World) -> None:
    """The home every attempt runs against: notes to read, secrets to steal."""
    (world.home / "notes").mkdir()
    (world.home / "notes" / "today.md").write_text("milk\n")
    # Links inside a hint that lead out of it (to the secret, and to a system file).
    (world.home / "notes" / "esc-rel").symlink_to("../secret/x")
    (world.home / "notes" / "esc-abs").symlink_to(world.home / "secret" / "x")
    (world.home / "secret").mkdir()
    (world.home / "secret" / "x").write_text("top secret\n")
    (world.home / ".ssh").mkdir()
    (world.home / ".ssh" / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    world.notes["core_pattern"] = Path("/proc/sys/kernel/core_pattern").read_text()
    world.notes["hostname"] = socket.gethostname()


def _took_within(seconds: float):  # type: ignore[no-untyped-def]
    """Evidence when the job ran longer than `seconds` from its start to its result."""

    def check(_world: World, result: Result | None) -> str | None:
        if result is None or result.started_at is None or result.finished_at is None:
            return None
        took = result.finished_at - result.started_at
        return f"the job took {took:.1f} s, past {seconds} s" if took > seconds else None

    return check


def _cpu_within(seconds: float):  # type: ignore[no-untyped-def]
    def check(_world: World, result: Result | None) -> str | None:
        cpu = result.usage.cpu_s if result is not None and result.usage is not None else None
        return (
            f"the guest used {cpu:.2f} CPU-seconds" if cpu is not None and cpu > seconds else None
        )

    return check


def _locals_bomb(functions: int, locals_: int) -> str:
    """WAT functions with `locals_` i64 locals each, all live across a loop (never called:
    the compile is the attack). Register allocation is superlinear in them: a 0.4 MB
    module of two such functions compiled for a minute (issue 15 #10)."""
    out = []
    for f in range(functions):
        out.append(f"(func $bomb{f} (param i32) (result i64) (local" + " i64" * locals_ + ")")
        out.append("(loop $l")
        out += [
            f"(local.set {i} (i64.add (local.get {i}) (local.get {i % locals_ + 1})))"
            for i in range(1, locals_ + 1)
        ]
        out.append("(br_if $l (local.tee 0 (i32.sub (local.get 0) (i32.const 1))))) (local.get 1))")
    return "\n".join(out)


def _guest_fifo(world: World) -> None:
    os.mkfifo(world.home / "w" / "wasm_guest_after_its_result" / "fifo")


# --- the wasm arm ----------------------------------------------------------------------

#: A WAT module whose ``$check`` returns 1 when the attempt got through; ``_start`` says
#: so as one JSON document on stdout. ``BODY`` is the rest of the module.
WAT = r"""(module
  (import "wasi_snapshot_preview1" "fd_write"
    (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  IMPORTS
  (memory (export "memory") 1)
  (data (i32.const 64) "{\"escaped\": false}\n")
  (data (i32.const 128) "{\"escaped\": true}\n")
  BODY
  (func (export "_start")
    (local $escaped i32)
    (local.set $escaped (call $check))
    (i32.store (i32.const 0) (select (i32.const 128) (i32.const 64) (local.get $escaped)))
    (i32.store (i32.const 4) (select (i32.const 18) (i32.const 19) (local.get $escaped)))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))
"""

PATH_OPEN = """(import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))"""


def wat(body: str, imports: str = "") -> str:
    return WAT.replace("IMPORTS", imports).replace("BODY", body)


WASM = [
    Attempt(
        "wasm.fuel_exhausted",
        "resources",
        "fuel metering",
        wat("(func $check (result i32) (loop $l (br $l)) (i32.const 1))"),
        runtime="wasm",
        limits={"fuel": 100_000},
        stopped_by=frozenset({"E_FUEL"}),
    ),
    Attempt(
        "wasm.wall_time_with_fuel_to_spare",
        "resources",
        "epoch interruption",
        wat("(func $check (result i32) (loop $l (br $l)) (i32.const 1))"),
        runtime="wasm",
        limits={"fuel": 10**15, "timeout_s": 1},
        stopped_by=frozenset({"E_TIMEOUT"}),
    ),
    Attempt(
        "wasm.memory_growth",
        "resources",
        "store memory limit",
        wat("(func $check (result i32) (i32.ne (memory.grow (i32.const 1024)) (i32.const -1)))"),
        runtime="wasm",
        limits={"memory_mb": 16, "fuel": 10**7},
        stopped_by=frozenset({"E_MEMORY", "E_TRAP"}),
    ),
    Attempt(
        "wasm.huge_initial_memory",
        "resources",
        "store memory limit at instantiation",
        wat("(func $check (result i32) (i32.const 1))").replace(
            '(memory (export "memory") 1)', '(memory (export "memory") 40000)'
        ),
        runtime="wasm",
        limits={"memory_mb": 16, "fuel": 10**7},
        stopped_by=frozenset({"E_MEMORY", "E_TRAP"}),
    ),
    Attempt(
        "wasm.second_memory",
        "resources",
        "one linear memory per store (the limit is per memory)",
        wat(
            "(memory $more 200) (func $check (result i32)"
            " (i32.ne (memory.grow $more (i32.const 0)) (i32.const -1)))"
        ),
        runtime="wasm",
        limits={"memory_mb": 16, "fuel": 10**7},
        stopped_by=frozenset({"E_MEMORY", "E_TRAP"}),
    ),
    Attempt(
        "wasm.table_growth",
        "resources",
        "store table limit (walls d)",
        wat(
            "(table $t 1 funcref) (func $check (result i32)"
            " (i32.ne (table.grow $t (ref.null func) (i32.const 50000000)) (i32.const -1)))"
        ),
        runtime="wasm",
        limits={"memory_mb": 16, "fuel": 10**12},
        stopped_by=frozenset({"E_MEMORY", "E_TRAP"}),
    ),
    Attempt(
        "wasm.preopen_escape",
        "files",
        "WASI preopens (no .., no absolute paths)",
        wat(
            r"""(data (i32.const 256) "today.md../secret/x/etc/passwdesc-relesc-abs")
  (func $open (param $fd i32) (param $at i32) (param $len i32) (param $oflags i32) (result i32)
    (call $path_open (local.get $fd) (i32.const 1) (local.get $at) (local.get $len)
      (local.get $oflags) (i64.const 2) (i64.const 0) (i32.const 0)
      (i32.const 16)))
  (func $check (result i32)
    (local $fd i32)
    ;; the control: find the notes preopen (its file opens there); none: a broken test
    (local.set $fd (i32.const 3))
    (block $found
      (loop $next
        (br_if $found (i32.eqz (call $open (local.get $fd) (i32.const 256) (i32.const 8)
          (i32.const 0))))
        (local.set $fd (i32.add (local.get $fd) (i32.const 1)))
        (br_if $next (i32.lt_u (local.get $fd) (i32.const 8)))
        (call $exit (i32.const 3))))
    ;; "..", an absolute path, and links in the folder that lead out of it
    (i32.or (i32.or
      (i32.eqz (call $open (local.get $fd) (i32.const 264) (i32.const 11) (i32.const 0)))
      (i32.eqz (call $open (local.get $fd) (i32.const 275) (i32.const 11) (i32.const 0))))
     (i32.or
      (i32.eqz (call $open (local.get $fd) (i32.const 286) (i32.const 7) (i32.const 0)))
      (i32.eqz (call $open (local.get $fd) (i32.const 293) (i32.const 7) (i32.const 0))))))""",
            PATH_OPEN,
        ),
        runtime="wasm",
        caps=READ_NOTES,
        limits={"fuel": 10**7},
    ),
    Attempt(
        "wasm.write_read_only_preopen",
        "files",
        "read-only preopen (fs_mutable off)",
        wat(
            r"""(data (i32.const 256) "planted")
  (func $check (result i32)
    (local $fd i32)
    (local $got i32)
    ;; O_CREAT on every preopen (the notes folder and the executor's own): none may
    (local.set $fd (i32.const 3))
    (loop $next
      (local.set $got (i32.or (local.get $got) (i32.eqz
        (call $path_open (local.get $fd) (i32.const 1) (i32.const 256) (i32.const 7)
          (i32.const 1) (i64.const 0x42) (i64.const 0) (i32.const 0)
          (i32.const 16)))))
      (local.set $fd (i32.add (local.get $fd) (i32.const 1)))
      (br_if $next (i32.lt_u (local.get $fd) (i32.const 8))))
    (local.get $got))""",
            PATH_OPEN,
        ),
        runtime="wasm",
        caps=READ_NOTES,
        limits={"fuel": 10**7},
        host_check=_absent("notes/planted"),
    ),
    Attempt(
        "wasm.disk_without_staging",
        "resources",
        "none: a wasm job writes into its preopen directly (reported partial)",
        wat(
            r"""(data (i32.const 256) "big")
  (func $check (result i32)
    (local $fd i32)
    (local $i i32)
    ;; the writable preopen is the one where O_CREAT works
    (local.set $fd (i32.const 3))
    (block $found
      (loop $next
        (br_if $found (i32.eqz (call $path_open (local.get $fd) (i32.const 1)
          (i32.const 256) (i32.const 3) (i32.const 1) (i64.const 0x40) (i64.const 0)
          (i32.const 0) (i32.const 16))))
        (local.set $fd (i32.add (local.get $fd) (i32.const 1)))
        (br_if $next (i32.lt_u (local.get $fd) (i32.const 8)))
        (call $exit (i32.const 3))))
    ;; 512 writes of 64 KiB (32 MiB) against a 16 MiB disk budget
    (i32.store (i32.const 32) (i32.const 65536))
    (i32.store (i32.const 36) (i32.const 65536))
    (loop $w
      (drop (call $fd_write (i32.load (i32.const 16)) (i32.const 32) (i32.const 1)
        (i32.const 40)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $w (i32.lt_u (local.get $i) (i32.const 512))))
    (i32.const 0))""",
            PATH_OPEN,
        ).replace('(memory (export "memory") 1)', '(memory (export "memory") 2)'),
        caps=WRITE_OWN,
        runtime="wasm",
        limits={"memory_mb": 16, "fuel": 10**7, "disk_mb": 16},
        host_check=_disk_within("wasm_disk_without_staging", 16),
        through="always",
        reason="disk writes unbounded",
    ),
    Attempt(
        "wasm.target_below_a_file",
        "files",
        "a declared target that cannot be backed up is the job's refusal, never a host fault",
        wat("(func $check (result i32) (i32.const 0))"),
        caps=WRITE_OWN,
        runtime="wasm",
        limits={"fuel": 10**7},
        # Its own folder holds the file "f": a path argument below it (E_HOST_FAULT, the
        # job retried and dead-lettered, before).
        path_arg="~/w/wasm_target_below_a_file/f/x",
        setup=lambda world: (world.home / "w" / "wasm_target_below_a_file" / "f").write_text(
            "a file"
        ),
        stopped_by=frozenset({"E_BAD_ARGS"}),
    ),
    Attempt(
        "wasm.target_is_a_fifo",
        "files",
        "a declared target that cannot be backed up is the job's refusal, never a host fault",
        wat("(func $check (result i32) (i32.const 0))"),
        caps=WRITE_OWN,
        runtime="wasm",
        limits={"fuel": 10**7},
        # A FIFO there (left by a job that wrote the folder unstaged, or by anyone).
        path_arg="~/w/wasm_target_is_a_fifo/p",
        setup=lambda world: os.mkfifo(world.home / "w" / "wasm_target_is_a_fifo" / "p"),
        stopped_by=frozenset({"E_BAD_ARGS"}),
    ),
    Attempt(
        "wasm.socket_import",
        "network",
        "WASI preview 1 has no sock_connect: link fails",
        wat(
            "(func $check (result i32) (i32.eqz (call $connect (i32.const 3) (i32.const 0))))",
            '(import "wasi_snapshot_preview1" "sock_connect"'
            " (func $connect (param i32 i32) (result i32)))",
        ),
        runtime="wasm",
        limits={"fuel": 10**7},
        stopped_by=frozenset({"E_SANDBOX_DENIED"}),
    ),
    Attempt(
        "wasm.guest_after_its_result",
        "process_tree",
        "the guest's own process, killed and reaped before its result (issue 15 #1)",
        wat(
            r"""(data (i32.const 256) "startedfifolate")
  (data (i32.const 272) "late\n")
  (func $check (result i32)
    (local $fd i32)
    ;; the writable preopen (its own folder) is the one where O_CREAT works
    (local.set $fd (i32.const 3))
    (block $found
      (loop $next
        (br_if $found (i32.eqz (call $path_open (local.get $fd) (i32.const 1)
          (i32.const 256) (i32.const 7) (i32.const 1) (i64.const 0x40) (i64.const 0)
          (i32.const 0) (i32.const 16))))
        (local.set $fd (i32.add (local.get $fd) (i32.const 1)))
        (br_if $next (i32.lt_u (local.get $fd) (i32.const 8)))
        (call $exit (i32.const 3))))
    ;; blocks in the host until a writer comes (the next phase's helper)
    (drop (call $path_open (local.get $fd) (i32.const 0) (i32.const 263) (i32.const 4)
      (i32.const 0) (i64.const 2) (i64.const 0) (i32.const 0) (i32.const 20)))
    ;; straight on, no epoch check on the way: "late" written after the job's result
    (drop (call $path_open (local.get $fd) (i32.const 0) (i32.const 267) (i32.const 4)
      (i32.const 1) (i64.const 0x40) (i64.const 0) (i32.const 0) (i32.const 24)))
    (i32.store (i32.const 32) (i32.const 272))
    (i32.store (i32.const 36) (i32.const 5))
    (drop (call $fd_write (i32.load (i32.const 24)) (i32.const 32) (i32.const 1)
      (i32.const 40)))
    (i32.const 1))""",
            PATH_OPEN,
        ),
        caps=WRITE_OWN,
        runtime="wasm",
        limits={"fuel": 10**7, "timeout_s": 1},
        setup=_guest_fifo,
        host_check=_absent("w/wasm_guest_after_its_result/late"),
        stopped_by=frozenset({"E_TIMEOUT"}),
    ),
    Attempt(
        # helper: opens the FIFO for writing once the guest above has its result, so a
        # guest still waiting in the open resumes (it blocks itself when nobody reads)
        "wasm.guest_after_its_result.plant",
        "process_tree",
        "helper",
        wat(
            r"""(data (i32.const 256) "fifo")
  (func $check (result i32)
    (local $fd i32)
    (local.set $fd (i32.const 3))
    (loop $next
      (drop (call $path_open (local.get $fd) (i32.const 0) (i32.const 256) (i32.const 4)
        (i32.const 0) (i64.const 0x40) (i64.const 0) (i32.const 0) (i32.const 16)))
      (local.set $fd (i32.add (local.get $fd) (i32.const 1)))
      (br_if $next (i32.lt_u (local.get $fd) (i32.const 8))))
    (i32.const 0))""",
            PATH_OPEN,
        ),
        caps=(("fs:write", ("~/w/wasm_guest_after_its_result/**",)),),
        runtime="wasm",
        limits={"fuel": 10**7, "timeout_s": 2},
        phase=2,
        stopped_by=frozenset({"E_TIMEOUT"}),
    ),
    Attempt(
        "wasm.compile_bomb",
        "resources",
        "a complexity bound before compiling (MAX_FUNCTION_LOCALS; issue 15 #10)",
        wat("(func $check (result i32) (i32.const 0))\n" + _locals_bomb(2, 12_000)),
        runtime="wasm",
        limits={"fuel": 10**7, "timeout_s": 5},
        host_check=_took_within(5 + 3),
        stopped_by=frozenset({"E_SANDBOX_DENIED"}),
    ),
    Attempt(
        "wasm.slow_compile",
        "resources",
        "the compile counts against the wall time, in a killable process (issue 15 #10)",
        wat("(func $check (result i32) (i32.const 0))\n" + _locals_bomb(24, 4_000)),
        runtime="wasm",
        limits={"fuel": 10**7, "timeout_s": 2},
        host_check=_took_within(2 + 3),
        stopped_by=frozenset({"E_TIMEOUT"}),
    ),
    Attempt(
        "wasm.cpu_time_budget",
        "resources",
        "limits.cpu_s: epoch check of the guest's CPU time, RLIMIT_CPU (issue 15 #11)",
        wat("(func $check (result i32) (loop $l (br $l)) (i32.const 1))"),
        runtime="wasm",
        limits={"fuel": 10**15, "cpu_s": 1, "timeout_s": 10},
        host_check=_cpu_within(2.0),
        stopped_by=frozenset({"E_KILLED"}),
    ),
]
