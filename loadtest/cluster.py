"""A local ``prefixgate up`` cluster driven from a benchmark: start, wait until ready,
read its replicas' cache statistics and CPU time, reset its caches, stop; and more
gateways joined to its Redis and replicas (``join_gateway``), each a router of its own in
front of the same replicas.

The replicas are found through the ``pids`` file that ``prefixgate up`` keeps in its run
directory (``name pid port`` per line).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixgate.procs import ChildDied, free_port, stop_process, wait_http_ok

RESET_TRIES = 10  # resets in a row (each waits up to 5 s for the events) before giving up
IDLE_TIMEOUT_S = 30.0  # for a gateway to see the previous cell's load leave its replicas
# The /cache/stats fields that count events (the others are gauges: block counts).
COUNTERS = ("queries", "hits", "misses", "hit_tokens", "query_tokens", "evictions", "expirations")


@dataclass(slots=True)
class Cluster:
    """A running ``prefixgate up``: its process, run directory and OpenAI base URL."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    base_url: str

    def children(self) -> list[tuple[str, int, int]]:
        """``(name, pid, port)`` of every child of ``prefixgate up`` (redis, replica-<i>,
        gateway), from the ``pids`` file it keeps: ``name pid port`` per line."""
        out = []
        for line in (self.run_dir / "pids").read_text().splitlines():
            name, pid, port = line.split()
            out.append((name, int(pid), int(port)))
        return out

    def replica_urls(self) -> dict[str, str]:
        return {
            name: f"http://127.0.0.1:{port}"
            for name, _pid, port in self.children()
            if name.startswith("replica")
        }

    def names_by_address(self) -> dict[str, str]:
        """``host:port`` → replica name: the gateway may name a replica either way."""
        return {url.removeprefix("http://"): name for name, url in self.replica_urls().items()}

    def cache_stats(self) -> dict[str, dict[str, Any]]:
        stats = {}
        for name, url in self.replica_urls().items():
            with urllib.request.urlopen(f"{url}/cache/stats", timeout=10) as resp:
                stats[name] = json.loads(resp.read())
        return stats

    def pids(self) -> dict[str, int]:
        """Every child of ``prefixgate up`` by name."""
        return {name: pid for name, pid, _port in self.children()}

    def redis_url(self) -> str:
        """The embedded Redis that the replicas publish to and the gateway follows."""
        for name, _pid, port in self.children():
            if name == "redis":
                return f"redis://127.0.0.1:{port}/0"
        raise RuntimeError("the cluster has no embedded Redis")

    def replica_cpu_seconds(self) -> float | None:
        """CPU seconds (user + system) the replica processes have used so far, from
        /proc (None where there is none): what a replay costs the cores they share."""
        used = [cpu_seconds(pid) for name, pid in self.pids().items() if name.startswith("replica")]
        return None if None in used else sum(u for u in used if u is not None)

    def gateway_pid(self) -> int:
        return self.pids()["gateway"]

    def reset_prefix_cache(self) -> None:
        """Empty every replica's cache and the router's view (the gateway's endpoint)."""
        self.reset_through(self.base_url)

    def reset_through(self, base_url: str) -> None:
        """``POST /reset_prefix_cache`` on the gateway at ``base_url`` (this cluster's or
        one joined to it): every replica's cache and that gateway's view of them emptied;
        raises unless every replica answered and none still holds a block. Repeated while
        the gateway says some replica's ``cleared`` event has not reached it yet (a gateway
        just resumed is still folding in older events, which must not outlive the reset)."""
        gateway = base_url.removesuffix("/v1")
        for _ in range(RESET_TRIES):
            request = urllib.request.Request(f"{gateway}/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(request, timeout=60) as resp:  # raises on 4xx/5xx
                answer = json.loads(resp.read())
            if not any("warning" in a for a in answer["replicas"].values()):
                break
        else:
            raise RuntimeError(f"prefix cache reset: the gateway stayed behind: {answer}")
        left = {n: s["cached_blocks"] for n, s in self.cache_stats().items() if s["cached_blocks"]}
        if left or len(answer["replicas"]) != len(self.replica_urls()):
            raise RuntimeError(f"prefix cache reset incomplete: {answer}, still cached {left}")
        wait_router_idle(gateway)

    def warm_up(self, model: str) -> None:
        """One short request on every replica: a fresh process's first forward pays
        one-time costs no cell should be charged for (the next reset drops its blocks)."""
        body = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        ).encode()
        for url in self.replica_urls().values():
            request = urllib.request.Request(
                f"{url}/v1/chat/completions",
                data=body,
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as resp:
                resp.read()

    def stop(self) -> None:
        stop_process(self.proc, grace_s=30.0)  # `up` stops its own children on SIGTERM


@dataclass(slots=True)
class JoinedGateway:
    """A ``prefixgate gateway`` joined to ``host``'s Redis and replicas: one more router in
    front of the same replicas. Cache counters, CPU time and replica names are the
    host's; a cache reset goes through this gateway, so that its own view starts empty."""

    proc: subprocess.Popen[bytes]
    host: Cluster
    base_url: str

    def reset_prefix_cache(self) -> None:
        self.host.reset_through(self.base_url)

    def cache_stats(self) -> dict[str, dict[str, Any]]:
        return self.host.cache_stats()

    def replica_cpu_seconds(self) -> float | None:
        return self.host.replica_cpu_seconds()

    def names_by_address(self) -> dict[str, str]:
        return self.host.names_by_address()

    def gateway_pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        stop_process(self.proc, grace_s=10.0)


def launch_gateway(
    host: Cluster,
    model: str,
    policy: str,
    log_path: Path,
    router_options: Sequence[str] = (),
) -> JoinedGateway:
    """Start ``prefixgate gateway`` on ``host``'s Redis with every one of its replicas as
    a static ``--replica``, as ``prefixgate up`` starts its own (returns at once;
    ``wait_gateway`` waits for it)."""
    port = free_port()
    cmd = [sys.executable, "-m", "prefixgate", "gateway", "--model", model]
    cmd += ["--port", str(port), "--redis-url", host.redis_url(), "--policy", policy]
    for url in host.replica_urls().values():
        cmd += ["--replica", url]
    for option in router_options:
        cmd += ["--router-option", option]
    return JoinedGateway(spawn_logged(cmd, log_path), host, f"http://127.0.0.1:{port}/v1")


def wait_gateway(gateway: JoinedGateway, timeout_s: float) -> None:
    """Until the gateway sees every one of its host's replicas healthy."""
    n = len(gateway.host.replica_urls())
    ready = gateway.base_url.removesuffix("/v1") + f"/ready?min_replicas={n}"
    wait_http_ok(ready, timeout_s, procs=[gateway.proc])


def join_gateway(
    host: Cluster,
    model: str,
    policy: str,
    log_path: Path,
    timeout_s: float = 120.0,
    router_options: Sequence[str] = (),
) -> JoinedGateway:
    """``launch_gateway`` and ``wait_gateway``; stopped again if it never gets ready."""
    gateway = launch_gateway(host, model, policy, log_path, router_options)
    try:
        wait_gateway(gateway, timeout_s)
    except BaseException:
        gateway.stop()
        raise
    return gateway


@dataclass(slots=True)
class IdleGateways:
    """Gateways in front of one set of replicas, every one but the one a cell needs
    stopped (SIGSTOP): an idle gateway would otherwise fold in every block event and
    routing hint of another gateway's cell, CPU time taken from the gateway under test,
    the replicas and the load client on a small machine. A resumed gateway catches up
    on the replicas' event streams before its cell: it is ready again
    (``/ready?min_replicas=N``) and its reset waits for the events (``reset_through``)."""

    gateways: dict[str, tuple[int, str]]  # row -> (pid, base URL)
    replicas: int
    ready_timeout_s: float
    stopped: set[str] = field(default_factory=set)

    def only(self, row: str | None) -> None:
        """``row``'s gateway running and ready (None: none), every other one stopped."""
        for name, (pid, _url) in self.gateways.items():
            if name != row and name not in self.stopped:
                os.kill(pid, signal.SIGSTOP)
                self.stopped.add(name)
        if row is not None and row in self.stopped:
            pid, url = self.gateways[row]
            os.kill(pid, signal.SIGCONT)
            self.stopped.discard(row)
            ready = url.removesuffix("/v1") + f"/ready?min_replicas={self.replicas}"
            wait_http_ok(ready, self.ready_timeout_s)

    def resume_all(self) -> None:
        for name in sorted(self.stopped):
            with contextlib.suppress(ProcessLookupError):  # already gone: nothing to resume
                os.kill(self.gateways[name][0], signal.SIGCONT)
        self.stopped.clear()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is first
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pids: Sequence[int]) -> float:
    """Resident memory of these processes together, in MB (gone ones count 0)."""
    total_kb = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total_kb += int(line.split()[1])
    return total_kb / 1024


