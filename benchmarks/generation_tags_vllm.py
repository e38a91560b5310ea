"""A fine-tuned model whose chat template has ``{% generation %}`` blocks, behind a gateway
from each tree: do the gateway's keys find the blocks vLLM cached?

    # two engines on such a model, e.g. SmolLM2-135M's files with its template's
    # assistant turns in {% generation %} (as TRL saves templates for assistant-only loss):
    # --model /tmp/trl-model --served-model-name trl-model, --kv-events-config ...
    .venv/bin/python benchmarks/generation_tags_vllm.py \
        --engine http://127.0.0.1:8100,5600,5610 --engine http://127.0.0.1:8101,5601,5611 \
        --tree before=DIR --tree after=.

The gateway takes the model's tokenizer, template included, from the engines' model
cards (their ``root``). Conversations as in benchmarks/special_tokens_vllm.py, sent as
chat completions whose history holds the assistant's replies (the blocks the tags mark):
``--chats`` conversations of ``--turns`` turns, ``--wait-s`` apart. Prints, over the turns
after the first: those the engine holding the conversation served, the cached tokens the
routes predicted, the prompt tokens the engines read from their cache.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from special_tokens_vllm import chat_turns, run_trees

WAYS = ("chat with the assistant's replies",)


def request(way: str, model: str, turns: list[str]) -> tuple[str, dict[str, Any]]:
    body = {"model": model, "messages": chat_turns(turns), "max_tokens": 1}
    return "/v1/chat/completions", body


def main() -> None:
    run_trees(__doc__, "trl-model", WAYS, request)


if __name__ == "__main__":
    main()
