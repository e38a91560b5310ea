"""End-to-end replica figures through HTTP with the official openai client.

1. TTFT cold vs warm: a ~2,000-token shared system prompt plus a short question, streamed;
   TTFT is the time from sending the request to the first chunk carrying content.
   Cold: a system prompt never seen (a fresh nonce at its start). Warm: the same system
   prompt again with another question.
2. Event latency: the time from a request's response arriving at the client to its
   ``stored`` event being readable in Redis (a reader blocked on XREAD). Negative means
   the event was readable before the client had its response.

Usage: .venv/bin/python benchmarks/replica_http_bench.py [--model smollm2-135m] [--cold 3]
       [--warm 5] [--events 200]
Starts its own Redis and replica on free loopback ports and stops them at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import openai
import redis

from prefixgate.procs import free_port, start_redis, stop_process, wait_http_ok
from prefixgate.tokenizer import ChatTokenizer
from router.protocol import BlockEvent, KeySpace, events_stream_key, short_key

REPO = Path(__file__).resolve().parents[1]

SENTENCES = [
    "Orders ship from the nearest warehouse within two business days.",
    "Refunds are issued to the original payment method after inspection.",
    "Hazardous goods need a signed declaration before pickup.",
    "Customs paperwork is prepared by the sender for international parcels.",
    "Damaged parcels must be reported within seven days of delivery.",
    "Express service guarantees delivery by noon on the next business day.",
    "Oversized items are billed by volumetric weight, not actual weight.",
    "Address changes after dispatch incur a rerouting fee.",
]


def system_prompt(tokenizer: ChatTokenizer, target_tokens: int, nonce: str) -> str:
    rng = random.Random(nonce)
    parts = [f"Policy manual revision {nonce}."]
    while len(tokenizer.encode(" ".join(parts))) < target_tokens:
        parts.append(f"Section {len(parts)}: {rng.choice(SENTENCES)}")
    return " ".join(parts)


def ttft(client: openai.OpenAI, model: str, system: str, question: str) -> tuple[float, int]:
    """Seconds to the first content chunk, and the cached tokens the replica reported."""
    start = time.perf_counter()
    first: float | None = None
    cached = 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage and chunk.usage.prompt_tokens_details:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return (first if first is not None else time.perf_counter() - start), cached


class StoredWatcher(threading.Thread):
    """Blocks on XREAD and records when each stored key first becomes readable."""

    def __init__(self, url: str, replica_id: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.stream = events_stream_key(replica_id)
        self.seen: dict[bytes, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        last = "0-0"  # from the start: no race with the first request, old keys are harmless
        while not self.stop.is_set():
            reply: Any = self.client.xread({self.stream: last}, block=200)
            now = time.perf_counter()
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    event = BlockEvent.decode(fields)
                    if event.type == "stored":
                        for key in event.keys:
                            self.seen.setdefault(key, now)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--cold", type=int, default=3)
    parser.add_argument("--warm", type=int, default=5)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="replica-bench-"))
    redis_port, port = free_port(), free_port()
    redis_proc = start_redis(redis_port, work / "redis")
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    cmd = [sys.executable, "-m", "prefixgate", "replica", "--model", args.model]
    cmd += ["--port", str(port), "--kv-cache-mb", str(args.kv_cache_mb), "--redis-url", redis_url]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(work / "replica.log", "wb")  # noqa: SIM115 - owned by the child
    replica = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout=300, procs=[replica])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=600)
        tokenizer = ChatTokenizer.for_model(args.model)

        ttft(client, args.model, "Warm-up.", "Hi")  # first-call overheads out of the figures
        cold, warm = [], []
        for i in range(args.cold):
            system = system_prompt(tokenizer, args.prompt_tokens, f"cold-{i}-{time.time_ns()}")
            t_cold, c_cold = ttft(client, args.model, system, "Where is my parcel?")
            cold.append(t_cold)
            for j in range(args.warm // max(1, args.cold) + 1):
                t_warm, c_warm = ttft(client, args.model, system, f"Question {j}: fees?")
                warm.append(t_warm)
            print(f"  run {i}: cold {t_cold * 1000:.0f} ms (cached {c_cold}), "
                  f"warm {t_warm * 1000:.0f} ms (cached {c_warm})")  # fmt: skip
        n_prompt = len(tokenizer.encode(system))
        print(f"TTFT {args.model}, ~{n_prompt}-token system prompt, HTTP + openai client:")
        print(f"  cold median {statistics.median(cold) * 1000:.1f} ms over {len(cold)}")
        print(f"  warm median {statistics.median(warm) * 1000:.1f} ms over {len(warm)}")
        print(f"  cold / warm = {statistics.median(cold) / statistics.median(warm):.1f}x")

        watcher = StoredWatcher(redis_url, f"127.0.0.1:{port}")
        watcher.start()
        space = KeySpace(args.model, 16)
        rng = random.Random(1)
        lags: list[float] = []
        for _ in range(args.events):
            prompt = [rng.randrange(100, 40000) for _ in range(48)]
            client.completions.create(model=args.model, prompt=prompt, max_tokens=1)
            done = time.perf_counter()
            key = short_key(space.keys(prompt)[-1])
            deadline = done + 5
            while key not in watcher.seen and time.perf_counter() < deadline:
                time.sleep(0.0005)
            if key in watcher.seen:
                lags.append(watcher.seen[key] - done)
        watcher.stop.set()
        print(f"stored event readable in Redis after the response ({len(lags)}/{args.events}):")
        print(f"  p50 {pct(lags, 0.5) * 1000:.2f} ms, p99 {pct(lags, 0.99) * 1000:.2f} ms")
    finally:
        stop_process(replica)
        stop_process(redis_proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
