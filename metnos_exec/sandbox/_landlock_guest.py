"""The in-guest step: landlock the sandbox's first process, then become the job.

Not imported by the worker: it is the ``-c`` program of the guest's interpreter
(`metnos_exec.sandbox.landlock.wrap_argv`: the worker's own interpreter gets this code
compiled and marshalled in ``METNOS_LANDLOCK_STEP`` behind a one-line loader, any other
one the text), so it may use builtin modules only, and it runs before any code of the
executor::

    python -I -S -c <the step> MODE CTYPES SCOPE [RIGHTS PATH]... -- TARGET...

It creates a landlock ruleset that handles every access right the kernel knows (up to ABI
7; best effort below, as the landlock documentation describes), allows each ``PATH`` the
``RIGHTS`` given (the worker gives a file only file rights; a path that does not exist is
skipped, so it stays denied), scopes abstract Unix sockets and signals (``SCOPE``,
ABI >= 6), and restricts itself. ``CTYPES`` is the path of ``_ctypes``, which spares the
import system's search (``""``: import it).

Then, for MODE ``run`` (``TARGET`` = a Python script and its arguments), it runs the
script in this very interpreter as ``python -I -S script`` would: a fresh ``__main__``,
``sys.argv`` = ``TARGET``, tracebacks without this step's frames. That saves a second
interpreter start. ``METNOS_LANDLOCK_SCRIPT``, when set, is the script compiled by the
worker (marshalled); otherwise the step compiles it. Both variables leave the environment
before the job runs. MODE ``exec`` execs ``TARGET`` instead (PATH searched like
``execvp``); the landlock domain survives ``execve``.

Any failure before the job starts exits 126 with a line on stderr: the job does not run
unrestricted.
"""

import gc
import sys

# The step allocates a few thousand objects (its own code, _ctypes's types) that live until
# the process ends: no collection while it runs (the loader already stopped the collector).
gc.disable()

# Type names for the checker only, in quoted annotations: importing typing would cost the
# job ~10 ms, and even ``from __future__ import annotations`` imports a module.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import CodeType, ModuleType
    from typing import Any, NoReturn


def _fail(what: str) -> "NoReturn":
    sys.stderr.write(f"metnos-exec: {what}: the job did not run\n")
    raise SystemExit(126)


def _ctypes(path: str) -> "ModuleType":
    # The import system would search sys.path and build its finder caches (~0.1 ms) for a
    # module whose file the worker already knows.
    try:
        import _imp

        spec = type(sys)("spec")
        vars(spec).update(name="_ctypes", origin=path)  # all create_dynamic reads
        mod = _imp.create_dynamic(spec)  # type: ignore[arg-type]
        _imp.exec_dynamic(mod)
        sys.modules["_ctypes"] = mod
        return mod
    except Exception:
        import _ctypes

        return _ctypes  # type: ignore[unused-ignore]


