"""vLLM 0.32's other generating endpoints, directly and through gateways from given trees:
``/v1/chat/completions/batch``, ``/generative_scoring``, ``/v1/systemone``.

    .venv/bin/python benchmarks/generating_endpoints_vllm.py --engine-url http://127.0.0.1:8100 \
        --tree before=DIR --tree after=.

Each request is greedy; an answer is compared without its ids, creation times and
request ids. Prints, per path and tree, the status and whether the answer is the one the
engine gives directly.
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx
from passed_headers_vllm import gateway_from_tree

from prefixgate.procs import stop_process

MODEL = "smollm2-135m"
CHATS = [
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Name a fruit."}],
]
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions/batch": {"model": MODEL, "messages": CHATS, "max_tokens": 6,
                                   "temperature": 0},
    "/generative_scoring": {"model": MODEL, "query": "Is the sky blue? Answer:",
                            "items": [" yes", " no"], "label_token_ids": [4400, 1018]},
    "/v1/systemone": {"model": MODEL, "state": "The kettle is boiling.",
                      "questions": {"hot": {"type": "boolean"}}},
}  # fmt: skip
VOLATILE = {"id", "created", "request_id", "system_fingerprint"}


def stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    args = p.parse_args()
    direct = {path: httpx.post(args.engine_url + path, json=b, timeout=300)
              for path, b in BODIES.items()}  # fmt: skip
    for path, r in direct.items():
        print(f"{path:28s} direct          {r.status_code}  {r.text[:160]}")
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        url, proc = gateway_from_tree(tree, args.engine_url, f"/tmp/generating-{name}.log")
        try:
            for path, body in BODIES.items():
                r = httpx.post(url + path, json=body, timeout=300)
                same = r.status_code == direct[path].status_code and (
                    r.status_code != 200 or stable(r.json()) == stable(direct[path].json())
                )
                verdict = "the same as direct" if same else f"differs: {r.text[:120]}"
                print(f"{path:28s} gateway {name:7s} {r.status_code}  {verdict}")
        finally:
            stop_process(proc, grace_s=5)


if __name__ == "__main__":
    main()
