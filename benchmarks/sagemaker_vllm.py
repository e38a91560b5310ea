"""SageMaker's container contract (``/ping``, ``/invocations``, stateful sessions) on
vLLM directly and through gateways from given trees.

    SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true vllm ... --port 8100   # and 8101
    .venv/bin/python benchmarks/sagemaker_vllm.py --engine-url http://127.0.0.1:8100 \
        --engine-url http://127.0.0.1:8101 --tree before=DIR --tree after=.

1. The contract: the same requests (greedy) to the first engine directly and to each
   gateway in front of it alone, sessions on; prints each one's status and whether the
   answer is the engine's own (without ids and times).
2. Sessions over every engine, through each gateway: ``--sessions`` sessions of
   ``--turns`` turns each (a ~600-token system prompt of its own, then a growing chat);
   prints how many turns were answered, how many replicas each session's turns went to,
   and the share of later turns' prompt tokens read from the cache.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx
from generating_endpoints_vllm import stable
from passed_headers_vllm import MODEL, gateway_from_tree

from prefixgate.procs import stop_process

SESSIONS_ON = {"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true"}
SESSION = "X-Amzn-SageMaker-Session-Id"
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
        "temperature": 0}  # fmt: skip
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


def contract(url: str) -> list[tuple[str, int, Any]]:
    """(what, status, comparable answer) for each request of the contract."""
    out: list[tuple[str, int, Any]] = []

    def post(what: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        r = httpx.post(url + "/invocations", json=body, headers=headers, timeout=300)
        kind = r.headers.get("content-type", "")
        answer = None  # the choices: usage differs once a prompt is cached
        if kind.startswith("application/json") and r.is_success:
            answer = stable(r.json().get("choices"))
        out.append((what, r.status_code, answer))
        return r

    out.append(("GET /ping", httpx.get(url + "/ping").status_code, None))
    post("chat", CHAT)
    post("completion", COMPLETION)
    post("completion, unknown body model", {**COMPLETION, "model": "no-such-model"})
    post("completion, adapter header", COMPLETION, {"X-Amzn-SageMaker-Adapter-Identifier": MODEL})
    r = httpx.post(url + "/invocations", json={**CHAT, "stream": True}, timeout=300)
    text = "".join(
        (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for line in r.text.splitlines()
        if line.startswith("data: {")
    )
    out.append(("chat streamed", r.status_code, text))
    post("neither messages nor prompt", {"input": "x"})
    made = post("NEW_SESSION", {"requestType": "NEW_SESSION"})
    session = made.headers.get("x-amzn-sagemaker-new-session-id", "").split(";")[0]
    post("completion in the session", COMPLETION, {SESSION: session})
    post("CLOSE", {"requestType": "CLOSE"}, {SESSION: session})
    post("completion in the closed session", COMPLETION, {SESSION: session})
    post("unknown session", COMPLETION, {SESSION: "no-such-session"})
    post("bad requestType", {"requestType": "OPEN"})
    r = httpx.post(url + "/invocations", content=b'{"prompt": ', timeout=30)
    out.append(("body not JSON", r.status_code, None))
    out.append(("GET /invocations", httpx.get(url + "/invocations").status_code, None))
    return out


def sessions(url: str, count: int, turns: int) -> str:
    answered = 0
    spread: list[int] = []
    cached = prompt = 0
    for n in range(count):
        r = httpx.post(url + "/invocations", json={"requestType": "NEW_SESSION"}, timeout=60)
        if r.status_code != 200:
            return f"NEW_SESSION answered {r.status_code}: {r.text[:100]}"
        session = r.headers["x-amzn-sagemaker-new-session-id"].split(";")[0]
        system = f"Session {n}: you are assistant number {n}. " + "Answer briefly. " * 150
        messages = [{"role": "system", "content": system}]
        where: set[str] = set()
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Question {turn}: name a number."})
            body = {"messages": messages, "max_tokens": 8, "temperature": 0}
            r = httpx.post(url + "/invocations", json=body, headers={SESSION: session}, timeout=300)
            if r.status_code != 200:
                continue
            answered += 1
            where.add(r.headers.get("x-prefixgate-replica", "direct"))
            usage = r.json()["usage"]
            if turn:
                cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                prompt += usage["prompt_tokens"]
            messages.append(r.json()["choices"][0]["message"])
        spread.append(len(where))
    share = cached / prompt if prompt else 0.0
    return (
        f"{answered}/{count * turns} turns answered; replicas per session {spread}; "
        f"later turns read {share:.3f} of their prompt tokens from the cache"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", action="append", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args()
    engines: list[str] = args.engine_url
    direct = contract(engines[0])
    for what, status, _ in direct:
        print(f"{what:36s} direct          {status}")
    print(f"sessions, direct to {engines[0]}: {sessions(engines[0], args.sessions, args.turns)}")
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        url, proc = gateway_from_tree(tree, engines[0], f"/tmp/sagemaker-{name}.log", SESSIONS_ON)
        try:
            for (what, status, answer), (_, d_status, d_answer) in zip(
                contract(url), direct, strict=True
            ):
                same = status == d_status and answer == d_answer
                verdict = "as direct" if same else f"differs (direct {d_status})"
                print(f"{what:36s} gateway {name:7s} {status}  {verdict}")
        finally:
            stop_process(proc, grace_s=5)
        url, proc = gateway_from_tree(tree, engines, f"/tmp/sagemaker-{name}.log", SESSIONS_ON)
        try:
            print(f"sessions, gateway {name} over {len(engines)}: "
                  f"{sessions(url, args.sessions, args.turns)}")  # fmt: skip
        finally:
            stop_process(proc, grace_s=5)


if __name__ == "__main__":
    main()
