"""Two tenants, each with a LoRA adapter of its own, through keyed gateways from each
given tree in front of one vLLM serving both adapters:

    .venv/bin/python benchmarks/tenant_models_vllm.py --engine-url http://127.0.0.1:8100 \
        --tree before=DIR --tree after=. [--adapters a1,a2]

The keys file gives tenant ``a`` ``models: [BASE, a1]`` and tenant ``b`` ``models: [BASE,
a2]`` (a tree that does not know the field ignores it). For each tree and each tenant:
the models ``/v1/models`` lists, and a greedy chat with each adapter (its status, and
whether its answer is the adapter's own, as the engine gives it directly).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import httpx
from passed_headers_vllm import MODEL, gateway_from_tree

from prefixgate.procs import stop_process

PROMPT = [{"role": "user", "content": "Name three colours."}]


def chat(url: str, model: str, key: str | None) -> tuple[int, str]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": PROMPT, "max_tokens": 12, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    if r.status_code != 200:
        return r.status_code, r.json().get("error", {}).get("code", "")
    return 200, r.json()["choices"][0]["message"]["content"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--adapters", default="a1,a2")
    args = p.parse_args()
    first, second = args.adapters.split(",")
    direct = {m: chat(args.engine_url, m, None)[1] for m in (MODEL, first, second)}
    print(f"direct: {json.dumps(direct)}")
    keys = Path(tempfile.mkdtemp()) / "keys.json"
    tenants = {"sk-a": [MODEL, first], "sk-b": [MODEL, second]}
    keys.write_text(
        json.dumps({key: {"tenant": key[3:], "models": models} for key, models in tenants.items()})
    )
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        url, proc = gateway_from_tree(
            tree, args.engine_url, f"/tmp/models-{name}.log", flags=["--api-keys", str(keys)]
        )
        try:
            for key, allowed in tenants.items():
                listed = httpx.get(
                    url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=30
                ).json()
                ids = sorted(m["id"] for m in listed["data"])
                calls = []
                for model in (first, second):
                    status, said = chat(url, model, key)
                    own = "its own answer" if said == direct[model] else repr(said)
                    mine = "allowed" if model in allowed else "another tenant's"
                    calls.append(f"{model} ({mine}): {status} {own if status == 200 else said}")
                print(f"{name:7s} {key}: lists {ids}; " + "; ".join(calls), flush=True)
        finally:
            stop_process(proc, grace_s=5)


if __name__ == "__main__":
    main()