def launch_cluster(
    n_replicas: int,
    model: str,
    policy: str,
    num_blocks: int,
    run_dir: Path,
    router_options: Sequence[str] = (),
    gateway_workers: int = 1,
) -> Cluster:
    """Start ``prefixgate up`` (returns at once; ``wait_ready`` waits for it)."""
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "ready").unlink(missing_ok=True)  # a previous run's, not this cluster's
    cmd = [sys.executable, "-m", "prefixgate", "up", "--replicas", str(n_replicas)]
    cmd += ["--model", model, "--port", str(port), "--policy", policy]
    cmd += ["--gateway-workers", str(gateway_workers)]
    cmd += ["--num-blocks", str(num_blocks), "--run-dir", str(run_dir)]
    for option in router_options:
        cmd += ["--router-option", option]
    return Cluster(spawn_logged(cmd, run_dir / "up.log"), run_dir, f"http://127.0.0.1:{port}/v1")


def launch_up(run_dir: Path, *args: str, preexec_fn: Callable[[], None] | None = None) -> Cluster:
    """``prefixgate up ARGS`` on a free port with ``run_dir`` as its run directory
    (returns at once; ``wait_ready`` waits for it). ``preexec_fn`` runs in the child
    before it starts (a resource limit its children inherit, say)."""
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "ready").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "prefixgate", "up", *args]
    cmd += ["--port", str(port), "--run-dir", str(run_dir)]
    proc = spawn_logged(cmd, run_dir / "up.log", preexec_fn)
    return Cluster(proc, run_dir, f"http://127.0.0.1:{port}/v1")


