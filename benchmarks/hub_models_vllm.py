"""vLLM engines started from a Hugging Face Hub id, behind a gateway from each given tree:
are prompts sent where the engines cached them?

    # the engines: e.g. --model HuggingFaceTB/SmolLM2-135M-Instruct (from HF_HUB_CACHE),
    # each with --kv-events-config endpoint tcp://*:56NN, replay_endpoint tcp://*:561N
    .venv/bin/python benchmarks/hub_models_vllm.py --engine http://127.0.0.1:8100,5600,5610 \
        --engine http://127.0.0.1:8101,5601,5611 --tree before=DIR --tree after=.

vLLM users start engines as ``--model ORG/NAME`` (served under that name) or add
``--served-model-name NAME``. Per tree: Redis, a bridge per engine and a gateway, run
from that tree (``PYTHONPATH``), the gateway given no ``--tokenizer``, and the engines'
caches reset first (development mode: ``VLLM_SERVER_DEV_MODE=1``). Then ``--docs``
documents, each asked a question in turn (its first ask), each asked again at once, and
again after ``--wait-s`` (past the router's 30 s memory of where it sent a prompt,
``optimistic_ttl_s``: from then on only the engines' published blocks place a prompt).
Prints per pass the prompt tokens the engines read from their cache (their usage), the
asks routed by a prefix match, and the mean time of an ask (one output token).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from prefixgate.procs import free_port, start_redis, stop_process, wait_http_ok


def documents(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocabulary = [
        "cache", "prefix", "replica", "gateway", "token", "block", "engine", "request",
        "router", "latency", "memory", "model", "prompt", "session", "agent", "queue",
        "north", "river", "stone", "garden", "window", "signal", "copper", "harbor",
    ]  # fmt: skip
    return [
        f"Document {i}. " + " ".join(rng.choice(vocabulary) for _ in range(words))
        for i in range(count)
    ]


class Stack:
    """Redis, a bridge per engine and a gateway, run from ``tree``."""

    def __init__(
        self,
        tree: str,
        engines: list[list[str]],
        workdir: Path,
        gateway_args: list[str] | None = None,
        bridge_args: list[str] | None = None,
    ) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        redis_port = free_port()
        self.procs.append(start_redis(redis_port, workdir / "redis"))
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self.redis_url = redis_url
        for i, (url, events, replay) in enumerate(engines):
            cmd = [sys.executable, "-m", "prefixgate", "bridge", "--engine-url", url]
            cmd += ["--kv-events", f"tcp://127.0.0.1:{events}"]
            cmd += ["--replay", f"tcp://127.0.0.1:{replay}", "--redis-url", redis_url]
            cmd += bridge_args or []
            self.procs.append(self._start(cmd, tree, env, workdir / f"bridge-{i}.log"))
        self.port = free_port()
        cmd = [sys.executable, "-m", "prefixgate", "gateway", "--port", str(self.port)]
        cmd += ["--redis-url", redis_url, *(gateway_args or [])]
        self.procs.append(self._start(cmd, tree, env, workdir / "gateway.log"))
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http_ok(f"{self.url}/ready?min_replicas={len(engines)}", 120, self.procs)

    @staticmethod
    def _start(
        cmd: list[str], tree: str, env: dict[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        out = open(log, "ab")  # noqa: SIM115 - owned by the child
        return subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc, grace_s=5)


def reset(engines: list[list[str]], model: str) -> None:
    """Each engine's cache emptied, and its cleared event sent (at its next step)."""
    for url, _, _ in engines:
        httpx.post(url + "/reset_prefix_cache", timeout=30).raise_for_status()
        body = {"model": model, "prompt": "reset", "max_tokens": 1}
        httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()


def ask(gateway: str, model: str, doc: str, question: str) -> tuple[int, int, bool, float]:
    """Prompt tokens, those read from the cache, whether routed by a prefix match, time."""
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": doc},
            {"role": "user", "content": question},
        ],
        "max_tokens": 1,
    }
    started = time.monotonic()
    r = httpx.post(gateway + "/v1/chat/completions", json=body, timeout=600)
    took = time.monotonic() - started
    r.raise_for_status()
    usage = r.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    matched = r.headers.get("x-prefixgate-route", "").startswith("prefix_match")
    return usage["prompt_tokens"], cached, matched, took


def run_pass(gateway: str, model: str, docs: list[str], label: str) -> str:
    prompt = cached = matched = 0
    took = 0.0
    for i, doc in enumerate(docs):
        p, c, m, t = ask(gateway, model, doc, f"{label}: what is said about item {i}?")
        prompt, cached, matched, took = prompt + p, cached + c, matched + m, took + t
    return (
        f"{label}: cached {cached}/{prompt} prompt tokens ({cached / prompt:.0%}), "
        f"{matched}/{len(docs)} routed by a prefix match, {took / len(docs):.2f} s an ask"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", action="append", required=True, metavar="URL,EVENTS,REPLAY")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--words", type=int, default=700)
    p.add_argument("--wait-s", type=float, default=35.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    engines = [spec.split(",") for spec in args.engine]
    cards = httpx.get(engines[0][0] + "/v1/models", timeout=10).json()["data"]
    model = cards[0]["id"]
    print(f"engines serve {model!r} (root {cards[0].get('root')!r})", flush=True)
    docs = documents(args.docs, args.words, args.seed)
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        reset(engines, model)
        stack = Stack(tree, engines, Path(tempfile.mkdtemp(prefix=f"hub-{name}-")))
        try:
            print(f"{name}: {run_pass(stack.url, model, docs, 'first ask')}", flush=True)
            print(f"{name}: {run_pass(stack.url, model, docs, 'again at once')}", flush=True)
            time.sleep(args.wait_s)  # the workload's pause: users come back later
            print(f"{name}: {run_pass(stack.url, model, docs, 'again later')}", flush=True)
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
