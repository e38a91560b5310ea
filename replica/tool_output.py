"""Chat answers with tool calls: the message's ``tool_calls`` and the stream's
``delta.tool_calls`` chunks, from the model's text through the tool-call parser.

Used for requests whose tool choice is ``auto`` on a replica started with
``--tool-call-parser``, and for forced tool choices (``required``, a named function),
whose text is JSON a grammar held to (``forced_calls``); every other answer is plain
content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from replica import openai_format as fmt
from replica.tool_parser import HermesStream, ParsedCall, new_call_id, parse_hermes


def parsed_message(
    text: str, finish_reason: str, single_call: bool = False
) -> tuple[dict[str, Any], str]:
    """A finished choice's ``message`` and finish reason (``tool_calls`` when it called);
    ``single_call`` (``parallel_tool_calls: false``) keeps the first call, as vLLM does."""
    parsed = parse_hermes(text)
    calls = parsed.calls[:1] if single_call else parsed.calls
    message: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content,
        "tool_calls": [call.as_dict() for call in calls],
    }
    return message, ("tool_calls" if calls else finish_reason)


def forced_calls(text: str, name: str | None) -> list[ParsedCall]:
    """The calls of a forced tool choice's text, as vLLM reads it: for a named function
    (``name``) the text is its arguments; for ``required`` it is a JSON list of
    ``{"name", "parameters"}`` (anything else: no call, as vLLM's lenient parse)."""
    if name is not None:
        return [ParsedCall(new_call_id(), name, text)] if text.strip() else []
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list) or not all(
        isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i for i in items
    ):
        return []
    return [
        ParsedCall(new_call_id(), i["name"], json.dumps(i["parameters"], ensure_ascii=False))
        for i in items
    ]


def forced_message(text: str, finish_reason: str, name: str | None) -> tuple[dict[str, Any], str]:
    """A forced tool choice's ``message`` (content "", the calls) and finish reason:
    ``tool_calls`` for ``required`` when the text ended, as vLLM and OpenAI answer; a
    named function's stays ``stop``."""
    calls = forced_calls(text, name)
    message = {"role": "assistant", "content": "", "tool_calls": [c.as_dict() for c in calls]}
    return message, ("tool_calls" if name is None and finish_reason == "stop" else finish_reason)


@dataclass(slots=True)
class ToolCallChunks:
    """Per choice: a parser over the streamed text, and the calls sent so far."""

    response_id: str
    model: str
    created: int
    single_call: bool = False  # parallel_tool_calls false: only the first call is sent
    streams: dict[int, HermesStream] = field(default_factory=dict)

    def chunks(self, index: int, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        """The chunks for one delta of choice ``index``."""
        stream = self.streams.setdefault(index, HermesStream())
        content, calls = stream.feed(text)
        if finish_reason is not None:
            tail, more = stream.finish()
            content += tail
            calls = [*calls, *more]
        out = []
        if content:
            out.append(self._chunk(index, content=content))
        first = len(stream.calls) - len(calls)
        for offset, call in enumerate(calls):
            if self.single_call and first + offset > 0:
                break
            out.append(self._chunk(index, call=call, call_index=first + offset))
        if finish_reason is not None:
            reason = "tool_calls" if stream.calls else finish_reason
            out.append(self._chunk(index, finish_reason=reason))
        return out

    def forced(
        self, index: int, text: str, finish_reason: str, name: str | None
    ) -> list[dict[str, Any]]:
        """A forced tool choice's chunks at its end: one per call, then the finish."""
        calls = forced_calls(text, name)
        out = [self._chunk(index, call=call, call_index=i) for i, call in enumerate(calls)]
        reason = "tool_calls" if name is None and finish_reason == "stop" else finish_reason
        out.append(self._chunk(index, finish_reason=reason))
        return out

    def _chunk(
        self,
        index: int,
        *,
        content: str | None = None,
        call: ParsedCall | None = None,
        call_index: int = 0,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        chunk = fmt.chat_chunk(
            self.response_id,
            self.model,
            self.created,
            index,
            content=content,
            finish_reason=finish_reason,
        )
        if call is not None:
            chunk["choices"][0]["delta"]["tool_calls"] = [call.as_dict(call_index)]
        return chunk
