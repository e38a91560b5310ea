"""Processes for the gateway tests: stub backends, gateways, Redis and replicas.

Each starts on a free loopback port and is ready when its health endpoint answers
(polled, never slept on). Test modules hold them in module-scoped fixtures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from prefixgate.procs import free_port, stop_process, wait_http_ok


@dataclass(slots=True)
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        stop_process(self.proc, grace_s=5)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start(
    args: Sequence[str],
    port: int,
    workdir: Path,
    name: str,
    health: str = "/health",
    preexec_fn: Callable[[], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> Server:
    """``python ARGS``, ready when ``health`` answers 200; ``env`` adds to this
    process's environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec_fn,
            env=None if env is None else {**os.environ, **env},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + health, timeout=120, procs=[proc])
    except Exception as exc:
        stop_process(proc, grace_s=2)
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name} did not start:\n{tail}") from exc
    return Server(proc, url, log)


def start_stub(workdir: Path, name: str, *flags: str) -> Server:
    port = free_port()
    args = ["-m", "tests.support.stub_backend", "--port", str(port), *flags]
    return start(args, port, workdir, name)


def start_gateway(
    workdir: Path,
    name: str,
    replicas: Sequence[str],
    *flags: str,
    ready: bool = True,
    env: Mapping[str, str] | None = None,
) -> Server:
    port = free_port()
    args = ["-m", "prefixgate", "gateway", "--port", str(port), "--probe-interval-s", "0.5"]
    for url in replicas:
        args += ["--replica", url]
    return start([*args, *flags], port, workdir, name, "/ready" if ready else "/health", env=env)


def start_replica(workdir: Path, name: str, *flags: str) -> Server:
    port = free_port()
    args = ["-m", "prefixgate", "replica", "--model", "tiny-random", "--port", str(port), *flags]
    return start(args, port, workdir, name)


def write_api_keys(path: Path) -> Path:
    keys = {
        "sk-alpha": {"tenant": "alpha"},
        "sk-beta": {"tenant": "beta"},
        "sk-shared": {"tenant": "docs", "shared_namespace": True},
        "sk-ops": {"tenant": "ops", "admin": True},
    }
    path.write_text(json.dumps(keys))
    return path


class OpenAndKeyed:
    """A stub engine serving ``model`` behind two gateways: one in open mode, one in keyed
    mode with ``write_api_keys``'s keys."""

    def __init__(self, root: Path, model: str) -> None:
        self.stub = start_stub(root, "stub", "--model", model)
        keys = str(write_api_keys(root / "keys.json"))
        self.open = start_gateway(root, "open", [self.stub.url])
        self.keyed = start_gateway(root, "keyed", [self.stub.url], "--api-keys", keys)

    def stop(self) -> None:
        for server in (self.keyed, self.open, self.stub):
            server.stop()

    def received(self, path: str) -> list[dict[str, Any]]:
        """What the stub was sent on ``path`` (its recent requests)."""
        requests = httpx.get(self.stub.url + "/stub/requests").json()
        return [r for r in requests if r.get("path") == path]


@dataclass(slots=True)
class StubCluster:
    gateway: Server
    stubs: list[Server]

    def received(self, path: str) -> list[dict[str, Any]]:
        """What the stubs were sent on ``path`` (their recent requests)."""
        seen = [httpx.get(s.url + "/stub/requests").json() for s in self.stubs]
        return [r for requests in seen for r in requests if r.get("path") == path]


@contextmanager
def stub_cluster(workdir: Path, model: str, engines: int = 2) -> Iterator[StubCluster]:
    """A gateway in front of ``engines`` stub backends serving ``model``."""
    stubs = [start_stub(workdir, f"engine-{i}", "--model", model) for i in range(engines)]
    try:
        gateway = start_gateway(workdir, "gateway", [s.url for s in stubs], "--model", model)
        try:
            yield StubCluster(gateway, stubs)
        finally:
            gateway.stop()
    finally:
        for stub in stubs:
            stub.stop()
