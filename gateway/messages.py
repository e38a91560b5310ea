"""Anthropic's Messages API, ``POST /v1/messages``, as vLLM serves it: routed by prefix.

Claude Code and other Anthropic clients point ``ANTHROPIC_BASE_URL`` at a vLLM, which
serves ``/v1/messages`` by turning the request into a chat completion. Such an agent
resends its whole system prompt, tool definitions and history at every step: the traffic
this gateway exists for. The gateway answered 404.

Now the request is read as vLLM (0.32) reads it (``to_chat``: the system prompt first,
then each message, ``tool_use`` blocks as tool calls, ``tool_result`` blocks as tool
messages, tools as functions), keyed like a chat completion (gateway/routing.py) and routed like
one, and the body goes to the replica unchanged. Whether its keys equal the engine's
depends on that reading matching the engine's rendering; where it does not, they still
agree with each other, so the router's own inserts keep an agent's steps together. The
conversation is ``metadata.user_id`` (Claude Code puts its session in it) unless a
session header names one. Claude Code's ``x-anthropic-billing-header`` system block
changes with every request; vLLM leaves it out of the prompt, and so do the keys.

Anthropic clients send their key as ``x-api-key``; it is read as ``Authorization:
Bearer``. In keyed mode a tenant with a salt of its own is refused (403): the Messages
API has no ``cache_salt``, so its prompts would share the engine's cache with every
other tenant's (README, "Tenant salts"). ``/v1/messages/count_tokens`` is forwarded as
it came (gateway/passthrough.py).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.exchange import Exchange
from gateway.handler import (
    answer,
    forward_watched,
    open_exchange,
    post_only,
    read_body,
    refuse_salted,
    served_model,
)
from gateway.messages_hooks import MessagesHooks
from gateway.proxy import Forward, forward_headers
from gateway.state import GatewayState
from prefixgate.json_body import load_json_object
from prefixgate.wire import ChatCompletionRequest, OpenAIError, parse_request
from router.conversation import conversation_key

PATH = "/v1/messages"
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request system block


async def serve_messages(state: GatewayState, scope: Scope, receive: Receive, send: Send) -> None:
    headers, ex = open_exchange(scope, "messages")
    await answer(state, ex, send, _serve(state, scope, headers, receive, send, ex))


async def _serve(
    state: GatewayState,
    scope: Scope,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
) -> None:
    post_only(scope)
    read_x_api_key(headers)
    tenant = state.auth.authenticate(headers.get("authorization"))
    ex.tenant = tenant.name
    refuse_salted(state, tenant, f"{PATH} (the Messages API)")
    raw = await read_body(receive, headers.get("content-length"), state.config.max_body_bytes)
    body = load_json_object(raw)
    chat = parse_request(ChatCompletionRequest, to_chat(body))
    assert isinstance(chat, ChatCompletionRequest)
    ex.model, ex.stream = chat.model, body.get("stream") is True
    route_model, tokenizer_model, key_model, block_size = served_model(state, chat.model)
    ex.block_size = block_size
    prompt = await state.keys.keys(
        chat,
        tokenizer_model,
        block_size,
        "",
        len(raw),
        served=route_model is not None,
        key_model=key_model,
    )
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    conversation = conversation_key({"user": user}, headers)
    request = Forward(
        keys=prompt.keys,
        prompt_tokens=prompt.prompt_tokens,
        conversation=state.auth.scoped_conversation(tenant, conversation),
        model=route_model,
        path=PATH,
        body=raw,
        headers=forward_headers(ex.request_id, state.upstream_authorization(headers)),
        stream=ex.stream,
        hooks=MessagesHooks(),  # its streams end at message_stop, not [DONE]
    )
    await forward_watched(state, ex, request, receive, send)


def read_x_api_key(headers: dict[str, str]) -> None:
    """An Anthropic client's ``x-api-key``, read as ``Authorization: Bearer`` (a client
    that sends both is judged by its Authorization)."""
    if "authorization" not in headers and (key := headers.get("x-api-key")):
        headers["authorization"] = f"Bearer {key}"


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request an Anthropic Messages request is read as, for its
    keys (vLLM's reading; see the module's docstring). A shape it cannot read is a 400."""
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
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise _invalid("tools", "must be a list of tools")
        chat_body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("input_schema"),
                },
            }
            for t in tools
        ]
    return chat_body


def _texts(content: object, param: str) -> list[str]:
    """The text of a system prompt: a string, or its text blocks (less Claude Code's
    billing header, as vLLM leaves it out)."""
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [content]
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
    """One Anthropic message as chat messages: itself (text, image parts, tool calls),
    with a user's tool results as tool messages before it."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _invalid("messages", "content must be a string or a list of blocks")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
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
