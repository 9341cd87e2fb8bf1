"""A bare consumer process for the SQLite multi-process tests (no supervisor).

python _consumer.py drain DB RECORD WORKER BACKEND GO OTHER
    lease -> record id -> ack, until empty; the first batch is held until OTHER (the
    other consumer's record) has leased its own first batch too
python _consumer.py hold DB READY VISIBILITY_S BACKEND   lease one job, report it, hang
python _consumer.py answer DB READY COUNT BACKEND POLL_S   wait for work (polling every
    POLL_S), lease, ack with output {"by": "answer"}, COUNT times
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.messages import Result


async def _wait_for(path: str) -> None:
    # Another process signals through the file system: polled.
    with anyio.fail_after(60):
        while not Path(path).exists():  # noqa: ASYNC110, ASYNC240
            await anyio.sleep(0.005)


async def drain(db: str, record: str, worker: str, go: str, other: str) -> None:
    async with SQLiteBroker(db, poll_interval_s=0.01) as broker:
        # A start line: both processes begin leasing together.
        Path(record + ".ready").touch()  # noqa: ASYNC240
        await _wait_for(go)
        first = True
        # A test helper's small local file: blocking writes are fine here.
        with open(record, "a", buffering=1) as out:  # noqa: ASYNC230
            while True:
                leases = await broker.lease(worker, visibility_s=60, limit=8)
                if first and leases:
                    # Both hold leases at once before either acks: they really compete,
                    # by construction rather than by the luck of scheduling.
                    first = False
                    Path(record + ".first").touch()  # noqa: ASYNC240
                    await _wait_for(other + ".first")
                if not leases:
                    stats = await broker.stats()
                    if stats.queued == 0:
                        return
                    await broker.wait_for_work(0.05)
                    continue
                for lease in leases:
                    # Recorded before the ack: a job run twice would show up in both files.
                    out.write(lease.job.id + "\n")
                    result = Result(
                        job_id=lease.job.id,
                        status="succeeded",
                        output={"by": worker},
                        worker=worker,
                        attempt=lease.attempt,
                    )
                    if not await broker.ack(lease, result):
                        raise SystemExit(f"lost lease on {lease.job.id}")


async def hold(db: str, ready: str, visibility_s: float) -> None:
    async with SQLiteBroker(db) as broker:
        while not (leases := await broker.lease("doomed", visibility_s=visibility_s)):
            await broker.wait_for_work(0.05)
        # As a worker does before it launches the executor: this delivery now counts.
        assert await broker.mark_started(leases[0])
        tmp = Path(ready + ".tmp")
        tmp.write_text(f"{leases[0].job.id} {leases[0].attempt}\n")  # noqa: ASYNC240
        tmp.rename(ready)  # noqa: ASYNC240 (atomic: the test never reads half a line)
        await anyio.sleep_forever()


async def answer(db: str, ready: str, count: int, poll_s: float) -> None:
    async with SQLiteBroker(db, poll_interval_s=poll_s) as broker:
        Path(ready).touch()  # noqa: ASYNC240
        for _ in range(count):
            while not (leases := await broker.lease("answer", visibility_s=60)):
                await broker.wait_for_work(3600)
            result = Result(
                job_id=leases[0].job.id, status="succeeded", output={"by": "answer"}, worker="a"
            )
            assert await broker.ack(leases[0], result)


def main(argv: list[str]) -> int:
    mode, db, path = argv[:3]
    if mode == "drain":
        anyio.run(drain, db, path, argv[3], argv[5], argv[6], backend=argv[4])
    elif mode == "hold":
        anyio.run(hold, db, path, float(argv[3]), backend=argv[4])
    elif mode == "answer":
        anyio.run(answer, db, path, int(argv[3]), float(argv[5]), backend=argv[4])
    else:
        raise SystemExit(f"unknown mode {mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
