"""A vLLM engine whose model has no chat template of its own (a base model, or a vision
model whose template is its processor's), started with ``--chat-template FILE``: chats
through a gateway from each given tree.

    /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server --model BASE_DIR \
        --chat-template TEMPLATE --port 8102 --enable-prefix-caching ...
    .venv/bin/python benchmarks/engine_chat_template_vllm.py --engine-url \
        http://127.0.0.1:8102 --tree before=DIR --tree after=. \
        --tree "after, with the template=.:--chat-template=TEMPLATE"

Per tree (``NAME=DIR`` or ``NAME=DIR:FLAG=VALUE``: a gateway flag): ``--chats`` chats of
one system prompt, one at a time. Prints the answers' statuses, the prompt tokens the
engine read from its cache, and whether the gateway keyed them by tokens (its route
header's block count against the engine's prompt tokens).
"""

from __future__ import annotations

import argparse
from collections import Counter

import httpx
from passed_headers_vllm import gateway_from_tree

from prefixgate.procs import stop_process

SYSTEM = "You are a careful assistant for a team that runs model servers. " * 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR[:FLAG=VALUE]")
    p.add_argument("--chats", type=int, default=4)
    args = p.parse_args()
    model = httpx.get(args.engine_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    for spec in args.tree:
        name, _, rest = spec.partition("=")
        tree, _, flag = rest.partition(":")
        flags = flag.split("=", 1) if flag else []
        httpx.post(args.engine_url + "/reset_prefix_cache", timeout=30)
        url, proc = gateway_from_tree(tree, args.engine_url, "/tmp/template-gw.log", flags=flags)
        statuses: Counter[str] = Counter()
        cached = prompt = 0
        blocks = []
        try:
            for i in range(args.chats):
                body = {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Question {i}: which port?"},
                    ],
                    "max_tokens": 1,
                }
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
                statuses[str(r.status_code)] += 1
                if r.status_code == 200:
                    usage = r.json()["usage"]
                    prompt += usage["prompt_tokens"]
                    cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    route = r.headers.get("x-prefixgate-route", "")
                    blocks.append(route.rsplit("matched=", 1)[-1].split(";")[0])
                else:
                    statuses[r.json()["error"]["message"][:90]] += 1
        finally:
            stop_process(proc, grace_s=5)
        print(
            f"{name}: statuses {dict(statuses)}; cached {cached}/{prompt} prompt tokens; "
            f"route blocks matched/total {blocks}",
            flush=True,
        )


if __name__ == "__main__":
    main()
