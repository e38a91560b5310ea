"""Completions whose prompt holds its own BOS, behind a gateway from each tree: do the
gateway's keys find the blocks vLLM cached?

    # two engines on a model whose tokenizer adds a BOS (Llama 3's, Gemma's, Mistral's
    # do; here SmolLM2's weights with such a tokenizer), e.g. --model /tmp/bos-model
    # --served-model-name bos-model, --kv-events-config endpoint tcp://*:560N ...
    .venv/bin/python benchmarks/special_tokens_vllm.py --model bos-model \
        --engine http://127.0.0.1:8100,5600,5610 --engine http://127.0.0.1:8101,5601,5611 \
        --tree before=DIR --tree after=.

A client that renders its chats itself (its own template, BOS included: agent and
rollout frameworks do) sends the text to ``/v1/completions`` with ``add_special_tokens:
false``, as vLLM's docs advise, or the engine adds a second BOS. Per tree: Redis, a bridge
per engine and a gateway (benchmarks/hub_models_vllm.py's ``Stack``). ``--chats``
conversations of ``--turns`` turns, each turn its whole history again plus a new user
message of about ``--words`` words, turns ``--wait-s`` apart (past the router's 30 s
record of where it sent a prompt, as a slow tool call or a person's reply is: only the
engines' published blocks place a turn then); as such rendered prompts, and as plain
completions (the tokenizer's BOS added, a control). Prints per way, over the turns after
the first: those the engine holding the conversation served, the cached tokens their
routes predicted (``matched=M/N``: M keys of 16 tokens), the prompt tokens the engines
read from their cache.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from hub_models_vllm import Stack, documents, reset
from reasoning_vllm import KEY_TOKENS, ask

WAYS = ("rendered by the client, add_special_tokens false", "plain, BOS added (control)")
BOS = "<|endoftext|>"  # the tokenizer's


def request(way: str, model: str, turns: list[str]) -> tuple[str, dict[str, Any]]:
    if way.startswith("rendered"):
        chat = "".join(
            f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\nNoted.<|im_end|>\n"
            for t in turns
        )
        prompt = f"{BOS}{chat}<|im_start|>assistant\n"
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "add_special_tokens": False}
        return "/v1/completions", body
    return "/v1/completions", {"model": model, "prompt": "\n\n".join(turns), "max_tokens": 1}


Request = Callable[[str, str, list[str]], tuple[str, dict[str, Any]]]


def run(
    tree: str,
    label: str,
    engines: list[list[str]],
    args: argparse.Namespace,
    ways: Sequence[str] = WAYS,
    request: Request = request,
    gateway_args: list[str] | None = None,
    bridge_args: list[str] | None = None,
) -> None:
    """``args.chats`` conversations per way, their turns ``args.wait_s`` apart, through a
    stack from ``tree`` (its gateway and bridges given ``gateway_args``, ``bridge_args``);
    ``request(way, model, turns)``: a turn's path and body."""
    texts = documents(args.chats * len(ways) * args.turns, args.words, args.seed)
    chats = [texts[i * args.turns : (i + 1) * args.turns] for i in range(args.chats * len(ways))]
    with tempfile.TemporaryDirectory() as work:
        stack = Stack(tree, engines, Path(work), gateway_args, bridge_args)
        try:
            reset(engines, args.model)
            last: dict[int, str] = {}
            totals = {way: [0, 0, 0, 0, 0] for way in ways}  # turns, followed, predicted, ...
            for turn in range(args.turns):
                if turn:
                    time.sleep(args.wait_s)  # the conversation's pause, not a wait for a server
                for c, chat in enumerate(chats):
                    way = ways[c // args.chats]
                    path, body = request(way, args.model, chat[: turn + 1])
                    replica, route, prompt, cached = ask(stack.url, path, body)
                    if turn:
                        found = re.search(r"matched=(\d+)/", route)
                        t = totals[way]
                        t[0] += 1
                        t[1] += replica == last[c]
                        t[2] += int(found.group(1)) * KEY_TOKENS if found else 0
                        t[3] += cached
                        t[4] += prompt
                    last[c] = replica
            for way, (n, followed, predicted, cached, prompt) in totals.items():
                print(
                    f"{label}: {way}: later turns served where the conversation was "
                    f"{followed}/{n}; routes predicted {predicted} cached tokens, the engines "
                    f"read {cached} of {prompt} from their cache ({cached / prompt:.0%})"
                )
        finally:
            stack.stop()


def parser(doc: str, model: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--engine", action="append", required=True, metavar="URL,EVENTS,REPLAY")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--model", default=model)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--words", type=int, default=200)
    p.add_argument("--wait-s", type=float, default=35.0)
    p.add_argument("--seed", type=int, default=0)
    return p


def chat_turns(turns: list[str]) -> list[dict[str, str]]:
    """A conversation's chat up to its latest turn: a system prompt, then each turn's
    user message, and the assistant's reply to each turn but the latest."""
    messages = [{"role": "system", "content": "You keep notes."}]
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"Noted, part {i + 1}."})
    return messages


def run_trees(doc: str, model: str, ways: Sequence[str] = WAYS, request: Request = request) -> None:
    """``run`` for each ``--tree`` of the command line (``doc``: the script's docstring)."""
    args = parser(doc, model).parse_args()
    engines = [e.split(",") for e in args.engine]
    for name, tree in [t.split("=", 1) for t in args.tree] or [["this", "."]]:
        run(tree, name, engines, args, ways, request)


def main() -> None:
    run_trees(__doc__, "bos-model")


if __name__ == "__main__":
    main()
