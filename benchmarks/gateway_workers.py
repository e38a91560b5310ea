"""One gateway process against several (``prefixgate gateway --workers N``), side by side.

    .venv/bin/python benchmarks/gateway_workers.py [--workers 1 2] [--rounds 3]
        [--requests 1500] [--concurrency 64]

A stub backend (tests/support/stub_backend.py: it costs nothing, so the figures measure
the gateway), Redis, and one gateway per ``--workers`` value, all running at once; each
round sends every workload to every gateway in rotated order (closed loop, aiohttp, its
own process). Per gateway and workload: requests/s, latency p50/p99 of the whole answer,
errors, the CPU the gateway's processes used (parent and workers) per request, and
their resident memory after the run.

Workloads (the work a gateway does per request, not the engine's):

* ``agent``: a chat with 30 tool definitions (about 6.4k tokens, tests/support/
  tool_template.jinja rendered and tokenized with tiny-random's tokenizer, as an agent's
  turn is), the question different every time, answered whole;
* ``stream``: a short chat answered as 100 streamed chunks 5 ms apart (an engine's
  decode steps), each relayed by the gateway.

``--tree NAME=PATH`` (repeatable): gateways of other source trees too (``git worktree
add /tmp/before REV``), in the same rotation; by default this tree only.
``--gc-probe``: each gateway process records its garbage collections (``gc.callbacks``,
through a ``sitecustomize`` put on its ``PYTHONPATH``, so any tree's gateway can be
probed): per workload, the collections, their time per request and the longest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from agents_bench import TEMPLATE, start, tools  # noqa: E402

from prefixgate.procs import free_port, start_redis, stop_process, wait_http_ok  # noqa: E402

MODEL = "tiny-random"
CHUNKS = 100
CHUNK_INTERVAL_MS = 5.0


def bodies(workload: str, n: int) -> list[dict[str, Any]]:
    if workload == "agent":
        defs = tools(0, 30)
        return [
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "You are an operations agent."},
                    {"role": "user", "content": f"Request {i}: list my open tickets"},
                ],
                "tools": defs,
                "max_tokens": 8,
            }
            for i in range(n)
        ]
    return [
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Question {i}: tell me about caches."}],
            "max_tokens": CHUNKS,
            "stream": True,
        }
        for i in range(n)
    ]


async def load(url: str, path: Path, concurrency: int) -> dict[str, Any]:
    import aiohttp

    payloads = [json.dumps(b).encode() for b in json.loads(path.read_text())]
    warm, payloads = payloads[:concurrency], payloads[concurrency:]
    total: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(body: bytes, record: bool) -> None:
            nonlocal errors
            started = time.perf_counter()
            async with session.post(
                url + "/v1/chat/completions",
                data=body,
                headers={"content-type": "application/json"},
            ) as resp:
                async for _ in resp.content.iter_any():
                    pass
                if resp.status != 200:
                    errors += 1
            if record:
                total.append(time.perf_counter() - started)

        await asyncio.gather(*(one(b, False) for b in warm))  # connections, caches
        queue = list(reversed(payloads))

        async def worker() -> None:
            while queue:
                await one(queue.pop(), True)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ordered = sorted(total)
    q = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "rps": len(total) / elapsed,
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "errors": errors,
        "measured": len(total),
    }


# Put on a gateway's PYTHONPATH as sitecustomize.py by --gc-probe: collections and their
# wall time, summed per process, and each pause of 1 ms or more with its end (wall
# clock), written to PREFIXGATE_GC_PROBE-PID.json every half second (the benchmark reads
# them between workloads).
GC_PROBE = """
import os
if os.environ.get("PREFIXGATE_GC_PROBE"):
    import gc, json, threading, time
    _out = os.environ["PREFIXGATE_GC_PROBE"] + f"-{os.getpid()}.json"
    _stats = {"collections": 0, "seconds": 0.0, "pauses": []}
    _start = [0.0]
    def _callback(phase, info):
        if phase == "start":
            _start[0] = time.perf_counter()
            return
        took = time.perf_counter() - _start[0]
        _stats["collections"] += 1
        _stats["seconds"] += took
        if took >= 0.001:
            _stats["pauses"].append((time.time(), took))
    gc.callbacks.append(_callback)
    def _write():
        while True:
            time.sleep(0.5)
            with open(_out + ".tmp", "w") as f:
                json.dump(_stats, f)
            os.replace(_out + ".tmp", _out)
    threading.Thread(target=_write, daemon=True).start()
