"""Responses input items as the chat an engine renders (prefixgate/wire_responses.py),
item by item as vLLM 0.32 builds it (``construct_chat_messages_with_tool_call``)."""

from __future__ import annotations

from typing import Any

import pytest

from prefixgate.wire import OpenAIError
from prefixgate.wire_responses import ResponsesRequest, chat_body, input_messages

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "42"}
REASONING = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [{"type": "summary_text", "text": "short"}],
    "content": [{"type": "reasoning_text", "text": "long"}],
}
IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}


def request(items: list[dict[str, Any]], **extra: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": items, **extra})


def test_a_call_joins_the_assistant_message_before_it() -> None:
    """An assistant's words, then its call: one assistant turn (vLLM's rule); before,
    two turns, which a template renders as two assistant turns the engine never saw."""
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]}
    call2 = {**CALL, "call_id": "c2"}
    messages = input_messages(request([said, CALL, call2, OUTPUT]))
    assert [m["role"] for m in messages] == ["assistant", "tool"]
    assert messages[0]["content"] == "Checking."
    assert [c["id"] for c in messages[0]["tool_calls"]] == ["c1", "c2"]
    after_tool = input_messages(request([CALL, OUTPUT, call2]))
    assert [m["role"] for m in after_tool] == ["assistant", "tool", "assistant"]


def test_the_replica_refuses_what_it_cannot_render() -> None:
    for items in ([{"role": "user", "content": [IMAGE]}], [REASONING], [{"type": "mcp_call"}]):
        with pytest.raises(OpenAIError):
            input_messages(request(items))
    with pytest.raises(OpenAIError):
        chat_body(request([], tools=[{"type": "web_search_preview"}]), [])


def test_the_gateway_keys_what_an_engine_may_take() -> None:
    """Images stay parts of their message; a reasoning item is its assistant turn's
    reasoning (content before summary), and the call after it joins that turn; other
    items and built-in tools are left out of the keys."""
    look = {"role": "user", "content": [{"type": "input_text", "text": "What?"}, IMAGE]}
    items: list[dict[str, Any]] = [look, REASONING, CALL, OUTPUT, {"type": "item_reference"}]
    tools = [{"type": "web_search_preview"}, {"type": "function", "name": "f"}]
    body = chat_body(request(items, tools=tools), [], lenient=True)
    user, assistant, tool = body["messages"]
    assert user["content"] == [{"type": "text", "text": "What?"}, IMAGE]
    assert assistant["reasoning"] == "long" and assistant["tool_calls"][0]["id"] == "c1"
    assert tool["role"] == "tool"
    assert [t["function"]["name"] for t in body["tools"]] == ["f"]
    summary_only = {**REASONING, "content": None}
    assert input_messages(request([summary_only]), lenient=True)[0]["reasoning"] == "short"


def test_an_answer_sent_back_joins_its_reasoning() -> None:
    """The Agents SDK sends a reasoning model's last output items back as they came: a
    reasoning item, then the message; vLLM renders them as one assistant turn."""
    said = {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Hi."}],
    }
    messages = input_messages(request([REASONING, said]), lenient=True)
    assert messages == [{"role": "assistant", "content": "Hi.", "reasoning": "long"}]
