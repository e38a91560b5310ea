"""What a chat template renders, built from a Chat Completions request as vLLM builds it.

The gateway's keys and the replica's prompt come from the same ``ChatInput``, so they
agree, and both agree with a vLLM engine serving the same template:

* content: kept as sent (a string, a list of text parts as ``{"type": "text", "text":
  ...}`` dicts with any extra fields, or ``null`` as an empty list); the tokenizer shapes
  it for its template (``prefixgate.content_format``: one joined string for a "string"
  template, a list of parts for an "openai" one, as vLLM does);
* assistant ``tool_calls`` are kept, each ``function.arguments`` JSON string decoded to a
  dict (what tool-use templates expect; invalid JSON or a non-object becomes ``{}``, as
  vLLM does so that a conversation with one bad call can go on); an empty list is dropped;
* ``tool_call_id`` on tool messages and ``name`` on any message are kept; an assistant's
  ``reasoning`` (or ``reasoning_content``) goes to the template under both names;
* system messages lose Claude Code's per-request attribution line, as vLLM drops it
  (``without_billing_header``);
* ``developer`` messages keep their role and carry ``tools`` (null unless sent); a
  template that never names the developer role gets them as ``system`` messages, all
  system messages merged into the first (``prefixgate.tokenizer``, as vLLM does);
* ``tools`` as ``prefixgate.tools.tool_dicts``; ``documents``,
  ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``
  passed through as transformers' ``apply_chat_template`` passes them;
* ``reasoning_effort`` reaches the template as a variable, and, unless the request's
  ``chat_template_kwargs`` name it, so does ``enable_thinking`` (false for "none"): the
  way vLLM 0.32 turns a reasoning request into the switch Qwen3's, SmolLM3's and Gemma's
  templates read. The request's own fields win over its ``chat_template_kwargs``, and
  both over the server's ``--default-chat-template-kwargs`` (``ChatInput.variables``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from prefixgate.tools import tool_dicts
from prefixgate.wire import ChatCompletionRequest, ChatMessage, OpenAIError

# Claude Code's per-request attribution line at the head of its system prompt.
BILLING_HEADER = "x-anthropic-billing-header"
# Template variables the request may not set through chat_template_kwargs: the renderer
# sets them itself.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "chat_template", "tokenize"})
# Values that leave a variable as a lower layer set it (vLLM's ``merge_kwargs``).
UNSET = (None, "auto")


@dataclass(slots=True, frozen=True)
class ChatInput:
    """Everything a chat template is rendered with, apart from the special tokens."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    # tool_choice "none": an engine started with vLLM's --exclude-tools-when-tool-choice-none
    # renders such a chat without its tools (``without_tools_if``)
    tool_choice_none: bool = False
    # The messages as the client sent them, for a tokenizer that encodes the request
    # itself rather than rendering a template (prefixgate/mistral_tokenizer.py)
    sent: list[ChatMessage] | None = None

    def without_tools_if(self, exclude_when_none: bool) -> ChatInput:
        """The chat as an engine renders it that leaves out the tools of a chat whose
        ``tool_choice`` is "none" when ``exclude_when_none`` (vLLM's
        ``--exclude-tools-when-tool-choice-none``): then with no tools, else as it is."""
        if exclude_when_none and self.tool_choice_none and self.tools is not None:
            return replace(self, tools=None)
        return self

    def sent_messages(self) -> list[dict[str, Any]]:
        """The messages as sent, as JSON (``messages`` for a chat built without them)."""
        if self.sent is None:
            return [dict(m) for m in self.messages]
        return [m.model_dump(mode="json", exclude_none=True) for m in self.sent]

    @classmethod
    def plain(cls, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> ChatInput:
        """Role/content messages with nothing else (benchmarks, tests, tools)."""
        return cls(messages=messages, add_generation_prompt=add_generation_prompt)

    def variables(self, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """The template's variables (without special tokens), layered as vLLM 0.32 layers
        them: the server's ``defaults`` (``--default-chat-template-kwargs``), then the
        request's ``chat_template_kwargs``, then its own fields (``documents``, the
        generation prompt's two, ``reasoning_effort`` and the ``enable_thinking`` it
        implies); a value in ``UNSET`` leaves what is below it."""
        fields: dict[str, Any] = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "documents": self.documents,
            "reasoning_effort": self.reasoning_effort,
        }
        if self.reasoning_effort is not None and "enable_thinking" not in self.template_kwargs:
            fields["enable_thinking"] = self.reasoning_effort != "none"
        kwargs = _layered(defaults or {}, _layered(self.template_kwargs, fields))
        return {
            "messages": [dict(m) for m in self.messages],
            "tools": self.tools,
            "documents": None,  # transformers passes its own arguments, set or not
            **kwargs,
        }


def _layered(below: dict[str, Any], above: dict[str, Any]) -> dict[str, Any]:
    return below | {k: v for k, v in above.items() if not _unset(v)}


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value in UNSET)