"""


def gc_totals(prefix: Path, pids: list[int], since: float = 0.0) -> dict[str, Any]:
    """The probe's figures summed over ``pids`` (zeros for a process not written yet),
    and the longest pause that ended after ``since``."""
    total: dict[str, Any] = {"collections": 0, "seconds": 0.0, "longest": 0.0}
    for pid in pids:
        try:
            stats = json.loads(Path(f"{prefix}-{pid}.json").read_text())
        except (OSError, ValueError):
            continue
        total["collections"] += stats["collections"]
        total["seconds"] += stats["seconds"]
        late = [took for end, took in stats["pauses"] if end > since]
        total["longest"] = max([total["longest"], *late])
    return total


def fresh_gc_totals(prefix: Path, pids: list[int], since: float) -> dict[str, Any]:
    """``gc_totals(prefix, pids, since)`` once every process's file was written after
    this call."""
    now = time.time()
    deadline = time.monotonic() + 10
    for pid in pids:
        path = Path(f"{prefix}-{pid}.json")
        while not (path.exists() and path.stat().st_mtime > now):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} not written within 10 s")
            time.sleep(0.05)
    return gc_totals(prefix, pids, since)


def measured_load(
    url: str, pid: int, bodies_path: Path, concurrency: int, probe: Path | None
) -> tuple[dict[str, Any], float, str]:
    """One closed-loop run (the load generator in its own process) against the server
    ``pid`` (and its children): the generator's figures, the server's CPU seconds per
    request sent, and with a probe (``--gc-probe``) its collections during the run as a
    line to print ("" without)."""
    began = time.time()
    collected = gc_totals(probe, tree_pids(pid)) if probe is not None else {}
    cpu = tree_cpu_seconds(pid)
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--loadgen", url, str(bodies_path),
         str(concurrency)],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    cpu = tree_cpu_seconds(pid) - cpu
    r = json.loads(out.stdout.strip().splitlines()[-1])
    sent = r["measured"] + concurrency
    if probe is None:
        return r, cpu / sent, ""
    now = fresh_gc_totals(probe, tree_pids(pid), began)
    spent = (now["seconds"] - collected["seconds"]) / sent * 1e3
    gc_line = (
        f"  gc {now['collections'] - collected['collections']} collections, "
        f"{spent:.3f} ms/request, longest {now['longest'] * 1e3:.1f} ms"
    )
    return r, cpu / sent, gc_line


def tree_pids(pid: int) -> list[int]:
    """A process and its live children (the gateway's workers)."""
    pids = [pid]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                pids.append(int(entry))
    return pids


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its live children, MiB."""
    total = 0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1])
        except OSError:
            continue
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its live children (the gateway's workers)."""
    total = 0.0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=64, help="agent turns at once")
    parser.add_argument(
        "--stream-concurrency", type=int, default=512, help="streams at once (each ~0.5 s)"
    )
    parser.add_argument("--workloads", nargs="+", default=["agent", "stream"])
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH", help="another source tree"
    )
    parser.add_argument("--gc-probe", action="store_true", help="time the gateways' collections")
    parser.add_argument("--loadgen", nargs=3, metavar=("URL", "BODIES", "CONCURRENCY"))
    args = parser.parse_args()
    trees = {"this": ROOT}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        trees[name] = Path(path).resolve()
    if args.loadgen:
        url, path, conc = args.loadgen
        print(json.dumps(asyncio.run(load(url, Path(path), int(conc)))))
        return 0

    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="gateway-workers-") as tmp:
        tmpdir = Path(tmp)
        try:
            redis_port = free_port()
            procs.append(start_redis(redis_port, tmpdir / "redis"))
            redis_url = f"redis://127.0.0.1:{redis_port}"
            port = free_port()
            stub = start(
                ["-m", "tests.support.stub_backend", "--port", str(port), "--model", MODEL,
                 "--chunks", str(CHUNKS), "--chunk-interval-ms", str(CHUNK_INTERVAL_MS)],
                port, procs, tmpdir / "stub.log",
            )  # fmt: skip
            probe_dir = tmpdir / "gc-probe"
            if args.gc_probe:
                probe_dir.mkdir()
                (probe_dir / "sitecustomize.py").write_text(GC_PROBE)
            # (tree, workers) -> (URL, parent pid, the probe's file prefix)
            gateways: dict[tuple[str, int], tuple[str, int, Path]] = {}
            for name, tree in trees.items():
                for workers in args.workers:
                    port = free_port()
                    label = f"gateway-{name}-{workers}"
                    env = {}
                    if args.gc_probe:
                        env["PYTHONPATH"] = str(probe_dir)
                        env["PREFIXGATE_GC_PROBE"] = str(probe_dir / label)
                    url = start(
                        ["-m", "prefixgate", "gateway", "--port", str(port), "--replica", stub,
                         "--redis-url", redis_url, "--tokenizer", MODEL, "--chat-template",
                         str(TEMPLATE), "--workers", str(workers), "--log-level", "info"],
                        port, procs, tmpdir / f"{label}.log", cwd=tree, env=env,
                    )  # fmt: skip
                    wait_http_ok(url + "/ready", timeout=60, procs=procs)
                    gateways[(name, workers)] = (url, procs[-1].pid, probe_dir / label)
            files = {}
            conc = {"agent": args.concurrency, "stream": args.stream_concurrency}
            for workload in args.workloads:
                files[workload] = tmpdir / f"{workload}.json"
                n = args.requests + conc[workload]
                files[workload].write_text(json.dumps(bodies(workload, n)))
            print(
                f"stub backend, Redis, gateways of {', '.join(trees)} "
                f"with --workers {args.workers}; "
                f"{args.requests} requests per run after as many warm-up as run at once "
                f"(agent {args.concurrency}, stream {args.stream_concurrency}); "
                f"{os.cpu_count()} CPUs; "
                f"load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            order = list(gateways)
            for round_ in range(args.rounds):
                for workload in args.workloads:
                    for k in range(len(order)):
                        name, workers = order[(round_ + k) % len(order)]
                        url, pid, probe = gateways[(name, workers)]
                        r, cpu, gc_line = measured_load(
                            url, pid, files[workload], conc[workload],
                            probe if args.gc_probe else None,
                        )  # fmt: skip
                        print(
                            f"round {round_ + 1} {workload:<6} {name} workers {workers}: "
                            f"{r['rps']:7.1f} req/s  p50 {r['p50_ms']:7.1f} ms  "
                            f"p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}  "
                            f"gateway CPU {cpu * 1e3:.2f} ms/request "
                            f"({cpu * r['rps']:.2f} cores while loaded)  "
                            f"RSS {tree_rss_mb(pid):.0f} MiB  "
                            f"load {os.getloadavg()[0]:.1f}{gc_line}",
                            flush=True,
                        )
        finally:
            for proc in reversed(procs):
                stop_process(proc, grace_s=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
