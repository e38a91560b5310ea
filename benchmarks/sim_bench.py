"""What a simulated-engine replica costs this machine: start-up, memory, idle CPU.

    python benchmarks/sim_bench.py replica            # one replica, 5 starts
    python benchmarks/sim_bench.py up --replicas 16   # a whole `prefixgate up --model sim`

``replica``: seconds from process start to its first healthy /health (and the CPU
seconds the process used until then, which depend less on other load), RSS after serving
a few requests, and CPU seconds used over a 10 s idle window (publishing heartbeats to
an embedded Redis, as in a cluster). ``up``: seconds until ``prefixgate up`` has written
its ``ready`` file (every replica healthy in the gateway's view), RSS of every child
(replicas, gateway, Redis) and the cluster's idle CPU over 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prefixgate.procs import free_port, start_redis, stop_process, wait_http_ok

IDLE_WINDOW_S = 10.0
TICK = os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def complete(url: str, prompt: str) -> None:
    body = json.dumps({"model": "sim", "prompt": prompt, "max_tokens": 16}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        resp.read()


def bench_replica(starts: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        redis_port = free_port()
        redis = start_redis(redis_port, Path(tmp) / "redis")
        times, start_cpu, rss, idle = [], [], [], []
        try:
            for _ in range(starts):
                port = free_port()
                cmd = [sys.executable, "-m", "prefixgate", "replica", "--model", "sim"]
                cmd += ["--port", str(port), "--redis-url", f"redis://127.0.0.1:{redis_port}/0"]
                cmd += ["--log-level", "warning"]
                started = time.perf_counter()
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                url = f"http://127.0.0.1:{port}"
                try:
                    wait_http_ok(url + "/health", timeout=60, procs=[proc])
                    times.append(time.perf_counter() - started)
                    start_cpu.append(cpu_s(proc.pid))
                    for i in range(5):
                        complete(url, f"request {i}: " + "words of a prompt " * 50)
                    rss.append(rss_mb(proc.pid))
                    before = cpu_s(proc.pid)
                    time.sleep(IDLE_WINDOW_S)  # the idle window being measured
                    idle.append((cpu_s(proc.pid) - before) / IDLE_WINDOW_S)
                finally:
                    stop_process(proc)
        finally:
            stop_process(redis)
    return {
        "starts": starts,
        "startup_s_median": round(statistics.median(times), 2),
        "startup_s_max": round(max(times), 2),
        "startup_cpu_s_median": round(statistics.median(start_cpu), 2),
        "rss_mb_median": round(statistics.median(rss), 1),
        "idle_cpu_fraction_median": round(statistics.median(idle), 4),
    }


def bench_up(replicas: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "prefixgate", "up", "--model", "sim"]
        cmd += ["--replicas", str(replicas), "--port", str(free_port()), "--run-dir", str(run_dir)]
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not (run_dir / "ready").exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"prefixgate up exited with {proc.returncode}")
                time.sleep(0.1)  # polling interval
            ready_s = time.perf_counter() - started
            pids = {}
            for line in (run_dir / "pids").read_text().splitlines():
                name, pid, _port = line.split()
                pids[name] = int(pid)
            replica_rss = [rss_mb(p) for n, p in pids.items() if n.startswith("replica")]
            total_rss = sum(rss_mb(p) for p in pids.values())
            before = sum(cpu_s(p) for p in pids.values())
            time.sleep(IDLE_WINDOW_S)  # the idle window being measured
            idle = (sum(cpu_s(p) for p in pids.values()) - before) / IDLE_WINDOW_S
        finally:
            stop_process(proc, grace_s=60)
    return {
        "replicas": replicas,
        "ready_s": round(ready_s, 1),
        "rss_mb_total": round(total_rss),
        "rss_mb_per_replica_median": round(statistics.median(replica_rss), 1),
        "idle_cpu_cores": round(idle, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["replica", "up"])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args()
    result = bench_replica(args.starts) if args.what == "replica" else bench_up(args.replicas)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
