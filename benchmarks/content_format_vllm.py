"""Engines told how message content reaches their template (vLLM's
``--chat-template-content-format``), behind a gateway from each tree: do the gateway's keys
find the blocks vLLM cached?

    # two engines under a template that takes content either way (it loops over a list of
    # parts, so vLLM detects "openai"), told "string", e.g. --model SMOLLM2_FOLDER
    # --served-model-name fmt-model --chat-template tests/support/openai_content_template.jinja
    # --chat-template-content-format string, --kv-events-config ...
    .venv/bin/python benchmarks/content_format_vllm.py --model fmt-model \
        --engine http://127.0.0.1:8100,5600,5610 --engine http://127.0.0.1:8101,5601,5611 \
        --tree before=DIR --tree after=.

Each tree's gateway and bridges get the engines' ``--chat-template``, and
``--chat-template-content-format string`` where they know it. Conversations as in
benchmarks/special_tokens_vllm.py, their messages' content as strings and as lists of text
parts (as clients that translate other APIs send them); ``--chats`` conversations of
``--turns`` turns, ``--wait-s`` apart. Prints, over the turns after the first: those the
engine holding the conversation served, the cached tokens the routes predicted, the
prompt tokens the engines read from their cache.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from reasoning_vllm import has_flag
from special_tokens_vllm import chat_turns, parser, run

WAYS = ("content as strings", "content as text parts")
TEMPLATE = Path(__file__).parents[1] / "tests" / "support" / "openai_content_template.jinja"
FLAG = "--chat-template-content-format"


def request(way: str, model: str, turns: list[str]) -> tuple[str, dict[str, Any]]:
    messages: list[dict[str, Any]] = chat_turns(turns)
    if way.endswith("parts"):
        messages = [
            {**m, "content": [{"type": "text", "text": line} for line in m["content"].split(". ")]}
            for m in messages
        ]
    return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1}


def main() -> None:
    args = parser(__doc__, "fmt-model").parse_args()
    engines = [e.split(",") for e in args.engine]
    for name, tree in [t.split("=", 1) for t in args.tree] or [["this", "."]]:
        flags = ["--chat-template", str(TEMPLATE.resolve())]
        told = [FLAG, "string"]
        gateway = flags + (told if has_flag(tree, "gateway", FLAG) else [])
        bridge = flags + (told if has_flag(tree, "bridge", FLAG) else [])
        print(f"{name}: gateway given {' '.join(gateway)}")
        run(tree, name, engines, args, WAYS, request, gateway_args=gateway, bridge_args=bridge)


if __name__ == "__main__":
    main()
