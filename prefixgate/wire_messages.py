"""Anthropic's Messages API on the wire (``POST /v1/messages``), read as the chat
completion it becomes. Torch-free; shared by the gateway (keys) and the built-in replica
(prompt and sampling), so both render the same conversation.

The reading is vLLM 0.32's (``vllm/entrypoints/anthropic/serving.py``): the system prompt
first, then each message; ``tool_use`` blocks become the assistant's tool calls and
``thinking`` blocks its ``reasoning`` (which reasoning models' templates render),
``tool_result`` blocks tool messages before the user's own text; tools become functions.
Claude Code's first system block (``x-anthropic-billing-header: ...; cch=...``) changes
with every request; vLLM leaves it out of the prompt, and so does this reading, or no two
steps of one agent would share even their first block. ``cache_salt`` is vLLM's own
extension of the request, kept as it is in a chat completion.

Generation (``chat_request``): ``max_tokens`` is required (as Anthropic's API and vLLM
require it), ``stop_sequences`` are stop strings, ``tool_choice`` ``any`` is
``required`` and ``tool`` a named function, ``disable_parallel_tool_use`` is
``parallel_tool_calls: false``.
"""

from __future__ import annotations

import json
from typing import Any

from prefixgate.chat_input import BILLING_HEADER
from prefixgate.wire import OpenAIError

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_payload(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The whole chat completion request a Messages request runs as: its prompt
    (``to_chat``) and its generation."""
    chat = to_chat(body)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _invalid("max_tokens", "is required, a positive integer")
    stops = body.get("stop_sequences")
    if stops is not None and (
        not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)
    ):
        raise _invalid("stop_sequences", "must be a list of strings")
    chat["max_tokens"] = max_tokens
    optional = {
        "stop": stops or None,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "cache_salt": body.get("cache_salt"),
    }
    chat.update({k: v for k, v in optional.items() if v is not None})
    chat.update(_tool_choice(body.get("tool_choice"), bool(chat.get("tools"))))
    return chat


def _tool_choice(choice: object, tools: bool) -> dict[str, Any]:
    """Anthropic's ``tool_choice`` as the chat fields it stands for."""
    if choice is None:
        return {"tool_choice": "auto"} if tools else {}
    if not isinstance(choice, dict):
        raise _invalid("tool_choice", "must be an object with a type")
    kind = choice.get("type")
    fields: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use") is True:
        fields["parallel_tool_calls"] = False
    if kind in ("auto", "none"):
        fields["tool_choice"] = kind
    elif kind == "any":
        fields["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _invalid("tool_choice", "type must be auto, any, none, or tool with a name")
    return fields


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The prompt of an Anthropic Messages request as a chat completion request's
    ``model``, ``messages``, ``tools`` and a ``tool_choice`` of none (vLLM's reading; see
    the module's docstring).
    A shape it cannot read is a 400."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _invalid("messages", "must be a list of messages")
    system = _texts(body.get("system"), "system")
    chat: list[dict[str, Any]] = [{"role": "system", "content": "".join(system)}] if system else []
    for message in messages:
        if not isinstance(message, dict):
            raise _invalid("messages", "each message must be an object")
        role = message.get("role")
        if role == "system":  # where it stands, as vLLM 0.32 leaves it
            if text := "".join(_texts(message.get("content"), "messages")):
                chat.append({"role": "system", "content": text})
            continue
        if role not in ("user", "assistant"):
            raise _invalid("messages", f"role {role!r} is not user or assistant")
        chat += _message(role, message.get("content"))
    chat_body: dict[str, Any] = {"model": body.get("model"), "messages": chat}
    if (effort := reasoning_effort(body)) is not None:
        chat_body["reasoning_effort"] = effort
    if body.get("chat_template_kwargs") is not None:  # vLLM's extension, passed on
        chat_body["chat_template_kwargs"] = body["chat_template_kwargs"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise _invalid("tools", "must be a list of tools")
        chat_body["tools"] = [{"type": "function", "function": _function(t)} for t in tools]
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") == "none":
            # part of the prompt where the engine leaves such a chat's tools out
            # (vLLM's --exclude-tools-when-tool-choice-none)
            chat_body["tool_choice"] = "none"
    return chat_body


def reasoning_effort(body: dict[str, Any]) -> Any:
    """The ``reasoning_effort`` vLLM 0.32 renders a Messages request with (its template
    reads it, and ``enable_thinking`` from it): ``output_config.effort``, and "none" when
    ``thinking`` is disabled. (vLLM probes its template once and says "low" there
    instead when the template refuses "none" or renders it as it renders some effort, as
    GLM's do; keys from "none" then part from its blocks where the effort is rendered.)"""
    output_config, thinking = body.get("output_config"), body.get("thinking")
    effort = output_config.get("effort") if isinstance(output_config, dict) else None
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        return "none"
    return effort


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic tool as a chat function, as vLLM converts it: ``strict`` and
    ``defer_loading`` carried when set (the template sees them then)."""
    function = {
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("input_schema"),
    }
    for flag in ("strict", "defer_loading"):
        if tool.get(flag) is not None:
            function[flag] = tool[flag]
    return function


def _texts(content: object, param: str) -> list[str]:
    """The text of a system prompt: a string, or its text blocks, less those that are
    Claude Code's billing header, as vLLM leaves them out. (A top-level string keeps the
    header: the chat rendering drops its line, as vLLM's does; a system message in
    ``messages`` that starts with it goes whole, as in vLLM.)"""
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [content] if param == "system" or not content.startswith(BILLING_HEADER) else []
    if not isinstance(content, list):
        raise _invalid(param, "system content must be a string or a list of blocks")
    return [
        block["text"]
        for block in content
        if isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
        and block["text"]
        and not block["text"].startswith(BILLING_HEADER)
    ]


def _message(role: str, content: object) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: itself (text, image parts, tool calls, its
    ``thinking`` blocks as ``reasoning``), with a user's tool results as tool messages
    before it."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _invalid("messages", "content must be a string or a list of blocks")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            name = str(block.get("name") or "")
            call_id = str(block.get("id") or "")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(block.get("tool_use_id") or ""),
                    "content": _result_text(block.get("content")),
                }
            )
    message: dict[str, Any] = {"role": role}
    if thinking:
        message["reasoning"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        message["content"] = parts[0]["text"]
    elif parts:
        message["content"] = parts
    if parts or calls or role == "assistant":
        message.setdefault("content", "")
        out.append(message)
    return out


def _result_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(item.get("text", ""))
            for item in content
            if isinstance(item, dict) and item.get("type") == "text"
        )
    return ""


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _invalid(param: str, message: str) -> OpenAIError:
    return OpenAIError(f"{param}: {message}", param=param, code="invalid_value")
