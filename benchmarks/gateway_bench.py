"""Gateway overhead: the gateway in front of a stub backend vs calling the stub directly.

    .venv/bin/python benchmarks/gateway_bench.py [--requests 2000]
        [--tokenizer smollm2-135m] [--log-level info]

Stub, gateway and load generator each run in their own process (uvicorn with uvloop and
httptools where installed; the load generator is aiohttp). For each target it reports p50/p99
of time to first byte (response headers for plain answers, first body chunk for streams)
and of the full response, at concurrency 1 and 32, the requests/s reached at concurrency
32 (closed loop: the highest sustained rate on this machine), and the CPU time the serving
process (stub or gateway) spent per request — the figure least moved by other load on a
shared machine.

The stub's model has no tokenizer, so by default the gateway keys prompts by their bytes;
``--tokenizer NAME`` makes it render the chat template and tokenize as it does for a real
model. The gateway logs at ``--log-level`` (info: one JSON access line per request, as
deployed) into a temporary file.
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

from prefixgate.procs import free_port, stop_process, wait_http_ok  # noqa: E402

BODY = {
    "model": "stub-model",
    "messages": [{"role": "user", "content": "Say something short about caches. " * 8}],
    "max_tokens": 8,
}


async def load(url: str, concurrency: int, requests: int, stream: bool) -> dict[str, Any]:
    import aiohttp

    body = json.dumps({**BODY, "stream": stream}).encode()
    ttfb: list[float] = []
    total: list[float] = []
    errors = 0
    remaining = requests
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal errors
            start = time.perf_counter()
            async with session.post(
                url + "/v1/chat/completions",
                data=body,
                headers={"content-type": "application/json"},
            ) as resp:
                first: float | None = None if stream else time.perf_counter()
                async for _ in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                end = time.perf_counter()
                if resp.status != 200:
                    errors += 1
            ttfb.append((first or end) - start)
            total.append(end - start)

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await one()

        for _ in range(min(20, requests)):  # warm the connection pools
            await one()
        ttfb.clear()
        total.clear()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "ttfb_p50_ms": _pct(ttfb, 50),
        "ttfb_p99_ms": _pct(ttfb, 99),
        "total_p50_ms": _pct(total, 50),
        "total_p99_ms": _pct(total, 99),
        "rps": len(total) / elapsed,
        "errors": errors,
    }


def _pct(values: list[float], p: int) -> float:
    ordered = sorted(values)
    if len(ordered) < 2:
        return ordered[0] * 1e3
    return statistics.quantiles(ordered, n=100, method="inclusive")[p - 1] * 1e3


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_loadgen(
    url: str, concurrency: int, requests: int, stream: bool, server_pid: int
) -> dict[str, Any]:
    args = [sys.executable, __file__, "--loadgen", url, "--concurrency", str(concurrency)]
    args += ["--requests", str(requests)] + (["--stream"] if stream else [])
    cpu_before = cpu_seconds(server_pid)
    out = subprocess.run(args, check=True, capture_output=True, text=True, cwd=ROOT)
    cpu = cpu_seconds(server_pid) - cpu_before
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    # Includes the warm-up requests the load generator sends first.
    result["cpu_ms_per_request"] = cpu / (requests + min(20, requests)) * 1e3
    return result


def start(
    args: list[str], port: int, procs: list[subprocess.Popen[bytes]], log: Any = None
) -> tuple[str, int]:
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log or subprocess.DEVNULL,
        start_new_session=True,
    )
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(url + "/health", timeout=60, procs=[proc])
    return url, proc.pid


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--serial-requests", type=int, default=500)
    parser.add_argument("--tokenizer", help="the gateway tokenizes with this (e.g. smollm2-135m)")
    parser.add_argument("--log-level", default="info", help="the gateway's (info: access log)")
    parser.add_argument("--loadgen")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    if args.loadgen:
        result = asyncio.run(load(args.loadgen, args.concurrency, args.requests, args.stream))
        print(json.dumps(result))
        return 0

    procs: list[subprocess.Popen[bytes]] = []
    logs = tempfile.TemporaryDirectory(prefix="gateway-bench-")
    log_files: list[Any] = []
    try:
        stub_port = free_port()
        stub = start(
            ["-m", "tests.support.stub_backend", "--port", str(stub_port)], stub_port, procs
        )
        targets = {"direct (stub)": stub}
        port = free_port()
        gw_args = ["-m", "prefixgate", "gateway", "--port", str(port), "--replica", stub[0]]
        gw_args += ["--log-level", args.log_level]
        gw_args += ["--tokenizer", args.tokenizer] if args.tokenizer else []
        log = open(Path(logs.name) / "gateway.log", "wb")  # noqa: SIM115
        log_files.append(log)
        targets["gateway"] = start(gw_args, port, procs, log)
        print(f"{'target':<24} {'mode':<7} {'conc':>4} {'ttfb p50':>9} {'ttfb p99':>9} "
              f"{'full p50':>9} {'full p99':>9} {'req/s':>7} {'cpu/req':>8} "
              f"{'err':>4}")  # fmt: skip
        results: dict[tuple[str, str, int], dict[str, Any]] = {}
        for name, (url, pid) in targets.items():
            for stream in (False, True):
                for conc, n in ((1, args.serial_requests), (32, args.requests)):
                    r = run_loadgen(url, conc, n, stream, pid)
                    mode = "stream" if stream else "plain"
                    results[(name, mode, conc)] = r
                    row = f"{name:<24} {mode:<7} {conc:>4} {r['ttfb_p50_ms']:>8.2f}m "
                    row += f"{r['ttfb_p99_ms']:>8.2f}m {r['total_p50_ms']:>8.2f}m "
                    row += f"{r['total_p99_ms']:>8.2f}m {r['rps']:>7.0f} "
                    row += f"{r['cpu_ms_per_request']:>7.3f}m {r['errors']:>4}"
                    print(row, flush=True)
        print("\nadded latency (gateway - direct), p50 of the full response:")
        for name in targets:
            if name.startswith("gateway"):
                for mode in ("plain", "stream"):
                    for conc in (1, 32):
                        d = results[("direct (stub)", mode, conc)]["total_p50_ms"]
                        g = results[(name, mode, conc)]["total_p50_ms"]
                        print(f"  {name:<24} {mode:<7} conc {conc:>2}: {g - d:+.2f} ms")
    finally:
        for proc in procs:
            stop_process(proc, grace_s=5)
        for log in log_files:
            log.close()
        logs.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