def _landlock(ct: "ModuleType", scope: int, rules: "list[tuple[int, str]]") -> int:
    import posix

    libc: int = ct.dlopen(None, 0)
    # Untyped calls, on purpose (no prototype classes to build at each start), and safe:
    # every argument below is a small int (a C int, sign-extended) or a bytes object or
    # None (passed as a pointer); never an address as an int, which a C int would cut.
    call = getattr(ct, "call_function", None)
    if call is None:  # an interpreter without it: a minimal function pointer type

        class _Long(ct._SimpleCData):  # type: ignore[misc, name-defined]
            _type_ = "l"

        class _Fn(ct.CFuncPtr):  # type: ignore[misc, name-defined]
            _flags_ = ct.FUNCFLAG_CDECL
            _restype_ = _Long

        def call(addr: int, args: "tuple[Any, ...]") -> int:
            return int(_Fn(addr)(*args))

    syscall = ct.dlsym(libc, "syscall")
    # bubblewrap already set no_new_privs (landlock_restrict_self needs it); so does this
    # step, so that it never depends on who started it.
    if call(ct.dlsym(libc, "prctl"), (38, 1, 0, 0, 0)):  # PR_SET_NO_NEW_PRIVS
        _fail("prctl(PR_SET_NO_NEW_PRIVS) failed")
    # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    abi = call(syscall, (444, None, 0, 1))
    if abi < 1:
        _fail("landlock is not available in the sandbox")
    # Access rights by ABI: 13 in ABI 1, REFER (2), TRUNCATE (3), IOCTL_DEV (5).
    handled = (1 << 13) - 1
    for since, bit in ((2, 13), (3, 14), (5, 15)):
        if abi >= since:
            handled |= 1 << bit
    order = sys.byteorder
    attr = handled.to_bytes(8, order)
    if abi >= 6:
        attr += bytes(8) + scope.to_bytes(8, order)  # no network rights handled: netns
    ruleset = call(syscall, (444, attr, len(attr), 0))
    if ruleset < 0:
        _fail("landlock_create_ruleset failed")
    batch: list[int] = []
    for rights, path in rules:
        try:
            fd = posix.open(path, 0o10000000 | 0o2000000)  # O_PATH | O_CLOEXEC
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue  # not in the sandbox, or not for this uid: stays denied
        except OSError as exc:  # out of fds (a tiny RLIMIT_NOFILE), ...: fail closed
            _fail(f"cannot open {path} for a landlock rule: {exc.strerror}")
        batch.append(fd)
        rights &= handled
        if rights:
            attr = rights.to_bytes(8, order) + fd.to_bytes(4, order, signed=True)
            # landlock_add_rule(ruleset, LANDLOCK_RULE_PATH_BENEATH, &attr, 0)
            if call(syscall, (445, ruleset, 1, attr, 0)):
                _fail(f"landlock_add_rule failed for {path}")
        if len(batch) == 8:  # the rule holds its own reference: few fds open at once
            _close(posix, batch)
            batch = []
    if call(syscall, (446, ruleset, 0)):  # landlock_restrict_self
        _fail("landlock_restrict_self failed")
    _close(posix, [ruleset, *batch])
    return libc


def _close(posix: "ModuleType", fds: "list[int]") -> None:
    low, high = min(fds), max(fds)
    if high - low + 1 == len(fds):  # numbered in a row (the usual case): one close_range
        posix.closerange(low, high + 1)
    else:
        for fd in fds:
            posix.close(fd)


def _exec(target: "list[str]") -> "NoReturn":
    import _signal  # type: ignore[import-not-found]  # builtin; signal.py imports enum
    import posix

    # CPython ignores SIGPIPE and SIGXFSZ; an ignored signal stays ignored across exec.
    # Restore them as subprocess does, so `head > big` still dies of SIGXFSZ at its limit.
    for name in ("SIGPIPE", "SIGXFSZ"):
        _signal.signal(getattr(_signal, name), _signal.SIG_DFL)

    name = target[0]
    if "/" in name:
        dirs = [""]
    else:
        dirs = [d.decode() + "/" for d in posix.environ.get(b"PATH", b"/usr/bin:/bin").split(b":")]
    err = OSError(2, "No such file or directory")
    for d in dirs:
        try:
            posix.execv(d + name, target)
        except OSError as exc:
            err = exc
    sys.stderr.write(f"metnos-exec: cannot execute {name}: {err.strerror}\n")
    raise SystemExit(126 if err.errno == 13 else 127)


