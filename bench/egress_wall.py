"""The network wall's cost (issue 17, acceptance 4), side by side in one run.

Three measurements, each interleaved round by round with its baseline so both see the
same machine state:

* **request**: one HTTPS-style request from inside a bwrap job: CONNECT through the
  wall's HTTP proxy to an allowed name (resolved by the bench's resolver to a loopback
  TLS server), TLS, ``GET``, a 1 MiB body; against the same request from a job on the
  host network connecting to the server directly. Timed inside the job (the sandbox's
  start is not in it). Target: wall <= 1.15 x host.
* **throughput**: the same with a 100 MiB body. Target: wall >= 0.8 x host.
* **set-up**: a job running ``true`` with the wall (its listeners made in its namespace
  while bubblewrap waits on its block fd) against the same job without network (today's
  bwrap start). Target: at most 2 ms more, median.

The TLS server's certificate is made with ``openssl`` in a temporary folder; the guest
does not verify it (the bench measures the wall, not a PKI). Every server binds
127.0.0.1; names resolve through the bench's own resolver.

Usage: PYTHONPATH=. python bench/egress_wall.py [--rounds 15] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import anyio
import anyio.abc

from metnos_exec.sandbox._types import ResourceLimits, SandboxJob, Success
from metnos_exec.sandbox.bwrap import BwrapSandbox
from metnos_exec.sandbox.egress import policy_for
from metnos_exec.sandbox.flags import guest_python

NAME = "bench.example.test"

GUEST = r"""
import json, os, socket, ssl, sys, time
port, size, via = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
t = time.perf_counter()
if via == "wall":
    proxy = int(os.environ["HTTPS_PROXY"].rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", proxy))
    s.sendall(f"CONNECT {sys.argv[4]}:{port} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
else:
    s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
tls = ctx.wrap_socket(s, server_hostname=sys.argv[4])
tls.sendall(f"GET /{size} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
got = 0
buf = bytearray(1 << 20)
while True:
    n = tls.recv_into(buf)
    if not n:
        break
    got += n
dt = time.perf_counter() - t
print(json.dumps({"s": dt, "bytes": got}))
"""


def make_cert(folder: str) -> tuple[str, str]:
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={NAME}", "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def serve_tls(cert: str, key: str, task_status: anyio.abc.TaskStatus[int]) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    chunk = b"x" * (1 << 20)

    async def handle(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive()
            size = int(head.split(b" ")[1][1:])
            await stream.send(
                f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n".encode()
            )
            while size:
                n = min(size, len(chunk))
                await stream.send(chunk[:n])
                size -= n

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    from anyio.streams.tls import TLSListener

    async with TLSListener(listener, ctx, standard_compatible=False) as tls:
        task_status.started(port)
        await tls.serve(handle)


async def resolver(host: str, port: int) -> Sequence[str]:
    if host == NAME:
        return ("127.0.0.1",)
    raise OSError(f"{host}: not the bench's name")


async def timed_request(arm: BwrapSandbox, port: int, size: int, wall: bool) -> float:
    job = SandboxJob(
        argv=(guest_python(), "-c", GUEST, str(port), str(size), "wall" if wall else "host", NAME),
        network=True,
        egress=policy_for([("https", f"{NAME}:{port}")], trusted=["127.0.0.1/32"])
        if wall
        else None,
        limits=ResourceLimits(wall_time_s=120, memory_bytes=512 << 20),
    )
    outcome = await arm.run(job)
    assert outcome.exit == Success(), outcome.stderr.decode()[-2000:]
    doc = json.loads(outcome.stdout)
    assert doc["bytes"] >= size, doc
    return float(doc["s"])


async def setup_cost(arm: BwrapSandbox, wall: bool) -> float:
    job = SandboxJob(
        argv=("/bin/true",),
        network=wall,
        egress=policy_for([("https", "api.example.test")]) if wall else None,
    )
    t = time.perf_counter()
    outcome = await arm.run(job)
    dt = time.perf_counter() - t
    assert outcome.exit == Success(), outcome
    return dt


def med(xs: list[float]) -> float:
    return statistics.median(xs)


async def server_process(cert: str, key: str) -> None:
    """``--serve``: the TLS server alone, in a process of its own (in the bench's own
    event loop it would take the relay's CPU: the wall's worker does not serve the
    upstream). Prints its port, serves until stdin closes."""
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_tls, cert, key)
        print(port, flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)
        tg.cancel_scope.cancel()


def start_server(cert: str, key: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, __file__, "--serve", cert, key],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


async def main(rounds: int) -> dict[str, float]:
    arm = BwrapSandbox(resolver=resolver)
    with tempfile.TemporaryDirectory() as folder:
        cert, key = make_cert(folder)
        server = await anyio.to_thread.run_sync(start_server, cert, key)
        assert server.stdout is not None and server.stdin is not None
        port = int(await anyio.to_thread.run_sync(server.stdout.readline))
        try:
            one = {"wall": [], "host": []}  # type: dict[str, list[float]]
            big = {"wall": [], "host": []}  # type: dict[str, list[float]]
            start = {"wall": [], "plain": []}  # type: dict[str, list[float]]
            for i in range(rounds + 1):
                for wall in (True, False):
                    key_ = "wall" if wall else "host"
                    a = await timed_request(arm, port, 1 << 20, wall)
                    b = await timed_request(arm, port, 100 << 20, wall)
                    s = await setup_cost(arm, wall)
                    if i == 0:
                        continue  # warm-up
                    one[key_].append(a)
                    big[key_].append(b)
                    start["wall" if wall else "plain"].append(s)
        finally:
            server.stdin.close()
            await anyio.to_thread.run_sync(server.wait)
    out = {
        "request_wall_ms": med(one["wall"]) * 1e3,
        "request_host_ms": med(one["host"]) * 1e3,
        "throughput_wall_mib_s": 100 / med(big["wall"]),
        "throughput_host_mib_s": 100 / med(big["host"]),
        "setup_wall_ms": med(start["wall"]) * 1e3,
        "setup_plain_ms": med(start["plain"]) * 1e3,
    }
    out["request_ratio"] = out["request_wall_ms"] / out["request_host_ms"]
    out["throughput_ratio"] = out["throughput_wall_mib_s"] / out["throughput_host_mib_s"]
    out["setup_extra_ms"] = out["setup_wall_ms"] - out["setup_plain_ms"]
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    parser.add_argument("--serve", nargs=2, metavar=("CERT", "KEY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        anyio.run(server_process, *args.serve)
        sys.exit(0)
    result = anyio.run(main, args.rounds, backend=args.backend)
    for k, v in result.items():
        print(f"{k:24} {v:10.3f}")
    sys.exit(0)
