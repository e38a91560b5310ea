"""Claude Code's per-request attribution line (``x-anthropic-billing-header: ...;
cch=...``) at the head of a system prompt is dropped before rendering, as vLLM 0.32 drops
it from chat completions' system messages (``_strip_claude_code_billing_header``) and from
the Messages API's system blocks. A gateway that turns Claude Code's requests into chat
completions (LiteLLM) keeps the line, whose hash changes with every request: kept in the
prompt, no two of an agent's steps would share even their first block, and the gateway's
keys would match none of a vLLM engine's."""

from __future__ import annotations

from typing import Any

import pytest

from prefixgate.chat_input import chat_input, without_billing_header
from prefixgate.tokenizer import ChatTokenizer
from prefixgate.wire import ChatCompletionRequest, parse_request
from prefixgate.wire_messages import to_chat

SYSTEM = "You are a careful coding agent."
USER = {"role": "user", "content": "Fix the failing test."}


def billing(n: int) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.3; cch={n:05x};"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (f"{billing(1)}\n{SYSTEM}", SYSTEM),  # one string: the line goes
        (billing(1), []),  # nothing else: nothing left
        (SYSTEM, SYSTEM),
        (f"{SYSTEM}\n{billing(1)}", f"{SYSTEM}\n{billing(1)}"),  # only at the head of a part
        (
            [{"type": "text", "text": billing(1)}, {"type": "text", "text": SYSTEM, "x": 1}],
            [{"type": "text", "text": SYSTEM, "x": 1}],
        ),
        (
            [{"type": "text", "text": f"{billing(1)}\nfirst"}, {"type": "text", "text": "next"}],
            [{"type": "text", "text": "first"}, {"type": "text", "text": "next"}],
        ),
    ],
)
def test_the_line_goes_the_rest_stays(content: Any, expected: Any) -> None:
    assert without_billing_header(content) == expected


def _ids(tokenizer: ChatTokenizer, body: dict[str, Any]) -> list[int]:
    req = parse_request(ChatCompletionRequest, {"model": "tiny-random", **body})
    assert isinstance(req, ChatCompletionRequest)
    return tokenizer.encode_input(chat_input(req))


def test_two_steps_render_the_same_prompt_whatever_their_hash() -> None:
    tokenizer = ChatTokenizer.for_model("tiny-random")
    plain = _ids(tokenizer, {"messages": [{"role": "system", "content": SYSTEM}, USER]})
    for n in (1, 2):
        as_parts = [{"type": "text", "text": billing(n)}, {"type": "text", "text": SYSTEM}]
        assert (
            _ids(tokenizer, {"messages": [{"role": "system", "content": as_parts}, USER]}) == plain
        )
        one_string = f"{billing(n)}\n{SYSTEM}"
        assert (
            _ids(tokenizer, {"messages": [{"role": "system", "content": one_string}, USER]})
            == plain
        )
    # Only system messages: a user's text that starts so is the user's.
    said = {"role": "user", "content": f"{billing(1)}\nhi"}
    assert _ids(tokenizer, {"messages": [said]}) != _ids(
        tokenizer, {"messages": [{"role": "user", "content": "hi"}]}
    )


def test_the_messages_api_drops_the_block_as_vllm_does() -> None:
    system = [{"type": "text", "text": billing(7)}, {"type": "text", "text": SYSTEM}]
    body = {"model": "m", "system": system, "messages": [USER]}
    assert to_chat(body)["messages"][0] == {"role": "system", "content": SYSTEM}
    # A system message inside ``messages`` that starts with the line goes whole (vLLM).
    inline = {"role": "system", "content": f"{billing(7)}\nmore"}
    assert to_chat({"model": "m", "messages": [USER, inline]})["messages"] == [USER]
