"""Engines started with vLLM's ``--exclude-tools-when-tool-choice-none``, behind a gateway
from each tree: do the gateway's keys find the blocks vLLM cached for chats whose
``tool_choice`` is "none"?

    # two engines under a tool template (tools at the head of the system prompt), e.g.
    # --model SMOLLM2_FOLDER --served-model-name tool-model \
    # --chat-template benchmarks/render_parity_template.jinja \
    # --exclude-tools-when-tool-choice-none, --kv-events-config ...
    .venv/bin/python benchmarks/exclude_tools_vllm.py \
        --engine http://127.0.0.1:8100,5600,5610 --engine http://127.0.0.1:8101,5601,5611 \
        --tree before=DIR --tree after=.

A client that sends its tools with every request but has tool use off for a turn (the
final answer of an agent's loop, a chat UI with tools disabled) sends ``tool_choice:
"none"``; such engines render those chats without the tools. Each tree's gateway and
bridges get the engines' ``--chat-template``, and ``--exclude-tools-when-tool-choice-none``
where they know it. Conversations as in benchmarks/special_tokens_vllm.py, two tools in
every request, on chat completions and on the Messages API (``tool_choice: {"type":
"none"}``); ``--chats`` conversations of ``--turns`` turns, ``--wait-s`` apart. Prints,
over the turns after the first: those the engine holding the conversation served, the
cached tokens the routes predicted, the prompt tokens the engines read from their cache.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from reasoning_vllm import has_flag
from special_tokens_vllm import chat_turns, parser, run
from tool_use_template_vllm import TOOLS

WAYS = ("chat, tool_choice none", "messages, tool_choice none")
TEMPLATE = Path(__file__).parent / "render_parity_template.jinja"
FLAG = "--exclude-tools-when-tool-choice-none"


def request(way: str, model: str, turns: list[str]) -> tuple[str, dict[str, Any]]:
    messages = chat_turns(turns)
    if way.startswith("chat"):
        body = {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": "none"}
        return "/v1/chat/completions", {**body, "max_tokens": 1}
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    body = {"model": model, "system": messages[0]["content"], "messages": messages[1:]}
    return "/v1/messages", {
        **body,
        "tools": tools,
        "tool_choice": {"type": "none"},
        "max_tokens": 1,
    }


def main() -> None:
    args = parser(__doc__, "tool-model").parse_args()
    engines = [e.split(",") for e in args.engine]
    for name, tree in [t.split("=", 1) for t in args.tree] or [["this", "."]]:
        flags = ["--chat-template", str(TEMPLATE.resolve())]
        gateway = flags + ([FLAG] if has_flag(tree, "gateway", FLAG) else [])
        print(f"{name}: gateway given {' '.join(gateway)}")
        run(tree, name, engines, args, WAYS, request, gateway_args=gateway, bridge_args=flags)


if __name__ == "__main__":
    main()
