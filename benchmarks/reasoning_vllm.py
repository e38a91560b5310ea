"""Reasoning switches behind a gateway from each tree: do the gateway's keys find the
blocks vLLM cached, when the template renders the switch at the prompt's start?

    # two engines under benchmarks/reasoning_template.jinja, thinking off by default:
    #   --chat-template benchmarks/reasoning_template.jinja \
    #   --default-chat-template-kwargs '{"enable_thinking": false}'
    # with --kv-events-config endpoint tcp://*:560N, replay_endpoint tcp://*:561N
    .venv/bin/python benchmarks/reasoning_vllm.py \
        --engine http://127.0.0.1:8100,5600,5610 --engine http://127.0.0.1:8101,5601,5611 \
        --tree before=DIR --tree after=.

The template names the reasoning mode and effort in its system header, as SmolLM3's
("/think", "/no_think") and gpt-oss's ("Reasoning: high") do. Per tree: Redis, a bridge
per engine and a gateway (benchmarks/hub_models_vllm.py's ``Stack``), all given the
template, and the engines' ``--default-chat-template-kwargs`` where the tree has the flag.
Four ways users set the switch, ``--docs`` documents each: a chat as sent (the server's
default applies), a chat with ``reasoning_effort: "low"``, a Responses request with
``reasoning: {"effort": "high"}``, a Messages request with thinking disabled. Each
document is asked once, then, after ``--wait-s`` (past the router's 30 s record of where
it sent a prompt: only the engines' published blocks place it then), a second question.
Prints per way: the second asks the engine holding the document served, the cached
tokens their routes predicted (``matched=M/N``: M keys of 16 tokens), the prompt tokens
the engines read from their cache; and the bridges' start-up tokenizer parity check.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from hub_models_vllm import Stack, documents, reset

TEMPLATE = Path(__file__).parent / "reasoning_template.jinja"
KEY_TOKENS = 16  # tokens per gateway key (--block-size): a route's matched=M/N is M of them
WAYS = (
    "chat as sent",
    "chat, reasoning_effort low",
    "responses, effort high",
    "messages, no thinking",
)


def request(way: str, model: str, doc: str, question: str) -> tuple[str, dict[str, Any]]:
    if way.startswith("responses"):
        body = {"model": model, "instructions": doc, "input": question, "max_output_tokens": 1}
        return "/v1/responses", {**body, "reasoning": {"effort": "high"}, "store": False}
    messages = [{"role": "user", "content": question}]
    if way.startswith("messages"):
        body = {"model": model, "system": doc, "messages": messages, "max_tokens": 1}
        return "/v1/messages", {**body, "thinking": {"type": "disabled"}}
    body = {"model": model, "messages": [{"role": "system", "content": doc}, *messages]}
    body["max_tokens"] = 1
    if "low" in way:
        body["reasoning_effort"] = "low"
    return "/v1/chat/completions", body


def cached_of(path: str, answer: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, those read from the cache) as each API reports them."""
    u = answer["usage"]
    if path == "/v1/messages":  # Anthropic's: input_tokens leaves out cache writes and reads
        read = u.get("cache_read_input_tokens") or 0
        return u["input_tokens"] + (u.get("cache_creation_input_tokens") or 0) + read, read
    if path == "/v1/responses":
        return u["input_tokens"], (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def ask(url: str, path: str, body: dict[str, Any]) -> tuple[str, str, int, int]:
    """The replica, the route's reason, prompt tokens, cached tokens."""
    r = httpx.post(url + path, json=body, timeout=600)
    r.raise_for_status()
    prompt, cached = cached_of(path, r.json())
    replica = r.headers.get("x-prefixgate-replica", "")
    return replica, r.headers.get("x-prefixgate-route", ""), prompt, cached


def has_flag(tree: str, command: str, flag: str) -> bool:
    env = {"PYTHONPATH": str(Path(tree).resolve())}
    cmd = [sys.executable, "-m", "prefixgate", command, "--help"]
    return flag in subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True).stdout


def run(tree: str, label: str, engines: list[list[str]], args: argparse.Namespace) -> None:
    flags = ["--chat-template", str(TEMPLATE.resolve())]
    defaults = ["--default-chat-template-kwargs", '{"enable_thinking": false}']
    gateway = flags + (defaults if has_flag(tree, "gateway", defaults[0]) else [])
    bridge = flags + (defaults if has_flag(tree, "bridge", defaults[0]) else [])
    print(f"{label}: gateway and bridges given {' '.join(gateway[2:]) or 'no defaults'}")
    docs = documents(args.docs * len(WAYS), args.words, args.seed)
    with tempfile.TemporaryDirectory() as work:
        stack = Stack(tree, engines, Path(work), gateway_args=gateway, bridge_args=bridge)
        try:
            reset(engines, args.model)
            first: dict[tuple[str, int], str] = {}
            for w, way in enumerate(WAYS):
                for i in range(args.docs):
                    path, body = request(way, args.model, docs[w * args.docs + i], "Summarise.")
                    first[way, i] = ask(stack.url, path, body)[0]
            time.sleep(args.wait_s)  # the experiment's interval, not a wait for a server
            for w, way in enumerate(WAYS):
                matched = followed = prompt_total = cached_total = 0
                for i in range(args.docs):
                    path, body = request(way, args.model, docs[w * args.docs + i], "Who wrote it?")
                    replica, route, prompt, cached = ask(stack.url, path, body)
                    found = re.search(r"matched=(\d+)/", route)
                    matched += int(found.group(1)) * KEY_TOKENS if found else 0
                    followed += replica == first[way, i]
                    prompt_total += prompt
                    cached_total += cached
                print(
                    f"{label}: {way}: second asks served where the document was "
                    f"{followed}/{args.docs}; routes predicted {matched} cached tokens, the "
                    f"engines read {cached_total} of {prompt_total} from their cache "
                    f"({cached_total / prompt_total:.0%})"
                )
            for i in range(len(engines)):
                log = (Path(work) / f"bridge-{i}.log").read_text(errors="replace")
                said = ("tokenizer parity", "TOKENIZER MISMATCH")
                lines = [ln for ln in log.splitlines() if any(s in ln for s in said)]
                line = lines[-1].split(": ", 1)[-1].split(":", 1)[0] if lines else "-"
                print(f"{label}: bridge {i}: {line}")
        finally:
            stack.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", action="append", required=True, metavar="URL,EVENTS,REPLAY")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--words", type=int, default=500)
    p.add_argument("--wait-s", type=float, default=35.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    engines = [e.split(",") for e in args.engine]
    for name, tree in [t.split("=", 1) for t in args.tree] or [["this", "."]]:
        run(tree, name, engines, args)


if __name__ == "__main__":
    main()