def template_defaults(text: str, flag: str = "--default-chat-template-kwargs") -> dict[str, Any]:
    """A ``--default-chat-template-kwargs`` value: a JSON object, as vLLM's flag takes it;
    ValueError otherwise."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag} {text!r}: not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{flag} {text!r}: expected a JSON object")
    if reserved := sorted(RESERVED_TEMPLATE_VARS & value.keys()):
        raise ValueError(f"{flag} may not set {', '.join(reserved)}")
    return value


def chat_input(req: ChatCompletionRequest) -> ChatInput:
    """The request's chat, as the template sees it; a 400 for what cannot be rendered."""
    if req.add_generation_prompt and req.continue_final_message:
        raise OpenAIError(
            "continue_final_message and add_generation_prompt cannot both be true; "
            "set add_generation_prompt to false to continue the last message",
            param="continue_final_message",
        )
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
    if reserved:
        raise OpenAIError(
            f"chat_template_kwargs may not set {', '.join(reserved)}",
            param="chat_template_kwargs",
        )
    return ChatInput(
        messages=[conversation_message(m) for m in req.messages],
        tools=tool_dicts(req.tools),
        documents=req.documents,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        template_kwargs=kwargs,
        reasoning_effort=req.reasoning_effort,
        tool_choice_none=req.tool_choice == "none",
        sent=req.messages,
    )


def conversation_message(message: ChatMessage) -> dict[str, Any]:
    """One message as vLLM hands it to the template."""
    content = message_content(message)
    if message.role == "system":
        content = without_billing_header(content)
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.role == "assistant" and message.tool_calls:
        out["tool_calls"] = [
            {
                **call.model_dump(exclude_none=True),
                "function": {
                    **call.function.model_dump(exclude_none=True),
                    "arguments": decoded_arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.role == "assistant" and (reasoning := assistant_reasoning(message)) is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    if message.role == "tool" and message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    if message.role == "developer":
        out["tools"] = (message.model_extra or {}).get("tools")
    return out


def assistant_reasoning(message: ChatMessage) -> str | None:
    """An assistant turn's reasoning sent back in the history (``reasoning``, or the older
    ``reasoning_content``), which vLLM hands the template under both names: reasoning
    models' templates render it (Qwen3 between ``<think>`` tags in the turns after the
    last user message: every step of an agent's tool loop)."""
    extra = message.model_extra or {}
    reasoning = extra.get("reasoning")
    if reasoning is None:
        reasoning = extra.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise OpenAIError("an assistant message's reasoning must be a string", param="messages")
    return reasoning


def without_developer_role(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that knows no developer role (vLLM's rule): developer messages
    become system messages (without ``tools``), and when a system message is not first
    or there are several, they are merged into one at the front, joined by blank lines."""
    if not any(m["role"] == "developer" for m in messages):
        return messages
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in messages
    ]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    contents = [text for i in systems if (text := content_text(converted[i]["content"]))]
    rest = [m for m in converted if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest]


def message_content(message: ChatMessage) -> str | list[dict[str, Any]]:
    """The content as sent: a string, or its text parts; only text parts are supported."""
    content = message.content
    if content is None:
        return []
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise OpenAIError(
                f"content part type {part.type!r} is not supported; send text parts",
                param="messages",
            )
        parts.append({"type": "text", "text": part.text, **(part.model_extra or {})})
    return parts


def without_billing_header(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A system message without Claude Code's attribution line, as vLLM renders it.

    Claude Code starts its system prompt with ``x-anthropic-billing-header: ...; cch=...``,
    whose hash changes with every request. A gateway that turns its Messages requests into
    chat completions (LiteLLM) keeps the line; vLLM (0.32) drops it from system messages
    before rendering, or no two of an agent's steps would share even their first block.
    The line goes; the rest of its text, if any, stays; a part left empty goes."""

    def strip(text: str) -> str | None:
        if not text.startswith(BILLING_HEADER):
            return text
        return text.partition("\n")[2] or None

    if isinstance(content, str):
        rest = strip(content)
        return [] if rest is None else rest
    parts = []
    for part in content:
        text = part.get("text")
        if not isinstance(text, str):
            parts.append(part)
        elif (rest := strip(text)) is not None:
            parts.append(part if rest is text else {**part, "text": rest})
    return parts


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """Content as one text: text parts joined by newlines (vLLM's "string" format)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if "text" in p)


def decoded_arguments(arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    """A tool call's arguments as a dict; ``{}`` for empty, invalid or non-object JSON."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
