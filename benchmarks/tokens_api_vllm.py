"""Rollouts over vLLM's token-in, token-out API: does prefixgate send a group's samples,
and their next turns, where the prompt is cached?

    VLLM_SERVER_DEV_MODE=1 /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
        --model ~/.cache/prefixgate/models/smollm2-135m-v1 --served-model-name smollm2-135m \
        --host 127.0.0.1 --port 8900 --enable-prefix-caching --enable-prompt-tokens-details \
        --max-model-len 4096 --data-parallel-size 2 --enable-scale-out --kv-events-config \
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5600",
          "replay_endpoint":"tcp://*:5610","topic":""}'
    .venv/bin/python benchmarks/tokens_api_vllm.py --engine-url http://127.0.0.1:8900 \
        --kv-events tcp://127.0.0.1:5600 --replay tcp://127.0.0.1:5610 --ranks 2

A reinforcement-learning rollout as frameworks send it to ``POST /inference/v1/generate``:
P prompts (token ids), each sampled K times (a GRPO group, sent together), then each
sample's second turn (its prompt, its own output, a tool result of T ids) sampled once.
The groups run C at a time, in a shuffled order. Two arms, interleaved, the engine's cache
reset before each (its development mode):

* ``direct``: the rollout calls vLLM; its internal load balancer picks each rank by load.
* ``gateway``: a gateway with a bridge per rank (benchmarks/data_parallel_vllm.py); the
  gateway routes by the token ids and names each request's rank.

Reported per arm: the prompt tokens read from the cache (vLLM's usage), per turn, each
rank's requests (vLLM's ``/metrics``), wall time.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from data_parallel_vllm import Gateway, rank_requests, reset

PATH = "/inference/v1/generate"


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def generate(base_url: str, ids: list[int], seed: int, max_tokens: int) -> dict[str, Any]:
    body = {
        "token_ids": ids,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed},
    }
    r = httpx.post(base_url + PATH, json=body, timeout=600)
    r.raise_for_status()
    answer: dict[str, Any] = r.json()
    return answer


def rollout(base_url: str, prompt: list[int], group: int, args: argparse.Namespace) -> list[Any]:
    """One group: K samples of ``prompt`` together, then each sample's second turn."""
    rng = random.Random(prompt[0])
    with ThreadPoolExecutor(group) as pool:
        firsts = list(
            pool.map(lambda k: generate(base_url, prompt, k, args.max_tokens), range(group))
        )
        tool = [[rng.randrange(100, 40000) for _ in range(args.tool_ids)] for _ in range(group)]
        turns = [
            [*prompt, *first["choices"][0]["token_ids"], *tool[k]] for k, first in enumerate(firsts)
        ]
        seconds = list(
            pool.map(lambda k: generate(base_url, turns[k], 100 + k, args.max_tokens), range(group))
        )
    return [("first", a["usage"]) for a in firsts] + [("second", a["usage"]) for a in seconds]


def run_arm(base_url: str, work: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    with ThreadPoolExecutor(args.concurrent_groups) as pool:
        results = list(pool.map(lambda p: rollout(base_url, p, args.group, args), work))
    wall = time.monotonic() - started
    out: dict[str, Any] = {"wall_s": round(wall, 1)}
    for turn in ("first", "second"):
        usages = [u for group in results for t, u in group if t == turn]
        prompt = sum(u["prompt_tokens"] for u in usages)
        details = [u.get("prompt_tokens_details") or {} for u in usages]
        cached = sum(d.get("cached_tokens") or 0 for d in details)
        out[f"{turn}_cached_share"] = round(cached / prompt, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--kv-events", required=True, help="the engine's event endpoint (rank 0)")
    p.add_argument("--replay", required=True, help="the engine's replay endpoint (rank 0)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-ids", type=int, default=600)
    p.add_argument("--group", type=int, default=4, help="samples of each prompt")
    p.add_argument("--tool-ids", type=int, default=40, help="ids added for the second turn")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrent-groups", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            work = prompts(args.prompts, args.prompt_ids, seed=repeat)
            for name in ("direct", "gateway"):
                reset(args.engine_url, args.model, args.ranks)
                gateway = None
                if name == "gateway":
                    gateway = Gateway(args, list(range(args.ranks)), Path(tmp) / f"{repeat}")
                try:
                    before = rank_requests(args.engine_url)
                    base = args.engine_url if gateway is None else gateway.url
                    result = run_arm(base, work, args)
                    after = rank_requests(args.engine_url)
                finally:
                    if gateway is not None:
                        gateway.stop()
                per_rank = {r: after[r] - before.get(r, 0) for r in sorted(after)}
                print(f"repeat {repeat} {name:>8}: {result} rank requests {per_rank}", flush=True)


if __name__ == "__main__":
    main()