def _main() -> "tuple[CodeType, dict[str, Any]]":
    import posix

    argv = sys.argv
    end = argv.index("--", 4)
    mode, ct_path, scope = argv[1], argv[2], int(argv[3])
    rules = [(int(argv[i]), argv[i + 1]) for i in range(4, end, 2)]
    # Ours, not the job's: out of the environment (the C one too, for its children).
    compiled = posix.environ.pop(b"METNOS_LANDLOCK_SCRIPT", b"").decode()
    held = posix.environ.pop(b"METNOS_WARM", None) is not None
    for name in (b"METNOS_LANDLOCK_STEP", b"METNOS_LANDLOCK_SCRIPT", b"METNOS_WARM"):
        posix.environ.pop(name, None)
        posix.unsetenv(name)
    target = argv[end + 1 :]
    ct = _ctypes(ct_path)
    libc = _landlock(ct, scope, rules)
    if mode not in ("run", "runpath"):
        if held:
            _hold(posix)
        _exec(target)
    script = target[0]
    if mode == "runpath":
        # What ``python -E -s -S script`` does: the script's own folder first, so its
        # sibling modules import (the step itself runs with -I, which leaves it out).
        sys.path.insert(0, posix.fspath(script).rpartition("/")[0] or ".")
    code: CodeType | None = None
    try:
        if compiled:
            # Compiled by the worker: only check that the guest may read the script, as
            # `python script` would by opening it.
            posix.close(posix.open(script, 0o2000000))  # O_RDONLY | O_CLOEXEC
            import marshal

            code = marshal.loads(bytes.fromhex(compiled))
        else:
            with open(script, "rb") as f:
                source = f.read()
    except OSError as exc:
        sys.stderr.write(f"{sys.executable}: can't open file {script!r}: {exc}\n")
        raise SystemExit(2) from None
    if code is None and b"\0" not in source:
        # Py_CompileStringExFlags: what `python script` does. The builtin compile() would
        # first build the ast module's types (~0.8 ms) to check for an AST argument.
        try:

            class _Obj(ct._SimpleCData):  # type: ignore[misc, name-defined]
                _type_ = "O"

            class _Api(ct.CFuncPtr):  # type: ignore[misc, name-defined]
                _flags_ = ct.FUNCFLAG_CDECL | ct.FUNCFLAG_PYTHONAPI
                _restype_ = _Obj

            compile_c = _Api(ct.dlsym(libc, "Py_CompileStringExFlags"))
        except (AttributeError, OSError):
            pass
        else:
            code = compile_c(source, script.encode(), 257, None, -1)  # Py_file_input
    if code is None:
        code = compile(source, script, "exec", dont_inherit=True)
    main = type(sys)("__main__")
    namespace = vars(main)
    namespace.update(
        __file__=script,
        __cached__=None,
        __builtins__=sys.modules["builtins"],
        __loader__=sys.modules["_frozen_importlib_external"].SourceFileLoader("__main__", script),
    )
    sys.modules["__main__"] = main
    sys.argv = target
    if held:
        _hold(posix)
    return code, namespace


def _hold(posix: "Any") -> None:
    """A warm sandbox (``METNOS_WARM``, `metnos_exec.sandbox._bwrap_warm`): everything
    before the job's own code has run; wait for the one byte that releases it on stdin
    (the job's arguments follow it). End of file instead: the pool drained it unused."""
    if posix.read(0, 1) != b"g":
        raise SystemExit(0)


if __name__ == "__main__":  # run as the guest's -c program, never on import
    _code, _globals = _main()
    # What exists now (the interpreter's start-up and this step) lives until exit anyway:
    # frozen out of the collector's reach, so the job's collections, and the last one at
    # exit, do not walk it again (~0.15 ms less per job). The job's own objects are
    # collected as usual.
    gc.freeze()
    gc.enable()
    try:
        exec(_code, _globals)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as _exc:
        # What the interpreter prints for an uncaught exception, minus this step's frames
        # (the script's frames are the ones that run in its own namespace, and after).
        _tb = _exc.__traceback__
        while _tb is not None and _tb.tb_frame.f_globals is not _globals:
            _tb = _tb.tb_next
        # The hook prints the exception's own traceback: shorten that one.
        sys.excepthook(type(_exc), _exc.with_traceback(_tb), _tb)
        raise SystemExit(1) from None
