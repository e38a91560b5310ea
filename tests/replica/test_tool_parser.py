"""The Hermes tool-call parser (replica/tool_parser.py): whole outputs and streams cut
at every position give the same content and calls."""

from __future__ import annotations

import json

import pytest

from replica.tool_parser import HermesStream, ParsedCall, parse_hermes

ONE = 'Let me check.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
TWO = (
    '<tool_call>{"name": "f", "arguments": {"x": "é"}}</tool_call>\n'
    '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
)
UNCLOSED = 'text <tool_call>{"name": "f", "arguments": {"y": [1, 2]}}'
BROKEN = 'a <tool_call>{"name": oops}</tool_call>'
LOOKALIKE = "a < b and <tool_ca but no call <tool"


def _calls(calls: list[ParsedCall]) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_whole_outputs() -> None:
    one = parse_hermes(ONE)
    assert one.content == "Let me check." and _calls(one.calls) == [("f", {"x": 1})]
    assert one.calls[0].id.startswith("chatcmpl-tool-")
    two = parse_hermes(TWO)
    assert two.content is None and _calls(two.calls) == [("f", {"x": "é"}), ("g", {})]
    assert _calls(parse_hermes(UNCLOSED).calls) == [("f", {"y": [1, 2]})]
    assert parse_hermes(BROKEN) == (BROKEN, [])  # never half-parsed
    assert parse_hermes(LOOKALIKE) == (LOOKALIKE, [])


@pytest.mark.parametrize("text", [ONE, TWO, UNCLOSED, BROKEN, LOOKALIKE])
def test_streams_agree_with_whole_outputs_at_every_cut(text: str) -> None:
    whole = parse_hermes(text)
    for step in (1, 2, 3, 7):
        stream = HermesStream()
        content = ""
        calls: list[ParsedCall] = []
        for at in range(0, len(text), step):
            got, done = stream.feed(text[at : at + step])
            content += got
            calls += done
        tail, more = stream.finish()
        content, calls = content + tail, calls + more
        assert (content or None) == whole.content, step
        assert _calls(calls) == _calls(whole.calls) and calls == stream.calls


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    from replica.tool_output import ToolCallChunks, parsed_message

    message, reason = parsed_message(TWO, "stop", single_call=True)
    assert reason == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == [
        "f"
    ]
    both, _ = parsed_message(TWO, "stop")
    assert len(both["tool_calls"]) == 2
    chunks = ToolCallChunks("id", "m", 0, single_call=True).chunks(0, TWO, "stop")
    sent = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in sent] == ["f"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
