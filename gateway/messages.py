"""Anthropic's Messages API, ``POST /v1/messages``, as vLLM serves it: routed by prefix.

Claude Code and other Anthropic clients point ``ANTHROPIC_BASE_URL`` at a vLLM, which
serves ``/v1/messages`` by turning the request into a chat completion. Such an agent
resends its whole system prompt, tool definitions and history at every step: the traffic
this gateway exists for. The gateway answered 404.

Now the request is read as vLLM (0.32) reads it (prefixgate/wire_messages.py), keyed like a
chat completion (gateway/routing.py) and routed like one, and the body goes to the replica
unchanged. Whether its keys equal the engine's depends on that reading matching the
engine's rendering; where it does not, they still agree with each other, so the router's
own inserts keep an agent's steps together. The conversation is ``metadata.user_id``
(Claude Code puts its session in it) unless a session header names one.

Anthropic clients send their key as ``x-api-key``; it is read as ``Authorization:
Bearer``. In keyed mode a tenant with a salt of its own is refused (403): Anthropic's
API has no ``cache_salt``, and vLLM's (added in 2026) is dropped without a word by an
engine older than that, which the gateway cannot tell apart; its prompts would then
share the engine's cache with every other tenant's (README, "Tenant salts").
``/v1/messages/count_tokens`` is forwarded as it came (gateway/passthrough.py).
"""

from __future__ import annotations

import json

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
    without_report_mode,
    without_transfer_params,
)
from gateway.messages_hooks import MessagesHooks
from gateway.proxy import Forward, forward_headers
from gateway.state import GatewayState
from prefixgate.json_body import load_json_object
from prefixgate.wire import ChatCompletionRequest, parse_request
from prefixgate.wire_messages import to_chat
from router.conversation import conversation_key

PATH = "/v1/messages"


async def serve_messages(state: GatewayState, scope: Scope, receive: Receive, send: Send) -> None:
    headers, ex = open_exchange(scope, "messages")
    await answer(state, ex, send, _serve(state, scope, headers, receive, send, ex), anthropic=True)


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
    tenant = state.auth.authenticate_request(headers)
    ex.admit(tenant)
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
    # vLLM 0.32's Messages API takes vllm_xargs and the transfer fields too (handler.py)
    changed = without_report_mode(body)
    if without_transfer_params(state, tenant, body) or changed:
        raw = json.dumps(body, separators=(",", ":")).encode()
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
        headers=forward_headers(ex.request_id, state.upstream_authorization(headers), headers),
        stream=ex.stream,
        hooks=MessagesHooks(),  # its streams end at message_stop, not [DONE]
    )
    await forward_watched(state, ex, request, receive, send)


def read_x_api_key(headers: dict[str, str]) -> None:
    """An Anthropic client's ``x-api-key``, read as ``Authorization: Bearer`` (a client
    that sends both is judged by its Authorization)."""
    if "authorization" not in headers and (key := headers.get("x-api-key")):
        headers["authorization"] = f"Bearer {key}"