def spawn_logged(
    cmd: list[str], log_path: Path, preexec_fn: Callable[[], None] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a session of its own (a signal to the bench does not reach it;
    the bench stops it), its output appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )


def wait_ready(cluster: Cluster, timeout_s: float) -> None:
    wait_for_file(cluster.run_dir / "ready", cluster.proc, timeout_s)
    gateway = cluster.base_url.removesuffix("/v1")
    wait_http_ok(f"{gateway}/ready", 30, procs=[cluster.proc])


def wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """``prefixgate up`` writes ``ready`` once every replica and the gateway answer."""
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if proc.poll() is not None:
            raise ChildDied(f"prefixgate up exited with {proc.returncode}; see {path.parent}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster not ready within {timeout_s:.0f} s; see {path.parent}")
        time.sleep(0.2)  # polling interval


def cluster_hit_rate(stats: dict[str, dict[str, Any]]) -> float | None:
    """Hit tokens over queried tokens, summed over every replica's prefix cache."""
    hit = sum(int(s.get("hit_tokens", 0)) for s in stats.values())
    queried = sum(int(s.get("query_tokens", 0)) for s in stats.values())
    return hit / queried if queried else None


def stats_delta(
    after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per-replica counters accrued between two /cache/stats readings."""
    out = {}
    for name, now in after.items():
        then = before.get(name, {})
        out[name] = {k: v - then.get(k, 0) if k in COUNTERS else v for k, v in now.items()}
    return out


def wait_router_idle(gateway: str, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Poll the gateway's ``/router/stats`` until it sees nothing in flight and no
    prefill queued on any replica. With replicas shared between rows, what they last
    reported of the previous cell (another gateway's requests, in a heartbeat up to a
    second old, counted for ``report_ttl_s``) would otherwise steer the first decisions
    of the next: a burst placed around replicas that only look busy stays there for its
    sessions' turns. Raises after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{gateway}/router/stats", timeout=10) as resp:
            replicas = json.loads(resp.read())["replicas"]
        busy = {r: (v["load"], v["queued_tokens"]) for r, v in replicas.items()}
        busy = {r: v for r, v in busy.items() if any(v)}
        if not busy:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway still sees load after {timeout_s:.0f} s: {busy}")
        time.sleep(0.1)  # the next heartbeat (every second) clears the previous cell's
