"""Prompts cut by vLLM's ``truncate_prompt_tokens``, behind a gateway from each tree: do the
gateway's keys find the blocks vLLM cached from where it cut?

    # two engines, e.g. --model SMOLLM2_FOLDER --served-model-name smollm2-135m,
    # --kv-events-config endpoint tcp://*:560N ...
    .venv/bin/python benchmarks/truncation_vllm.py \
        --engine http://127.0.0.1:8100,5600,5610 --engine http://127.0.0.1:8101,5601,5611 \
        --tree before=DIR --tree after=.

vLLM keeps a prompt's last N tokens (``truncate_prompt_tokens: N``; its side for
generating models), so its blocks start where it cut: a prompt over N shares them only
with the same prompt sent again, as a chat UI's "regenerate", a client's retry or an
evaluation's rerun sends it. Per tree: Redis, a bridge per engine and a gateway
(benchmarks/hub_models_vllm.py's ``Stack``). ``--docs`` documents of ``--words`` words,
as a chat and as a completion, each cut to ``--keep`` tokens; each asked, then asked again
the same ``--wait-s`` later (past the router's 30 s record of where it sent a prompt).
Prints per way: the second asks served where the first was, the cached tokens their
routes predicted, the prompt tokens the engines read from their cache.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from hub_models_vllm import Stack, documents, reset
from reasoning_vllm import KEY_TOKENS, ask
from special_tokens_vllm import parser

WAYS = ("chat, regenerated", "completion, regenerated")


def request(way: str, model: str, doc: str, keep: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": 1, "truncate_prompt_tokens": keep}
    if way.startswith("chat"):
        body["messages"] = [{"role": "user", "content": f"{doc}\n\nSummarise it."}]
        return "/v1/chat/completions", body
    return "/v1/completions", {**body, "prompt": f"{doc}\n\nSummary:"}


def run(tree: str, label: str, engines: list[list[str]], args: argparse.Namespace) -> None:
    docs = documents(args.docs * len(WAYS), args.words, args.seed)
    with tempfile.TemporaryDirectory() as work:
        stack = Stack(tree, engines, Path(work))
        try:
            reset(engines, args.model)
            asks = [
                request(way, args.model, docs[w * args.docs + i], args.keep)
                for w, way in enumerate(WAYS)
                for i in range(args.docs)
            ]
            first = [ask(stack.url, path, body)[0] for path, body in asks]
            time.sleep(args.wait_s)  # the experiment's interval, not a wait for a server
            for w, way in enumerate(WAYS):
                followed = predicted = prompt_total = cached_total = 0
                for i in range(w * args.docs, (w + 1) * args.docs):
                    replica, route, prompt, cached = ask(stack.url, *asks[i])
                    found = re.search(r"matched=(\d+)/", route)
                    predicted += int(found.group(1)) * KEY_TOKENS if found else 0
                    followed += replica == first[i]
                    prompt_total += prompt
                    cached_total += cached
                print(
                    f"{label}: {way}: second asks served where the first was "
                    f"{followed}/{args.docs}; routes predicted {predicted} cached tokens, the "
                    f"engines read {cached_total} of {prompt_total} from their cache "
                    f"({cached_total / prompt_total:.0%})"
                )
        finally:
            stack.stop()


def main() -> None:
    p = parser(__doc__, "smollm2-135m")
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--keep", type=int, default=512)
    p.set_defaults(words=700)
    args = p.parse_args()
    engines = [e.split(",") for e in args.engine]
    for name, tree in [t.split("=", 1) for t in args.tree] or [["this", "."]]:
        run(tree, name, engines, args)


if __name__ == "__main__":
    main()
