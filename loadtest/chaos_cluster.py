"""A local cluster whose parts a chaos experiment can kill, pause and restart.

Built from ``prefixgate up``'s own pieces (its replica and gateway commands, its process
``Stack``, the embedded Redis of ``prefixgate.procs``), but without ``up``'s supervision,
which stops everything when one child dies: here a dead child is the experiment. Every
part listens on loopback. Restarted parts come back on the same port, so clients and the
gateway's static replica list stay valid.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixgate import up
from prefixgate.procs import free_port, start_redis, stop_process, wait_http_ok
from prefixgate.stack import Child, Stack, kill_group, pick_ports

READY_TIMEOUT_S = 180.0


@dataclass(slots=True)
class ChaosCluster:
    """Redis, N replicas and one gateway, children of one ``Stack``; ports fixed at launch."""

    args: argparse.Namespace  # prefixgate up's arguments: its commands are built from them
    stack: Stack
    redis_port: int
    replica_ports: list[int]
    gateway_flags: list[str]  # added to the gateway's command, e.g. timeouts
    redis: subprocess.Popen[bytes] | None = None

    @classmethod
    def launch(
        cls,
        run_dir: Path,
        model: str,
        replicas: int,
        num_blocks: int,
        gateway_flags: Sequence[str] = (),
    ) -> ChaosCluster:
        """Start every part and return once the gateway sees every replica healthy."""
        run_dir.mkdir(parents=True, exist_ok=True)
        gateway_port = free_port()
        redis_port, *replica_ports = pick_ports(1 + replicas, {gateway_port})
        flags = f"--replicas {replicas} --num-blocks {num_blocks} --port {gateway_port}"
        args = up.parse_args([*flags.split(), "--model", model, "--run-dir", str(run_dir)])
        stack = Stack(run_dir=run_dir, env=up.child_env(args))
        cluster = cls(args, stack, redis_port, replica_ports, list(gateway_flags))
        try:
            cluster.start_redis()
            for i in range(replicas):
                cluster.start_replica(i, wait=False)
            cluster.start_gateway(wait=False)
            for url in cluster.replica_urls:
                wait_http_ok(f"{url}/health", READY_TIMEOUT_S, procs=cluster._procs())
            cluster.wait_gateway_ready(min_replicas=replicas)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def run_dir(self) -> Path:
        return self.stack.run_dir

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def gateway_port(self) -> int:
        return int(self.args.port)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.replica_ports]

    def replica_id(self, index: int) -> str:
        """The name the gateway gives replica ``index`` (its ``host:port``)."""
        return f"127.0.0.1:{self.replica_ports[index]}"

    def _procs(self) -> list[subprocess.Popen[bytes]]:
        return [c.proc for c in self.stack.children]

    def child(self, name: str) -> Child:
        return next(c for c in reversed(self.stack.children) if c.name == name)

    def _start_child(self, name: str, cmd: list[str], port: int, stage: int) -> Child:
        self.stack.children = [c for c in self.stack.children if c.name != name]
        return self.stack.start(name, cmd, port, stage=stage)

    # ---------------------------------------------------------------------- parts

    def start_redis(self) -> None:
        self.redis = start_redis(
            self.redis_port, self.run_dir / "redis", self.run_dir / "redis.log"
        )

    def kill_redis(self) -> None:
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(timeout=10)
            self.redis = None

    def start_replica(self, index: int, wait: bool = True) -> None:
        port = self.replica_ports[index]
        cmd = up.replica_command(self.args, index, port, self.redis_url)
        self._start_child(f"replica-{index}", cmd, port, stage=1)
        if wait:
            wait_http_ok(f"{self.replica_urls[index]}/health", READY_TIMEOUT_S, self._procs())

    def signal_replica(self, index: int, sig: signal.Signals) -> None:
        """Send ``sig`` to the replica process alone (not its process group)."""
        self.child(f"replica-{index}").proc.send_signal(sig)

    def start_gateway(self, wait: bool = True) -> None:
        cmd = up.gateway_command(self.args, self.replica_urls, self.redis_url)
        self._start_child("gateway", [*cmd, *self.gateway_flags], self.gateway_port, stage=2)
        if wait:
            self.wait_gateway_ready(min_replicas=1)

    def stop_gateway(self) -> int | None:
        return stop_process(self.child("gateway").proc, grace_s=15)

    def wait_gateway_ready(self, min_replicas: int) -> None:
        url = f"{self.gateway_url}/ready?min_replicas={min_replicas}"
        wait_http_ok(url, READY_TIMEOUT_S, procs=[self.child("gateway").proc])

    # -------------------------------------------------------------------- reading

    def get_json(self, url: str, timeout_s: float = 5.0) -> Any:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def router_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.get_json(f"{self.gateway_url}/router/stats")
        return stats

    def cache_stats(self, index: int) -> dict[str, Any]:
        stats: dict[str, Any] = self.get_json(f"{self.replica_urls[index]}/cache/stats")
        return stats

    def busiest_replica(self) -> int:
        """The index of the replica the gateway has routed the most cached blocks to."""
        view = self.router_stats()["replicas"]
        blocks = [
            int(view.get(self.replica_id(i), {}).get("blocks", 0))
            for i in range(len(self.replica_ports))
        ]
        return max(range(len(blocks)), key=blocks.__getitem__)

    def stale_blocks(self, settle_s: float = 20.0) -> dict[str, int]:
        """Per replica, how many more blocks the gateway's view holds than the replica
        caches, once the view has caught up (polled until it matches, or ``settle_s``)."""
        deadline = time.monotonic() + settle_s
        while True:
            view = self.router_stats()["replicas"]
            excess = {}
            for i in range(self.args.replicas):
                cached = int(self.cache_stats(i)["cached_blocks"])
                excess[self.replica_id(i)] = max(0, view[self.replica_id(i)]["blocks"] - cached)
            if not any(excess.values()) or time.monotonic() > deadline:
                return excess
            time.sleep(0.5)  # polling interval

    def wait_quiet(self, timeout_s: float = 30.0) -> tuple[dict[str, int], int, float]:
        """Pinned blocks per replica and requests in flight at the gateway once both are 0,
        or as they are after ``timeout_s``; and how long that took."""
        t0 = time.monotonic()
        while True:
            pinned = {
                self.replica_id(i): int(self.cache_stats(i)["pinned_blocks"])
                for i in range(self.args.replicas)
            }
            view = self.router_stats()["replicas"]
            in_flight = sum(int(v["in_flight"]) for v in view.values())
            waited = time.monotonic() - t0
            if (not any(pinned.values()) and in_flight == 0) or waited > timeout_s:
                return pinned, in_flight, waited
            time.sleep(0.5)  # polling interval

    def rss_kib(self) -> dict[str, int | None]:
        """Resident memory of every live child (KiB, from /proc), by name."""
        out: dict[str, int | None] = {}
        for c in self.stack.children:
            out[c.name] = _vm_rss_kib(c.proc.pid) if c.proc.poll() is None else None
        return out

    def stop(self) -> None:
        for c in self.stack.children:  # a paused child cannot act on SIGTERM
            if c.proc.poll() is None:
                kill_group(c.proc.pid, signal.SIGCONT)
        self.stack.stop_all(grace_s=10)
        if self.redis is not None:
            stop_process(self.redis)
            self.redis = None


def _vm_rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
