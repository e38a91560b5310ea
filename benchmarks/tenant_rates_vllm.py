"""A tenant with ``rpm_limit`` or ``tpm_limit`` sending as fast as it can, through keyed
gateways from each given tree in front of vLLM: what reaches the engine?

    .venv/bin/python benchmarks/tenant_rates_vllm.py --engine-url http://127.0.0.1:8100 \
        --tree before=DIR --tree after=. [--gateways 2]

Two runs per tree, each ``--seconds`` long, ``--clients`` clients at once, each waiting
``Retry-After`` on a 429 (as the OpenAI SDKs do) and sending again:

* requests: the key has ``rpm_limit: --rpm``; short chats (4 tokens);
* tokens: the key has ``tpm_limit: --tpm``; streamed chats of ``--tokens`` tokens without
  ``include_usage`` (the gateway must count them itself).

Prints the requests answered and the 429s at the clients, and the requests and tokens
(prompt and generated) the engine's ``/metrics`` counted over the run, beside what the
limit allows in that time: one minute's worth and the refill. With ``--gateways G`` the
clients are split over G gateways sharing one Redis (``--separate``: each on its own, no
Redis). A tree that does not know the fields ignores them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
from pathlib import Path

import httpx
from passed_headers_vllm import MODEL, gateway_from_tree

from prefixgate.procs import free_port, start_redis, stop_process

COUNTERS = {
    "requests": re.compile(rb"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", re.M),
    "prompt": re.compile(rb"^vllm:prompt_tokens_total\{[^}]*\} ([0-9.e+]+)$", re.M),
    "generated": re.compile(rb"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", re.M),
}


def engine_counts(engine: str) -> dict[str, float]:
    metrics = httpx.get(engine + "/metrics", timeout=10).content
    return {name: sum(float(v) for v in rx.findall(metrics)) for name, rx in COUNTERS.items()}


async def client_loop(
    url: str, key: str, tokens: int, stream: bool, until: float, seen: dict[str, int]
) -> None:
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        n = 0
        while time.monotonic() < until:
            n += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Request {n}: count."}],
                "max_tokens": tokens,
                "ignore_eos": True,
                "stream": stream,
            }
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as r:
                await r.aread()
            if r.status_code == 429:
                seen["429"] += 1
                wait = float(r.headers.get("retry-after-ms", "1000")) / 1e3
                await asyncio.sleep(min(wait, max(0.0, until - time.monotonic())))
            elif r.status_code == 200:
                seen["answered"] += 1
            else:
                seen["other"] += 1


def run(
    urls: list[str], engine: str, key: str, tokens: int, stream: bool, args: argparse.Namespace
) -> str:
    seen = {"answered": 0, "429": 0, "other": 0}
    before = engine_counts(engine)
    until = time.monotonic() + args.seconds

    async def all_clients() -> None:
        await asyncio.gather(
            *(
                client_loop(urls[i % len(urls)], key, tokens, stream, until, seen)
                for i in range(args.clients)
            )
        )

    asyncio.run(all_clients())
    after = engine_counts(engine)
    d = {name: after[name] - before[name] for name in COUNTERS}
    return (
        f"answered {seen['answered']}, 429 {seen['429']}, other {seen['other']}; engine: "
        f"{d['requests']:.0f} requests, {d['prompt'] + d['generated']:.0f} tokens "
        f"({d['prompt']:.0f} prompt + {d['generated']:.0f} generated)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--gateways", type=int, default=1)
    p.add_argument("--separate", action="store_true", help="gateways without a shared Redis")
    p.add_argument("--rpm", type=int, default=30)
    p.add_argument("--tpm", type=int, default=3000)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=30.0)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp())
    redis = None
    flags_extra: list[str] = []
    if args.gateways > 1 and not args.separate:
        port = free_port()
        redis = start_redis(port, work)
        flags_extra = ["--redis-url", f"redis://127.0.0.1:{port}/0"]
    minutes = args.seconds / 60
    print(
        f"allowed in {args.seconds:.0f} s: {args.rpm * (1 + minutes):.0f} requests "
        f"(rpm {args.rpm}); {args.tpm * (1 + minutes):.0f} tokens (tpm {args.tpm}) and the "
        "overdraft of the requests admitted last",
        flush=True,
    )
    try:
        for spec in args.tree:
            name, _, tree = spec.partition("=")
            # A fresh tenant per tree: Redis keeps a tenant's buckets between runs.
            keys = work / f"keys-{name}.json"
            keys.write_text(
                json.dumps(
                    {
                        f"sk-rpm-{name}": {"tenant": f"rpm-{name}", "rpm_limit": args.rpm},
                        f"sk-tpm-{name}": {"tenant": f"tpm-{name}", "tpm_limit": args.tpm},
                    }
                )
            )
            flags = ["--api-keys", str(keys), *flags_extra]
            gateways = [
                gateway_from_tree(tree, args.engine_url, f"/tmp/rates-{name}-{i}.log", flags=flags)
                for i in range(args.gateways)
            ]
            urls = [url for url, _ in gateways]
            try:
                rpm = run(urls, args.engine_url, f"sk-rpm-{name}", 4, False, args)
                print(f"{name:7s} rpm {args.rpm}: {rpm}", flush=True)
                tpm = run(urls, args.engine_url, f"sk-tpm-{name}", args.tokens, True, args)
                print(f"{name:7s} tpm {args.tpm}: {tpm}", flush=True)
            finally:
                for _, proc in gateways:
                    stop_process(proc, grace_s=5)
    finally:
        if redis is not None:
            stop_process(redis)


if __name__ == "__main__":
    main()
