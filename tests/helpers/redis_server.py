"""A private redis-server for tests: a free loopback port, its own folder, never 6379.

`RedisServer` starts ``redis-server`` from ``queue/redis.conf`` (the configuration we
document) with test overrides on the command line, waits until it answers PING, and can
be restarted on the same port and folder (the append-only file survives, as in
production). The process is a child of pytest: callers add its pid to
``tests.conftest.ALLOWED_CHILDREN`` when it outlives a test (session fixtures).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "queue" / "redis.conf"


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            # A server with a password answers, refusing: it is up all the same.
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """One redis-server on 127.0.0.1, in `folder`.

    Args:
        folder: its working folder (AOF, log).
        appendonly: keep the append-only file (``appendfsync everysec``, as documented).
        extra: more command-line settings (``--requirepass``, ``--user ...``).
        private_conf: start from a copy of ``queue/redis.conf`` in `folder`: a server that
            a sentinel reconfigures has its file rewritten (``CONFIG REWRITE``).
    """

    def __init__(
        self,
        folder: Path,
        *,
        appendonly: bool = False,
        extra: Sequence[str] = (),
        private_conf: bool = False,
    ) -> None:
        self.folder = folder
        self.appendonly = appendonly
        self.extra = list(extra)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True, exist_ok=True)
        self.conf = CONF
        if private_conf:
            self.conf = folder / "redis.conf"
            shutil.copyfile(CONF, self.conf)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = redis_server_path()
        assert exe is not None, "redis-server is not installed"
        for _ in range(5):  # a port taken between the probe and the bind: pick another
            port = self.port or _free_port()
            argv = [
                exe,
                str(self.conf),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--logfile",
                str(self.folder / "redis.log"),
                "--daemonize",
                "no",
                *self.extra,
            ]
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _ping(port):
                    self.port = port
                    return
                time.sleep(0.01)  # polling a fresh process with a deadline
            self.stop()
            if self.port:
                break  # a restart must keep its port: do not wander off
        log = (self.folder / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not start: {log}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it (SIGTERM: a clean shutdown that flushes the append-only file)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()
