"""Responses latency while the Redis behind response affinity hangs.

    .venv/bin/prefixgate up --model sim --replicas 2 --port 8700 --run-dir RUN &
    .venv/bin/python benchmarks/affinity_outage.py --base-url http://127.0.0.1:8700/v1 \\
        --redis-pid "$(awk '/^redis /{print $2}' RUN/pids)"

Sends ``--requests`` sequential stored Responses requests (non-streamed, then streamed)
with Redis up, then with Redis stopped (SIGSTOP: hung, as in a failover or a network
partition, not refused), then after SIGCONT; prints each phase's median and max
latency. Every stored response records its id in Redis before the client gets it.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time

from openai import OpenAI


def phase(client: OpenAI, label: str, requests: int, stream: bool) -> None:
    latencies = []
    for i in range(requests):
        t0 = time.perf_counter()
        if stream:
            for _event in client.responses.create(
                model="sim", input=f"hi {i} {label}", max_output_tokens=3, stream=True
            ):
                pass
        else:
            client.responses.create(model="sim", input=f"hi {i} {label}", max_output_tokens=3)
        latencies.append(time.perf_counter() - t0)
    print(
        f"{label + (', streamed' if stream else ''):24s} median"
        f" {statistics.median(latencies) * 1000:6.0f} ms, max {max(latencies) * 1000:6.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--redis-pid", type=int, required=True)
    parser.add_argument("--requests", type=int, default=10)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="x", max_retries=0, timeout=60)
    for stream in (False, True):
        phase(client, "redis up", args.requests, stream)
    os.kill(args.redis_pid, signal.SIGSTOP)
    try:
        for stream in (False, True):
            phase(client, "redis hung", args.requests, stream)
    finally:
        os.kill(args.redis_pid, signal.SIGCONT)
    for stream in (False, True):
        phase(client, "redis back", args.requests, stream)


if __name__ == "__main__":
    main()
