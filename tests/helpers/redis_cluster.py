"""Private Redis deployments of several servers for tests, all on 127.0.0.1 (issue 18,
item 12): a Redis Cluster (three primaries, optionally a replica each) and a primary with
a replica watched by a sentinel. Each server is a `RedisServer` (``queue/redis.conf``,
the append-only file on), so they restart and stop like the single private server.

Cluster nodes need their bus port (port + 10000) free too: their ports are taken from
below 30000, never the ephemeral range (where port + 10000 may not exist).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.helpers.redis_server import RedisServer


def redis_cli_path() -> str | None:
    return shutil.which("redis-cli")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_port(taken: set[int]) -> int:
    for _ in range(200):
        port = random.randint(20000, 29999)
        if port not in taken and _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def cli(port: int, *args: str, timeout: float = 20) -> str:
    """``redis-cli -p PORT ARGS``'s output (raises on failure)."""
    exe = redis_cli_path()
    assert exe is not None, "redis-cli is not installed"
    out = subprocess.run(
        [exe, "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return out.stdout


def wait_for(what: str, check: object, timeout: float = 30.0) -> None:
    """Poll `check()` (a callable) until it is true, with a deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            if check():  # type: ignore[operator]
                return
        time.sleep(0.05)  # polling a server's state, with a deadline
    raise TimeoutError(f"timed out waiting for {what}")


class LocalCluster:
    """A Redis Cluster of three primaries on 127.0.0.1 (`replicas` per primary).

    Args:
        folder: one sub-folder per node.
        replicas: replicas per primary (0 or 1).
    """

    def __init__(self, folder: Path, *, replicas: int = 0) -> None:
        self.folder = folder
        self.replicas = replicas
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """The broker URL: two startup nodes are enough, the client learns the rest."""
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])
        return f"redis+cluster://{hosts}"

    @property
    def pids(self) -> list[int]:
        return [n.proc.pid for n in self.nodes if n.proc is not None]

    def start(self) -> None:
        taken: set[int] = set()
        for i in range(3 * (1 + self.replicas)):
            port = _cluster_port(taken)
            taken.add(port)
            node = RedisServer(
                self.folder / f"node{i}",
                appendonly=True,
                private_conf=True,
                extra=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
            node.port = port
            node.start()
            self.nodes.append(node)
        cli(
            self.nodes[0].port,
            "--cluster",
            "create",
            *(f"127.0.0.1:{n.port}" for n in self.nodes),
            "--cluster-replicas",
            str(self.replicas),
            "--cluster-yes",
            timeout=60,
        )
        for node in self.nodes:
            wait_for(
                f"cluster state ok on {node.port}",
                lambda port=node.port: "cluster_state:ok" in cli(port, "cluster", "info"),
            )
        if self.replicas:
            wait_for("every replica in sync", self._replicas_synced)

    def _replicas_synced(self) -> bool:
        lines = [line.split() for line in cli(self.nodes[0].port, "cluster", "nodes").splitlines()]
        replicas = [f for f in lines if "slave" in f[2]]
        return len(replicas) == 3 * self.replicas and all(f[7] == "connected" for f in replicas)

    def node_for_key(self, key: str) -> RedisServer:
        """The primary holding `key`'s slot now."""
        slot = int(cli(self.nodes[0].port, "cluster", "keyslot", key).strip())
        for line in cli(self.nodes[0].port, "cluster", "nodes").splitlines():
            fields = line.split()
            if "master" not in fields[2] or "fail" in fields[2]:
                continue
            for part in fields[8:]:
                low, _, high = part.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    port = int(fields[1].split(":")[1].split("@")[0])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no primary holds slot {slot}")

    def replica_of(self, primary: RedisServer) -> RedisServer:
        """`primary`'s replica, once the cluster's gossip says so (polled, deadline)."""
        node_id = cli(primary.port, "cluster", "myid").strip()
        found: list[RedisServer] = []

        def look() -> bool:
            for line in cli(primary.port, "cluster", "nodes").splitlines():
                fields = line.split()
                if fields[3] == node_id and "connected" in fields[7]:
                    port = int(fields[1].split(":")[1].split("@")[0])
                    found.append(next(n for n in self.nodes if n.port == port))
                    return True
            return False

        wait_for(f"a replica of {primary.port}", look)
        return found[0]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class SentinelGroup:
    """A primary, a replica of it and one sentinel (quorum 1) watching them as
    ``service``, on 127.0.0.1, the append-only file on."""

    service = "metnos-test"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.primary = RedisServer(folder / "a", appendonly=True, private_conf=True)
        self.replica = RedisServer(folder / "b", appendonly=True, private_conf=True)
        self.sentinel_port = 0
        self.sentinel: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.service}"

    @property
    def pids(self) -> list[int]:
        procs = (self.primary.proc, self.replica.proc, self.sentinel)
        return [p.pid for p in procs if p is not None]

    def start(self) -> None:
        self.primary.start()
        self.replica.extra = ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.replica.start()
        wait_for("the replica in sync", self._synced)
        port = _cluster_port(set())
        conf = self.folder / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.folder}\n"
            f"logfile {self.folder / 'sentinel.log'}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {self.service} 1000\n"
            f"sentinel failover-timeout {self.service} 4000\n"
        )
        exe = shutil.which("redis-server")
        assert exe is not None
        self.sentinel = subprocess.Popen(
            [exe, str(conf), "--sentinel"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.sentinel_port = port
        wait_for("the sentinel to see the replica", self._sentinel_ready)

    def _synced(self) -> bool:
        return "master_link_status:up" in cli(self.replica.port, "info", "replication")

    def _sentinel_ready(self) -> bool:
        return "slave" in cli(self.sentinel_port, "sentinel", "replicas", self.service)

    def primary_port(self) -> int:
        reply = cli(self.sentinel_port, "sentinel", "get-master-addr-by-name", self.service)
        return int(reply.split()[1])

    def servers(self) -> Iterator[RedisServer]:
        yield self.primary
        yield self.replica

    def stop(self) -> None:
        proc, self.sentinel = self.sentinel, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for server in self.servers():
            server.stop()
