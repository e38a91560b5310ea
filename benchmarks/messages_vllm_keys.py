"""Do the gateway's keys for Anthropic's ``/v1/messages`` equal a real vLLM's?

    prefixgate up --engine vllm --replicas 1 --model smollm2-135m --port 8800 \
        --engine-python /work/vllm-venv/bin/python --engine-arg "--max-model-len 4096" \
        --engine-arg "--gpu-memory-utilization 0.3"
    prefixgate gateway --port 8802 --redis-url REDIS_OF_UP
    .venv/bin/python benchmarks/messages_vllm_keys.py [--tools]

The engine's cache is reset first, through A (start ``up`` with VLLM_SERVER_DEV_MODE=1 in
its environment: vLLM serves the reset only then), and a one-token request follows it:
vLLM publishes its cleared event only at its next scheduling step. Gateway A (``up``'s) serves one
Messages request with a long system prompt behind Claude Code's billing block. Gateway B
shares A's Redis but has routed nothing, so its index holds only what the engine's own
events say (through the bridge). B then routes a request with the same system prompt,
another billing hash and another question: its ``x-prefixgate-route`` says how many of
the prompt's blocks its keys found in the engine's cache, and the engine's usage how many
tokens it read from it. A chat completion of the same conversation is the control; a
last one carries Claude Code's billing block as its first system part, as a gateway that
turns Messages requests into chat completions (LiteLLM) sends it: vLLM drops the line.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import httpx

from prefixgate.wire_messages import to_chat

SYSTEM = (
    "You are a careful coding agent working in a large Python repository. Read the files "
    "you need before you edit them, keep every change small, run the tests after each "
    "edit, and explain what you changed in one short paragraph. "
) * 14
TOOL = {
    "name": "read_file",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}


def request(n: int, question: str, tools: bool) -> dict[str, Any]:
    """An agent's request; Claude Code's billing block changes with every one."""
    billing = f"x-anthropic-billing-header: cc_version=2.1; cch={n:05x};"
    body: dict[str, Any] = {
        "model": "smollm2-135m",
        "max_tokens": 4,
        "temperature": 0,
        "system": [{"type": "text", "text": billing}, {"type": "text", "text": SYSTEM}],
        "messages": [{"role": "user", "content": question}],
    }
    if tools:
        body["tools"] = [TOOL]
    return body


def post(base: str, path: str, body: dict[str, Any]) -> tuple[int, str | None, Any]:
    r = httpx.post(base + path, json=body, timeout=120)
    usage = r.json().get("usage") if r.status_code == 200 else r.text[:300]
    return r.status_code, r.headers.get("x-prefixgate-route"), usage


def wait_for_index(gateway: str, ok: Callable[[int], bool], what: str) -> None:
    """Poll ``gateway``'s index (its blocks on every replica, optimistic ones left out)
    until ``ok``; fail after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        replicas = httpx.get(gateway + "/router/stats", timeout=10).json()["replicas"]
        blocks = sum(r["blocks"] - r["optimistic_blocks"] for r in replicas.values())
        if ok(blocks):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within 30 s ({blocks} blocks)")
        time.sleep(0.1)  # the polling period


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default="http://127.0.0.1:8800", help="the gateway of `up`")
    p.add_argument("--b", default="http://127.0.0.1:8802", help="a gateway that routed nothing")
    p.add_argument("--tools", action="store_true", help="with a tool definition")
    args = p.parse_args()
    reset = httpx.post(args.a + "/reset_prefix_cache", timeout=60)  # start from an empty cache
    print("reset:", reset.status_code)
    # vLLM queues its cleared event until its next scheduling step: a short request (no
    # full block, so no stored event) brings it out.
    hello = {
        "model": "smollm2-135m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}],
    }
    httpx.post(args.a + "/v1/chat/completions", json=hello, timeout=60)
    wait_for_index(args.b, lambda blocks: blocks == 0, "the engine's cleared event in B")
    first = request(1, "Which file holds the router?", args.tools)
    print("A, messages 1:", post(args.a, "/v1/messages", first))
    if not args.tools:  # with tools the engine refuses it: no event comes to wait for
        wait_for_index(args.b, lambda blocks: blocks > 0, "the engine's stored events in B")
    second = request(2, "Where are the tests?", args.tools)
    print(
        "B, messages 2 (another billing hash and question):", post(args.b, "/v1/messages", second)
    )
    chat = to_chat(request(3, "What does the gateway do?", args.tools))
    print(
        "B, the same as a chat (control):",
        post(args.b, "/v1/chat/completions", {**chat, "max_tokens": 4}),
    )
    # As a gateway that turns Claude Code's requests into chat completions (LiteLLM) sends
    # it: the system blocks as text parts, the billing header first.
    translated = request(4, "How are replicas chosen?", args.tools)
    chat = to_chat(translated)
    chat["messages"][0]["content"] = translated["system"]
    print(
        "B, as a chat with the billing header (a translating gateway's):",
        post(args.b, "/v1/chat/completions", {**chat, "max_tokens": 4}),
    )


if __name__ == "__main__":
    main()
