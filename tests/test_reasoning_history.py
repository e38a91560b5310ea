"""An assistant turn's reasoning sent back in the history reaches the chat template as
vLLM hands it over: ``reasoning`` (or the older ``reasoning_content``) under both names,
and an Anthropic ``thinking`` block as the assistant's ``reasoning``. Reasoning models'
templates render it (Qwen3 between ``<think>`` tags in the turns after the last user
message, every step of an agent's tool loop), so the prompt, the gateway's keys and a
vLLM engine's cache all depend on it."""

from __future__ import annotations

from typing import Any

import pytest

from prefixgate.chat_input import chat_input
from prefixgate.tokenizer import ChatTokenizer
from prefixgate.wire import ChatCompletionRequest, OpenAIError, parse_request
from prefixgate.wire_messages import to_chat

# The part of Qwen3's template that matters here: an assistant turn's reasoning.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content is string %}"
    "<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
)
USER = {"role": "user", "content": "What is the weather in Paris?"}
THOUGHT = "The user wants the weather; call the tool."


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    t = ChatTokenizer.for_model("tiny-random")
    t.set_chat_template(TEMPLATE)
    return t


def _render(tokenizer: ChatTokenizer, messages: list[Any]) -> str:
    req = parse_request(ChatCompletionRequest, {"model": "tiny-random", "messages": messages})
    assert isinstance(req, ChatCompletionRequest)
    return tokenizer.render(chat_input(req))


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_an_assistants_reasoning_is_rendered(tokenizer: ChatTokenizer, field: str) -> None:
    turn = {"role": "assistant", "content": "Calling it.", field: THOUGHT}
    assert f"<think>{THOUGHT}</think>Calling it." in _render(tokenizer, [USER, turn])


def test_reasoning_wins_over_reasoning_content(tokenizer: ChatTokenizer) -> None:
    turn = {"role": "assistant", "content": "x", "reasoning": "new", "reasoning_content": "old"}
    assert "<think>new</think>" in _render(tokenizer, [USER, turn])


def test_only_an_assistants_reasoning_counts(tokenizer: ChatTokenizer) -> None:
    said = {**USER, "reasoning": THOUGHT}
    assert THOUGHT not in _render(tokenizer, [said])


def test_reasoning_that_is_not_text_is_a_400(tokenizer: ChatTokenizer) -> None:
    with pytest.raises(OpenAIError, match="reasoning must be a string"):
        _render(tokenizer, [USER, {"role": "assistant", "content": "x", "reasoning": 5}])


def test_an_anthropic_thinking_block_is_the_assistants_reasoning(
    tokenizer: ChatTokenizer,
) -> None:
    thinking = {"type": "thinking", "thinking": THOUGHT, "signature": "abc"}
    text = {"type": "text", "text": "Calling it."}
    body = {"model": "m", "messages": [USER, {"role": "assistant", "content": [thinking, text]}]}
    chat = to_chat(body)
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": "Calling it.",
        "reasoning": THOUGHT,
    }
    assert f"<think>{THOUGHT}</think>Calling it." in _render(tokenizer, chat["messages"])
