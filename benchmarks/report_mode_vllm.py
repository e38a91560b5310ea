"""vLLM's ``kv_cache_report_mode: full`` sent by clients through a gateway from each tree:
does the router's view of an engine stay within what the engine can hold?

    # the engine: a small cache, so that documents are evicted, e.g.
    # --num-gpu-blocks-override 40 (5,120 tokens on a CPU build's 128-token blocks), with
    # --kv-events-config endpoint tcp://*:5600, replay_endpoint tcp://*:5610, and
    # VLLM_SERVER_DEV_MODE=1 (for /reset_prefix_cache)
    .venv/bin/python benchmarks/report_mode_vllm.py --engine http://127.0.0.1:8100,5600,5610 \
        --tree before=DIR --tree after=.

A request with ``vllm_xargs: {"kv_cache_report_mode": "full"}`` makes vLLM 0.32 announce
again the cached blocks it reuses, as stores no removal follows. Per tree: Redis, a
bridge and a gateway (bench helpers of benchmarks/hub_models_vllm.py), the engine's cache
reset, then ``--docs`` documents asked three times each with that field, past the
engine's capacity. Prints the keys the router indexes for the engine (and how many of them
are its own 30 s record of where it sent prompts), then the first documents asked again
without the field: the engine's cached tokens against the route's predicted match.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from hub_models_vllm import Stack, reset


def ask(gateway: str, model: str, doc: str, question: str, full: bool) -> tuple[int, int, str]:
    """Prompt tokens, those the engine read from its cache, the route's reason."""
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
        "max_tokens": 1,
    }
    if full:
        body["vllm_xargs"] = {"kv_cache_report_mode": "full"}
    r = httpx.post(gateway + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    usage = r.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage["prompt_tokens"], cached, r.headers.get("x-prefixgate-route", "")


def run(tree: str, label: str, engine: list[str], args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    words = ["cache", "prefix", "replica", "gateway", "token", "block", "north", "river"]
    docs = [
        f"Doc {i}. " + " ".join(rng.choice(words) for _ in range(args.words))
        for i in range(args.docs)
    ]
    with tempfile.TemporaryDirectory() as work:
        stack = Stack(tree, [engine], Path(work))
        try:
            reset([engine], args.model)
            for doc in docs:
                for k in range(3):
                    ask(stack.url, args.model, doc, f"question {k}", full=True)
            replicas = httpx.get(stack.url + "/router/stats").json()["replicas"]
            for rid, view in replicas.items():
                print(
                    f"{label}: keys indexed for {rid}: {view['blocks']}, of which the "
                    f"gateway's own record of where it sent prompts {view['optimistic_blocks']}"
                )
            for i in range(args.again):
                prompt, cached, route = ask(stack.url, args.model, docs[i], "again", False)
                print(f"{label}: document {i} again: engine cached {cached}/{prompt}; {route[:90]}")
        finally:
            stack.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", required=True, metavar="URL,EVENTS,REPLAY")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--words", type=int, default=600)
    p.add_argument("--again", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    engine = args.engine.split(",")
    for name, tree in [t.split("=", 1) for t in args.tree] or [["this", "."]]:
        run(tree, name, engine, args)


if __name__ == "__main__":
    main()
