"""vLLM's token-in, token-out API: ``POST /inference/v1/generate``, routed by prefix, and
``POST /inference/v1/abort_requests``, sent where the requests run.

A vLLM started with ``--enable-scale-out`` (or ``--tokens-only``) takes prompts as token
ids and answers token ids: reinforcement-learning rollouts drive it (a multi-turn
rollout resends its growing token prefix every turn, a group of samples shares one), as
does vLLM's own split of a deployment into render, generate and derender servers. The
gateway answered 404.

Now a generate request is keyed by its ``token_ids`` exactly (a completion's token-id
prompt: gateway/routing.py; a multimodal one up to its first image: ``keyed_head``),
salted with the tenant's ``cache_salt`` as a chat is (the API carries one, so keyed
tenants may use it), routed like a completion, and its body passes unchanged otherwise;
its answers and streams are read as a completion's.

An abort names requests by the id their answers carry, ``generate-tokens-`` and the
request's own id (its ``x-request-id`` header, else its body's ``request_id``: see
``upstream_request_id`` in gateway/handler.py); it goes to the replica running each
(gateway/abortable.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.abortable import abort_at
from gateway.exchange import Exchange
from gateway.handler import (
    answer,
    forward_watched,
    open_exchange,
    read_post,
    served_model,
    upstream_request_id,
    with_tenant_fields,
)
from gateway.passthrough import the_only_model
from gateway.proxy import Forward, forward_headers
from gateway.reply import send_bytes
from gateway.state import GatewayState
from prefixgate.json_body import load_json_object
from prefixgate.wire import CompletionRequest, OpenAIError, parse_request
from router.conversation import conversation_key

PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
ANSWER_ID_PREFIX = "generate-tokens-"  # vLLM's: an answer's request_id, an abort's id
TOKENS_API_PATHS = frozenset({PATH, ABORT_PATH})
MAX_ABORT_IDS = 4096  # ids in one abort request


async def serve_tokens_api(state: GatewayState, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["path"] == PATH:
        headers, ex = open_exchange(scope, "generate_tokens")
        await answer(state, ex, send, _generate(state, scope, headers, receive, send, ex))
    else:
        headers, ex = open_exchange(scope, "abort_requests")
        await answer(state, ex, send, _abort(state, scope, headers, receive, send, ex))


async def _generate(
    state: GatewayState,
    scope: Scope,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
) -> None:
    tenant, raw = await read_post(state, scope, headers, receive, ex)
    body = load_json_object(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise OpenAIError("model: must be a string", param="model", code="invalid_value")
    model = model or the_only_model(state)
    ex.model, ex.stream = model or "", body.get("stream") is True
    raw, salt = with_tenant_fields(state, tenant, body, raw)
    keys: list[bytes] = []
    prompt_tokens = 0
    route_model = None
    if model is not None:
        route_model, tokenizer_model, key_model, block_size = served_model(state, model)
        ex.block_size = block_size
        head = keyed_head(body)
        if head is not None:  # all of it is work: what is not keyed is not cached
            prompt_tokens = len(body["token_ids"])
        if head:
            request = parse_request(CompletionRequest, {"model": model, "prompt": head})
            assert isinstance(request, CompletionRequest)
            keyed = await state.keys.keys(
                request,
                tokenizer_model,
                block_size,
                salt or "",
                len(raw),
                served=route_model is not None,
                key_model=key_model,
            )
            keys = keyed.keys
    request_id = upstream_request_id(ex, body)
    answer_id = ANSWER_ID_PREFIX + (request_id or str(body["request_id"]))
    forwarded = Forward(
        keys=keys,
        prompt_tokens=prompt_tokens,
        conversation=state.auth.scoped_conversation(tenant, conversation_key(body, headers)),
        model=route_model,
        path=PATH,
        body=raw,
        headers=forward_headers(request_id, state.upstream_authorization(headers), headers),
        stream=ex.stream,
    )
    with state.generating.hold([answer_id], tenant.name, ex):
        await forward_watched(state, ex, forwarded, receive, send)


def keyed_head(body: dict[str, Any]) -> list[int] | None:
    """The token ids to key by: all of them, or those before the first multimodal
    placeholder (``features.mm_placeholders``): an engine keys a placeholder's blocks by
    its media's hash as well, which the ids do not carry, so two images would look like
    one cached prefix. None of them when the engine resolves the media itself
    (``content_parts``: where its tokens fall is not said); None when the ids are not
    ids (the replica's 400 to give)."""
    ids = body.get("token_ids")
    if not _token_ids(ids):
        return None
    assert isinstance(ids, list)
    if body.get("content_parts"):
        return []
    features = body.get("features")
    if features is None:
        return ids
    placeholders = features.get("mm_placeholders") if isinstance(features, dict) else None
    if not isinstance(placeholders, dict):
        return []
    offsets = [
        r.get("offset")
        for ranges in placeholders.values()
        if isinstance(ranges, list)
        for r in ranges
        if isinstance(r, dict)
    ]
    starts = [o for o in offsets if type(o) is int and o >= 0]
    if len(starts) != len(offsets):
        return []
    return ids[: min(starts)] if starts else ids


def _token_ids(ids: object) -> bool:
    """Token ids to key by (anything else is the replica's 400 to give)."""
    return (
        isinstance(ids, list) and bool(ids) and all(type(i) is int and 0 <= i < 2**32 for i in ids)
    )


async def _abort(
    state: GatewayState,
    scope: Scope,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
) -> None:
    tenant, raw = await read_post(state, scope, headers, receive, ex)
    ids = load_json_object(raw).get("request_ids")
    if isinstance(ids, str):  # vLLM takes one id as well as a list
        ids = [ids]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise OpenAIError(
            "request_ids: required, a list of request ids",
            param="request_ids",
            code="invalid_value",
        )
    if len(ids) > MAX_ABORT_IDS:
        raise OpenAIError(
            f"request_ids: at most {MAX_ABORT_IDS} in one request",
            param="request_ids",
            code="invalid_value",
        )
    targets = state.generating.targets(ids, tenant.name, state.router.replicas, state.auth.open)
    headers = forward_headers(ex.request_id, state.upstream_authorization(headers), headers)
    await asyncio.gather(
        *(
            abort_at(state.upstream, url, ABORT_PATH, {"request_ids": rids}, headers)
            for url, rids in targets.items()
        )
    )
    await send_bytes(send, 200, b"", [], ex)  # as the engines answer an abort
