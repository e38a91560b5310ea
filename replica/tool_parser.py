"""``--tool-call-parser hermes``: tool calls in the model's text, as vLLM's Hermes parser
reads them.

The model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block
per call, any number); the text before the first block is the message's content. Calls
get ids (``chatcmpl-tool-…``) and JSON-string arguments, and the choice's finish reason
becomes ``tool_calls``. A block whose JSON does not parse leaves the whole output as plain
content (vLLM's rule: never a half-parsed answer).

Streaming (``HermesStream``): text is passed on until a ``<tool_call>`` may be starting (a
tail that is a prefix of the tag is held back); from the first tag on, each completed block
is emitted as one ``delta.tool_calls`` entry (id, name and the whole arguments), which the
OpenAI clients accumulate as they accumulate partial arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

TOOL_CALL_PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class ParsedCall(NamedTuple):
    id: str
    name: str
    arguments: str  # JSON text

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


class ParsedOutput(NamedTuple):
    content: str | None
    calls: list[ParsedCall]


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(block: str) -> ParsedCall | None:
    try:
        data = json.loads(block.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    return ParsedCall(new_call_id(), data["name"], json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> ParsedOutput:
    """The content and the calls of a finished output."""
    if START not in text:
        return ParsedOutput(text, [])
    calls = []
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1) if match.group(1) is not None else match.group(2))
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
    content = text[: text.index(START)]
    return ParsedOutput(content or None, calls)


@dataclass(slots=True)
class HermesStream:
    """One choice's streamed text in, content deltas and completed calls out."""

    pending: str = ""  # text not yet passed on
    in_calls: bool = False  # a <tool_call> tag has been seen
    calls: list[ParsedCall] = field(default_factory=list)
    failed: bool = False  # a block did not parse: the rest goes out as content

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Content to send now, and the calls completed by ``text``."""
        self.pending += text
        if self.failed:
            out, self.pending = self.pending, ""
            return out, []
        content = ""
        if not self.in_calls:
            at = self.pending.find(START)
            if at < 0:
                keep = _partial_tag_len(self.pending)
                content = self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                return content, []
            content, self.pending = self.pending[:at], self.pending[at:]
            self.in_calls = True
        done: list[ParsedCall] = []
        while True:
            at = self.pending.find(START)
            if at < 0:  # text between or after calls is dropped, as in parse_hermes
                keep = _partial_tag_len(self.pending)
                self.pending = self.pending[len(self.pending) - keep :]
                return content, done
            self.pending = self.pending[at:]
            end = self.pending.find(END)
            if end < 0:
                return content, done
            call = _call(self.pending[len(START) : end])
            if call is None:
                self.failed = True
                out, self.pending = self.pending, ""
                return content + out, done
            done.append(call)
            self.calls.append(call)
            self.pending = self.pending[end + len(END) :]

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of the output: an unclosed block is parsed as vLLM parses it; held
        text that never became a tag is content."""
        rest, self.pending = self.pending, ""
        if not rest:
            return "", []
        if not self.in_calls or self.failed:
            return rest, []
        if rest.startswith(START):
            call = _call(rest[len(START) :])
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return rest, []
        return "", []


def _partial_tag_len(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
