"""Run a module's async wasm tests twice: each job in a fresh process, and each job in a
spare process of `spare_processes` (entered around the test, on the test's own loop).

A test module imports `wasm_spares` and `spare_pool` and defines
``pytest_generate_tests = parametrize_spares``; its sync tests (their own `anyio.run`
loops, which a pool never serves) run once."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from metnos_exec.sandbox import wasm


def parametrize_spares(metafunc: pytest.Metafunc) -> None:
    if inspect.iscoroutinefunction(metafunc.function):
        metafunc.parametrize("wasm_spares", ["fresh", "spare"], indirect=True)


@pytest.fixture(autouse=True)
def wasm_spares(request: pytest.FixtureRequest) -> str:
    """``spare``: the test's wasm jobs are served by spare processes (see `spare_pool`)."""
    mode = str(getattr(request, "param", "fresh"))
    if mode == "spare":
        request.getfixturevalue("spare_pool")
    return mode


@pytest.fixture
async def spare_pool(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    cache: Path | None = None
    for name in ("wasm_cache", "wasm_setup"):
        if name in request.fixturenames:
            value = request.getfixturevalue(name)
            cache = value if isinstance(value, Path) else value.get("cache")
    async with wasm.spare_processes(1, cache_dir=cache):
        yield


async def spares_settled(timeout: float = 30.0, count: int = 1) -> None:  # noqa: ASYNC109
    """Wait (polling with a deadline) until the pool, if one is entered, has `count`
    spares waiting: what the worker holds for them is then the same before and after a
    job."""
    deadline = anyio.current_time() + timeout
    while wasm._pool is not None and len(wasm.waiting_spares()) < count:
        assert anyio.current_time() < deadline, "no spare started"
        await anyio.sleep(0.01)
