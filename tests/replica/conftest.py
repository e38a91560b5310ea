"""A real tiny-random replica process under uvicorn, started once per test module."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from prefixgate.procs import free_port, stop_process, wait_http_ok
from tests.conftest import RedisServer

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-random"


@dataclass(slots=True)
class ReplicaProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs
        )

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)

    def cache_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.get("/cache/stats").json()
        return stats

    def metric(self, name: str) -> float:
        """Sum of a Prometheus sample (all label sets) from /metrics."""
        total = 0.0
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def start_replica(log_dir: Path, *args: str, redis_url: str | None = None) -> ReplicaProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "prefixgate", "replica", "--model", MODEL, "--port", str(port)]
    cmd += ["--num-blocks", "256", "--log-level", "info", *args]
    if redis_url is not None:
        cmd += ["--redis-url", redis_url, "--heartbeat-s", "0.2"]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"replica-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    replica = ReplicaProcess(proc, port, log_path)
    try:
        wait_http_ok(replica.url + "/health", timeout=180, procs=[proc])
    except Exception:
        stop_process(proc)
        raise AssertionError("replica did not become healthy:\n" + replica.log_tail()) from None
    return replica


def tool_replica(log_dir: Path, *args: str) -> Iterator[ReplicaProcess]:
    """A replica that parses tool calls (``--tool-call-parser hermes``) under the
    tool-aware test template, for a module fixture to yield from; stopped after."""
    template = str(REPO / "tests" / "support" / "tool_template.jinja")
    rep = start_replica(log_dir, "--tool-call-parser", "hermes", "--chat-template", template, *args)
    yield rep
    stop_process(rep.proc)


@pytest.fixture(scope="module")
def replica(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[ReplicaProcess]:
    """One tiny-random replica publishing to the module's Redis."""
    rep = start_replica(tmp_path_factory.mktemp("replica"), redis_url=module_redis.url)
    yield rep
    stop_process(rep.proc)
