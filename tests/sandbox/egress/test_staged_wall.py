"""The network wall for a staged job (fs:write + network), through a real supervisor:
bubblewrap starts inside the staging namespace, the wall still goes up, and the result
carries the egress records."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import pytest

from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Job
from tests.undo.helpers import make_world, staging_works

pytestmark = pytest.mark.anyio

MANIFEST = """\
name = "netwrite"
version = "1"
runtime = "python"
entry = "main.py"

[[capabilities]]
name = "fs:write"
hints = ["~/notes/**"]

[[capabilities]]
name = "network:http"
hints = ["127.0.0.1:{port}"]
"""

MAIN = """\
import json, os, socket, sys, urllib.request
home = os.environ["HOME"]
body = urllib.request.urlopen("http://127.0.0.1:{port}/", timeout=5).read().decode()
open(os.path.join(home, "notes", "fetched.txt"), "w").write(body)
try:
    socket.create_connection(("127.0.0.1", {secret}), 3)
    other = "reached"
except OSError as exc:
    other = type(exc).__name__
json.dump({{"body": body, "other": other}}, sys.stdout)
"""


@pytest.fixture
async def server() -> AsyncIterator[int]:
    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.receive()
            await stream.send(b"HTTP/1.0 200 OK\r\nContent-Length: 7\r\n\r\nfetched")

    lst = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with lst, anyio.create_task_group() as tg:
        tg.start_soon(lst.serve, handle)
        yield lst.extra(anyio.abc.SocketAttribute.local_port)
        tg.cancel_scope.cancel()


async def test_staged_job_behind_the_wall(tmp_path: Path, server: int) -> None:
    world = make_world(tmp_path)
    await staging_works(world)
    try:
        folder = tmp_path / "executors" / "netwrite"
        folder.mkdir(parents=True)
        (folder / "manifest.toml").write_text(MANIFEST.format(port=server))
        (folder / "main.py").write_text(MAIN.format(port=server, secret=server + 1))
        world.registry = ExecutorRegistry.load(tmp_path / "executors")
        job = Job(executor="netwrite", args={})
        await world.broker.submit(job)
        await world.burst()
        result = await world.broker.get_result(job.id)
        assert result is not None and result.status == "succeeded", result
        assert result.output == {"body": "fetched", "other": "ConnectionRefusedError"}
        assert (world.notes / "fetched.txt").read_text() == "fetched"  # committed
        assert result.containment is not None
        assert result.containment.network.state == "kept"
        assert f"egress limited to 127.0.0.1:{server}" in result.containment.network.reason
        assert [(r.host, r.port, r.allowed) for r in result.egress] == [("127.0.0.1", server, True)]
    finally:
        await world.staging.aclose()
