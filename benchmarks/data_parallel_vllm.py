"""A vLLM with data-parallel ranks behind one URL: does prefixgate find the rank that holds
a prompt's prefix?

    VLLM_SERVER_DEV_MODE=1 /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
        --model ~/.cache/prefixgate/models/smollm2-135m-v1 --served-model-name smollm2-135m \
        --host 127.0.0.1 --port 8900 --enable-prefix-caching --enable-prompt-tokens-details \
        --max-model-len 4096 --data-parallel-size 2 --kv-events-config \
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5600",
          "replay_endpoint":"tcp://*:5610","topic":""}'
    .venv/bin/python benchmarks/data_parallel_vllm.py --engine-url http://127.0.0.1:8900 \
        --kv-events tcp://127.0.0.1:5600 --replay tcp://127.0.0.1:5610 --ranks 2

The same document Q&A (D documents, each asked Q times, shuffled, C clients) through
three arms, interleaved, the engine's cache reset before each (its development mode):

* ``direct``: the clients call vLLM; its internal load balancer picks each rank by load.
* ``one bridge``: a gateway with one bridge for the whole engine (prefixgate before
  bridges per rank): one replica to the router, the engine picks the rank.
* ``per rank``: a gateway with a bridge per rank (``--data-parallel-rank R``): a replica
  per rank, and the gateway names the rank of each request (``X-data-parallel-rank``).

Reported per arm: the prompt tokens read from the cache (vLLM's usage), the requests
that found their document cached, each rank's requests (vLLM's ``/metrics``), wall time.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixgate.procs import free_port, start_redis, stop_process, wait_http_ok
from router.protocol import DATA_PARALLEL_RANK_HEADER

WORDS = [
    "river", "stone", "market", "window", "winter", "garden", "signal", "engine", "harbor",
    "letter", "silver", "forest", "paper", "bridge", "candle", "mirror", "island", "ladder",
    "rocket", "violin", "meadow", "thunder", "compass", "lantern", "orchard", "canyon",
    "glacier", "furnace", "pepper", "saddle", "tunnel", "velvet", "whistle", "anchor",
    "basket", "cellar",
]  # fmt: skip


def document(i: int, words: int) -> str:
    rng = random.Random(i)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Document {i}.\n{body}"


def workload(docs: int, questions: int, words: int, seed: int) -> list[tuple[int, str]]:
    """Each document asked ``questions`` times, in a shuffled order."""
    asks = [(d, q) for d in range(docs) for q in range(questions)]
    random.Random(seed).shuffle(asks)
    return [
        (d, f"{document(d, words)}\n\nQuestion {q}: what is word {q + 1} of document {d}?")
        for d, q in asks
    ]


def rank_requests(engine_url: str) -> Counter[str]:
    text = httpx.get(engine_url + "/metrics", timeout=10).text
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:request_success_total":
                counts[s.labels.get("engine", "?")] += int(s.value)
    return counts


def run_arm(base_url: str, model: str, asks: list[tuple[int, str]], clients: int) -> dict[str, Any]:
    seen: set[int] = set()
    order = []  # whether each request's document had been asked before, in send order
    for d, _ in asks:
        order.append(d in seen)
        seen.add(d)

    def one(i: int) -> tuple[int, int, str | None]:
        _, prompt = asks[i]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 1,
            "temperature": 0,
        }
        r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        usage = r.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return usage["prompt_tokens"], cached, r.headers.get("x-prefixgate-replica")

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(len(asks))))
    wall = time.monotonic() - started
    prompt = sum(p for p, _, _ in results)
    cached = sum(c for _, c, _ in results)
    repeats = [c for (_, c, _), again in zip(results, order, strict=True) if again]
    return {
        "wall_s": round(wall, 1),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": round(cached / prompt, 3),
        "repeats_hit": f"{sum(1 for c in repeats if c >= 128)}/{len(repeats)}",
        "replicas": dict(Counter(r for _, _, r in results if r)),
    }


class Gateway:
    """Redis, the bridges and a gateway, as subprocesses; stopped by ``stop``."""

    def __init__(self, args: argparse.Namespace, ranks: list[int | None], workdir: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        redis_port = free_port()
        self.procs.append(start_redis(redis_port, workdir / "redis"))
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        for rank in ranks:
            cmd = [sys.executable, "-m", "prefixgate", "bridge", "--engine-url", args.engine_url]
            cmd += ["--kv-events", args.kv_events, "--replay", args.replay, "--redis-url"]
            cmd += [redis_url, "--model", args.model, "--no-tokenizer-check"]
            if rank is not None:
                cmd += ["--data-parallel-rank", str(rank)]
            self.procs.append(self._start(cmd, workdir / f"bridge-{rank}.log"))
        self.port = free_port()
        cmd = [sys.executable, "-m", "prefixgate", "gateway", "--port", str(self.port)]
        cmd += ["--redis-url", redis_url, "--model", args.model]
        self.procs.append(self._start(cmd, workdir / "gateway.log"))
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http_ok(f"{self.url}/ready?min_replicas={len(ranks)}", 120, self.procs)

    @staticmethod
    def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
        out = open(log, "ab")  # noqa: SIM115 - owned by the child
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc, grace_s=5)


def reset(engine_url: str, model: str, ranks: int) -> None:
    """Every rank's cache emptied (vLLM resets them all), and each rank's cleared event
    published: a rank publishes it at its next step, which a one-token request to it
    makes."""
    r = httpx.post(engine_url + "/reset_prefix_cache", timeout=30)
    r.raise_for_status()
    body = {"model": model, "prompt": "reset", "max_tokens": 1}
    for rank in range(ranks):
        headers = {DATA_PARALLEL_RANK_HEADER: str(rank)}
        url = engine_url + "/v1/completions"
        httpx.post(url, json=body, headers=headers, timeout=60).raise_for_status()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--kv-events", required=True, help="the engine's event endpoint (rank 0)")
    p.add_argument("--replay", required=True, help="the engine's replay endpoint (rank 0)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--words", type=int, default=400, help="words per document")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    arms: dict[str, list[int | None] | None] = {
        "direct": None,
        "one bridge": [None],
        "per rank": list(range(args.ranks)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            asks = workload(args.docs, args.questions, args.words, seed=repeat)
            for name, ranks in arms.items():
                reset(args.engine_url, args.model, args.ranks)
                gateway = None
                if ranks is not None:
                    gateway = Gateway(args, ranks, Path(tmp) / f"{repeat}-{name}")
                try:
                    before = rank_requests(args.engine_url)
                    base = args.engine_url if gateway is None else gateway.url
                    result = run_arm(base, args.model, asks, args.clients)
                    after = rank_requests(args.engine_url)
                finally:
                    if gateway is not None:
                        gateway.stop()
                per_rank = {r: after[r] - before.get(r, 0) for r in sorted(after)}
                print(f"repeat {repeat} {name:>10}: {result} rank requests {per_rank}", flush=True)


if __name__ == "__main__":
    main()
