"""Chats with tools: rendered id for id as transformers renders them, from requests
converted as vLLM converts them (prefixgate/chat_input.py), on a tool-aware template
written for the tests (tests/support/tool_template.jinja, Hermes/Qwen style)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from prefixgate.chat_input import ChatInput, chat_input, without_developer_role
from prefixgate.content_format import shaped_messages
from prefixgate.models import ensure_tokenizer_dir
from prefixgate.segments import SegmentCache
from prefixgate.tokenizer import ChatTemplateError, ChatTokenizer
from prefixgate.wire import ChatCompletionRequest, OpenAIError, parse_request

TEMPLATE = Path(__file__).parent / "support" / "tool_template.jinja"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now", "strict": True}}

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}

BODIES: list[dict[str, Any]] = [
    # a tool loop: call, result, answer
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ],
        "tools": [WEATHER, CLOCK],
    },
    # parallel calls, content parts, names, invalid arguments
    {
        "messages": [
            {
                "role": "user",
                "name": "ann",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    CALL,
                    {**CALL, "id": "call_2", "function": {"name": "now", "arguments": "not json"}},
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "21C"}],
            },
            {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
            {"role": "developer", "content": "Answer now."},
        ],
        "tools": [WEATHER],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    # no tools, documents
    {
        "messages": [{"role": "user", "content": "Summarize."}],
        "documents": [{"title": "A", "text": "alpha"}, {"text": "beta"}],
    },
    # continue the final message
    {
        "messages": [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "Hi, I am "},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "tools": [CLOCK],
    },
]


@pytest.fixture(scope="module")
def source() -> str:
    return TEMPLATE.read_text()


@pytest.fixture(scope="module")
def ours(source: str) -> ChatTokenizer:
    tokenizer = ChatTokenizer.from_dir(ensure_tokenizer_dir("tiny-random"))
    tokenizer.set_chat_template(source)
    return tokenizer


@pytest.fixture(scope="module")
def reference() -> Iterator[PreTrainedTokenizerBase]:
    path = ensure_tokenizer_dir("tiny-random")
    yield AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _request(body: dict[str, Any]) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": "m", **body})


@pytest.mark.parametrize("body", BODIES)
def test_rendered_ids_match_transformers(
    ours: ChatTokenizer, reference: PreTrainedTokenizerBase, source: str, body: dict[str, Any]
) -> None:
    chat = chat_input(_request(body))
    kwargs = dict(
        tools=chat.tools,
        documents=chat.documents,
        chat_template=source,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        **chat.template_kwargs,
    )
    # what vLLM hands transformers: string content (the template never loops over it), and
    # the template never names the developer role
    assert ours.content_format == "string" and not ours.developer_role
    messages = without_developer_role(shaped_messages(chat.messages, "string"))
    text: Any = reference.apply_chat_template(messages, tokenize=False, **kwargs)
    encoded: Any = reference.apply_chat_template(messages, tokenize=True, **kwargs)
    assert ours.render(chat) == text
    assert ours.encode_input(chat) == encoded["input_ids"]
    assert SegmentCache(ours).encode_input(chat) == encoded["input_ids"]


def test_messages_are_converted_as_vllm_converts_them() -> None:
    chat = chat_input(_request(BODIES[1]))
    sent = chat.messages[0]["content"]
    assert sent == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    user, assistant, tool_1, _, developer = shaped_messages(chat.messages, "string")
    assert user == {"role": "user", "content": "a\nb", "name": "ann"}
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [{"city": "Paris"}, {}]
    assert assistant["tool_calls"][0]["id"] == "call_1"
    assert tool_1 == {"role": "tool", "content": "21C", "tool_call_id": "call_1"}
    assert developer == {"role": "developer", "content": "Answer now.", "tools": None}
    merged = without_developer_role(shaped_messages(chat.messages, "string"))
    # a system message that is not first moves to the front (vLLM's consolidation)
    assert [m["role"] for m in merged] == ["system", "user", "assistant", "tool", "tool"]
    with_system = chat_input(
        _request({"messages": [{"role": "system", "content": "S"}, *BODIES[1]["messages"]]})
    )
    head, *rest = without_developer_role(shaped_messages(with_system.messages, "string"))
    assert head == {"role": "system", "content": "S\n\nAnswer now."}
    assert all(m["role"] != "system" for m in rest)
    first = chat_input(_request(BODIES[0]))
    assert first.messages[2]["content"] == []  # content null: no parts
    assert shaped_messages(first.messages, "string")[2]["content"] == ""
    assert first.tools is not None
    assert first.tools[0]["function"]["description"] == "Current weather in a city."
    assert first.tools[1] == {
        "type": "function",
        "function": {"name": "now", "description": None, "parameters": None, "strict": True},
    }  # defer_loading only when set, as vLLM 0.32 dumps it
    deferred = chat_input(_request({**BODIES[0], "tools": [{**CLOCK, "defer_loading": True}]}))
    assert deferred.tools is not None
    assert deferred.tools[0]["defer_loading"] is True
    assert deferred.tools[0]["function"]["defer_loading"] is True


def test_tools_change_the_ids(ours: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    plain = ours.encode_input(ChatInput.plain(messages))
    one = ours.encode_input(chat_input(_request({"messages": messages, "tools": [WEATHER]})))
    two = ours.encode_input(chat_input(_request({"messages": messages, "tools": [CLOCK]})))
    assert len({tuple(plain), tuple(one), tuple(two)}) == 3


def test_a_template_without_tools_ignores_them(ours: ChatTokenizer) -> None:
    plain = ChatTokenizer.from_dir(ensure_tokenizer_dir("tiny-random"))
    assert plain.template_ignores_tools and not ours.template_ignores_tools
    messages = [{"role": "user", "content": "hi"}]
    with_tools = chat_input(_request({"messages": messages, "tools": [WEATHER]}))
    assert plain.encode_input(with_tools) == plain.encode_chat(messages)


def test_bad_requests_are_400s(ours: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(OpenAIError, match="cannot both be true"):
        chat_input(_request({"messages": messages, "continue_final_message": True}))
    with pytest.raises(OpenAIError, match="may not set messages"):
        chat_input(_request({"messages": messages, "chat_template_kwargs": {"messages": []}}))
    continued = {"messages": messages, "add_generation_prompt": False}
    chat = chat_input(_request({**continued, "continue_final_message": True}))
    assert ours.render(chat).endswith("hi")
    with pytest.raises(OpenAIError, match="tools"):
        parse_request(
            ChatCompletionRequest, {"model": "m", "messages": messages, "tools": [{"type": "x"}]}
        )
    # a tool definition the template cannot iterate is the request's error, not a 500
    broken = chat_input(_request({"messages": messages, "documents": [{"title": 1}]}))
    with pytest.raises(ChatTemplateError):
        ours.render(broken)


def test_a_template_that_names_the_developer_role_gets_it(
    reference: PreTrainedTokenizerBase,
) -> None:
    source = (
        "{% for m in messages %}{% if m.role == 'developer' %}[dev]{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    tokenizer = ChatTokenizer.from_dir(ensure_tokenizer_dir("tiny-random"))
    tokenizer.set_chat_template(source)
    assert tokenizer.developer_role
    body = {"messages": [{"role": "developer", "content": "D"}, {"role": "user", "content": "U"}]}
    chat = chat_input(_request(body))
    expected: Any = reference.apply_chat_template(
        chat.messages, chat_template=source, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.render(chat) == expected and expected.startswith("[dev]")
