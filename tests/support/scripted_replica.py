"""A real tiny-random replica whose sampled tokens follow a script: test equipment.

Everything is the real replica (server, engine, forward pass, prefix cache, publisher)
except the token draw, which is replaced so that an agent's turns are deterministic:

* a prompt whose last turn holds a ``<tool_response`` gets ``ANSWER``;
* a prompt that lists tools (``<tools>``) gets ``TOOL_CALL`` (Hermes format);
* any other prompt gets ``PLAIN``;

each followed by the end-of-sequence token. A random model cannot be made to emit a tool
call otherwise. Run as ``python -m tests.support.scripted_replica <replica flags>``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 21 C and sunny in Paris."
PLAIN = "Hello from the script."


def script_for(prompt: str) -> str:
    last_user = prompt.rsplit("<|im_start|>user", 1)[-1]
    if "<tool_response" in last_user:
        return ANSWER
    if "<tools>" in prompt:
        return TOOL_CALL
    return PLAIN


def scripted(
    decode: Callable[[list[int]], str], encode: Callable[[str], list[int]], eos: int
) -> Callable[..., int]:
    forced: dict[tuple[int, ...], list[int]] = {}

    def sample(
        row: Any,
        params: Any,
        generator: Any,
        token_ids: Sequence[int],
        num_prompt: int,
        banned: Any = (),
        grammar: Any = None,
    ) -> int:
        prompt = tuple(token_ids[:num_prompt])
        tokens = forced.get(prompt)
        if tokens is None:
            tokens = [*encode(script_for(decode(list(prompt)))), eos]
            forced[prompt] = tokens
        position = len(token_ids) - num_prompt
        return tokens[min(position, len(tokens) - 1)]

    return sample


def main() -> int:
    import replica.torch_backend as torch_backend
    from prefixgate.tokenizer import ChatTokenizer
    from replica.cli import main as replica_main

    tokenizer = ChatTokenizer.for_model("tiny-random")
    torch_backend.sample_token = scripted(  # type: ignore[assignment]
        lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        lambda text: tokenizer.tokenizer.encode(text, add_special_tokens=False).ids,
        tokenizer.eos_token_ids[0],
    )
    return replica_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
