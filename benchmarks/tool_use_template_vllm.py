"""A model with a named ``tool_use`` chat template (Hermes', Command R's), behind a gateway
from each tree: do the gateway's keys find the blocks vLLM cached for chats with tools?

    # two engines on such a model, e.g. SmolLM2-135M's files with a Hermes-style template
    # in additional_chat_templates/tool_use.jinja (benchmarks/render_parity_template.jinja):
    # --model /tmp/tool-model --served-model-name tool-model --enable-auto-tool-choice \
    # --tool-call-parser hermes, --kv-events-config ...
    .venv/bin/python benchmarks/tool_use_template_vllm.py \
        --engine http://127.0.0.1:8100,5600,5610 --engine http://127.0.0.1:8101,5601,5611 \
        --tree before=DIR --tree after=.

transformers and vLLM render a chat that carries tools with the model's "tool_use"
template, and others with its default. The gateway takes the model's tokenizer from the
engines' model cards (their ``root``). Conversations as in
benchmarks/special_tokens_vllm.py, each an agent's: two tools in every request, the
history holding the assistant's replies; ``--chats`` conversations of ``--turns`` turns,
``--wait-s`` apart. Prints, over the turns after the first: those the engine holding the
conversation served, the cached tokens the routes predicted, the prompt tokens the
engines read from their cache.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from special_tokens_vllm import chat_turns, run_trees

WAYS = ("chat with tools",)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
    for name, description in (("search_notes", "Search the notes."), ("add_note", "Add a note."))
]


def request(way: str, model: str, turns: list[str]) -> tuple[str, dict[str, Any]]:
    body = {"model": model, "messages": chat_turns(turns), "tools": TOOLS, "max_tokens": 1}
    return "/v1/chat/completions", body


def main() -> None:
    run_trees(__doc__, "tool-model", WAYS, request)


if __name__ == "__main__":
    main()
