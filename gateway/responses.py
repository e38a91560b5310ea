"""The Responses API through the gateway, with affinity for stateful turns.

``POST /v1/responses`` without ``previous_response_id`` is routed like a chat: keys from
``instructions`` + ``input`` rendered as the engine renders them (the same chat mapping
as the replica, prefixgate/wire_responses.py). Every response id a replica answers with is
recorded as id -> replica (with its tenant and its conversation's first response) in Redis with
a TTL, so every gateway agrees, and in a bounded local table (the only record without
Redis). A request naming ``previous_response_id``, and ``GET`` / ``DELETE`` /
``POST .../cancel`` by id, go to that replica and nowhere else: engines keep responses in
their own memory, so another replica's answer would be a wrong answer. An id no gateway
recorded (unknown, expired or deleted) is a 404, and so is one whose replica is gone; a
replica that is known but unhealthy right now is a 503 with Retry-After.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.attempt import Attempt
from gateway.exchange import Exchange
from gateway.proxy import forward_headers
from gateway.response_affinity import Owner, ResponseAffinity
from gateway.state import GatewayState
from prefixgate.json_body import load_json_object
from prefixgate.wire import ChatCompletionRequest, OpenAIError, parse_request
from prefixgate.wire_responses import ResponsesRequest, chat_body
from router.conversation import conversation_key
from router.router import Decision, NoHealthyReplica


def _unknown(response_id: str, param: str | None) -> OpenAIError:
    return OpenAIError(
        f"Response with id '{response_id}' not found: no gateway recorded it (unknown, "
        "expired or deleted). Start a new conversation without previous_response_id.",
        status=404,
        param=param,
        code="response_not_found",
    )


def _owner_url(state: GatewayState, response_id: str, owner: Owner, param: str | None) -> str:
    view = state.router.replicas.get(owner.replica_id)
    if view is None:
        raise OpenAIError(
            f"Response with id '{response_id}' was stored on replica {owner.replica_id}, "
            "which is gone; its conversation cannot continue. Start a new one without "
            "previous_response_id.",
            status=404,
            param=param,
            code="response_not_found",
        )
    if not view.healthy:
        raise OpenAIError(
            f"Replica {owner.replica_id}, which stored response '{response_id}', is "
            "unhealthy right now; retry shortly.",
            status=503,
            type="server_error",
            code="response_replica_unavailable",
            headers={"Retry-After": "1"},
        )
    return str(view.url)


def _timeout(state: GatewayState) -> httpx.Timeout:
    return httpx.Timeout(state.config.upstream_timeout_s, connect=state.config.connect_timeout_s)


class Target(NamedTuple):
    decision: Decision
    url: str
    conversation: str | None  # the chain this request continues


async def _target(
    state: GatewayState,
    req: ResponsesRequest,
    affinity: ResponseAffinity,
    salt: str,
    tenant: str,
    conversation: str | None,
) -> Target:
    previous = req.previous_response_id
    if previous is not None:
        owner = await affinity.lookup(previous)
        if owner is None or owner.tenant != tenant:
            raise _unknown(previous, "previous_response_id")
        url = _owner_url(state, previous, owner, "previous_response_id")
        return Target(
            Decision(owner.replica_id, "response_affinity", 0, 0), url, owner.conversation
        )
    block_size = state.served_block_size(req.model)
    if block_size is None:
        raise OpenAIError(
            f"The model `{req.model}` does not exist or no replica serves it.",
            status=404,
            param="model",
            code="model_not_found",
        )
    chat = parse_request(ChatCompletionRequest, chat_body(req, []))
    prompt = await state.keys.keys(chat, req.model, block_size, salt)
    try:
        decision = state.router.route(
            prompt.keys, conversation, model=req.model, prompt_tokens=prompt.prompt_tokens
        )
    except NoHealthyReplica:
        raise OpenAIError(
            f"No healthy replica serves model {req.model!r} right now; retry shortly.",
            status=503,
            type="server_error",
            code="no_healthy_replica",
            headers={"Retry-After": "1"},
        ) from None
    view = state.router.replicas[decision.replica_id]
    return Target(decision, str(view.url), None)


def _request_id(headers: Any) -> str:
    return str(headers.get("x-request-id") or os.urandom(16).hex())


def _answer_headers(upstream: httpx.Response, ex: Exchange) -> dict[str, str]:
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in ex.raw_headers()}
    if "retry-after" in upstream.headers:
        headers["retry-after"] = upstream.headers["retry-after"]
    return headers


async def create(
    state: GatewayState, affinity: ResponseAffinity, request: Request, ex: Exchange
) -> Response:
    headers = {k.lower(): v for k, v in request.headers.items()}
    tenant = state.auth.authenticate(headers.get("authorization"))
    ex.tenant = tenant.name
    body = load_json_object(await request.body())
    req = parse_request(ResponsesRequest, body)
    ex.model, ex.stream = req.model, req.stream
    salt = state.auth.forwarded_salt(tenant, body.get("cache_salt"))
    if salt != body.get("cache_salt"):
        if salt is None:
            body.pop("cache_salt", None)
        else:
            body["cache_salt"] = salt
    # prompt_cache_key, X-Conversation-Id / session_id or user, scoped by tenant, as chats
    conversation = state.auth.scoped_conversation(tenant, conversation_key(body, headers))
    target = await _target(state, req, affinity, salt or "", tenant.name, conversation)
    raw = json.dumps(body, separators=(",", ":")).encode()
    sent = forward_headers(headers, ex.request_id, state.auth.open)
    rid = target.decision.replica_id
    ex.set_decision(rid, target.decision)
    ex.block_size = state.served_block_size(req.model) or 0
    attempt = Attempt(state.router, target.decision)
    attempt.__enter__()
    try:
        upstream_request = state.client.build_request(
            "POST", target.url + "/v1/responses", content=raw, headers=sent, timeout=_timeout(state)
        )
        upstream = await state.client.send(upstream_request, stream=True)
    except httpx.HTTPError as exc:
        attempt.fail()
        attempt.finish()
        raise OpenAIError(
            f"Replica {rid} failed before answering ({type(exc).__name__}); retry the request.",
            status=502,
            type="server_error",
            code="upstream_unavailable",
        ) from exc
    attempt.first_byte()
    ex.status = upstream.status_code
    ex.ttfb = time.perf_counter()

    async def remember(response_id: object) -> None:
        if isinstance(response_id, str) and response_id:
            owner = Owner(rid, target.conversation or response_id, tenant.name)
            await affinity.record(response_id, owner)

    if not req.stream or upstream.status_code >= 400:
        try:
            data = await upstream.aread()
        finally:
            await upstream.aclose()
            attempt.prefill_done()
            attempt.finish()
        if upstream.status_code < 300:
            await remember(_json_field(data, "id"))
            if req.previous_response_id is None:  # pinned: no prediction to compare with
                ex.cached_tokens = _cached_tokens(_json_field(data, "usage"))
        return Response(
            data,
            status_code=upstream.status_code,
            media_type="application/json",
            headers=_answer_headers(upstream, ex),
        )

    async def relay() -> AsyncIterator[bytes]:
        seen = bytearray()
        recorded = False
        try:
            async for chunk in upstream.aiter_raw():
                attempt.prefill_done()
                if not recorded:
                    seen += chunk
                    response_id = _created_id(bytes(seen))
                    if response_id is not None:
                        await remember(response_id)
                        recorded = True
                        seen.clear()
                yield chunk
        except httpx.HTTPError:
            attempt.fail()
            ex.status = 502
            yield b'event: error\ndata: {"type":"error","message":"replica failed mid-stream"}\n\n'
        finally:
            await upstream.aclose()
            attempt.finish()
            ex.finish(state.metrics)

    ex.responded = True  # the stream's end records the exchange
    return StreamingResponse(
        relay(),
        status_code=upstream.status_code,
        media_type="text/event-stream",
        headers=_answer_headers(upstream, ex),
    )


def _cached_tokens(usage: object) -> int | None:
    details = usage.get("input_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None


def _json_field(data: bytes, name: str) -> object:
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    return parsed.get(name) if isinstance(parsed, dict) else None


def _created_id(stream: bytes) -> str | None:
    """The response id in a stream's ``response.created`` event, once its line is whole."""
    for line in stream.split(b"\n")[:-1]:  # the last piece may be a line still arriving
        if line.startswith(b"data:") and b"response.created" in line:
            try:
                event = json.loads(line[5:])
            except ValueError:
                return None
            response = event.get("response") if isinstance(event, dict) else None
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                return str(response["id"])
    return None


async def by_id(
    state: GatewayState,
    affinity: ResponseAffinity,
    request: Request,
    ex: Exchange,
    response_id: str,
    suffix: str = "",
) -> Response:
    """GET / DELETE / cancel: on the replica that stored the response, or a 404."""
    headers = {k.lower(): v for k, v in request.headers.items()}
    tenant = state.auth.authenticate(headers.get("authorization"))
    ex.tenant = tenant.name
    owner = await affinity.lookup(response_id)
    if owner is None or owner.tenant != tenant.name:
        raise _unknown(response_id, None)
    url = _owner_url(state, response_id, owner, None)
    ex.replica = owner.replica_id
    ex.reason = "response_affinity"
    sent = forward_headers(headers, ex.request_id, state.auth.open)
    try:
        upstream = await state.client.request(
            request.method,
            f"{url}/v1/responses/{response_id}{suffix}",
            headers=sent,
            timeout=_timeout(state),
        )
    except httpx.HTTPError as exc:
        raise OpenAIError(
            f"Replica {owner.replica_id} failed ({type(exc).__name__}); retry the request.",
            status=502,
            type="server_error",
            code="upstream_unavailable",
        ) from exc
    ex.status = upstream.status_code
    if request.method == "DELETE" and upstream.status_code in (200, 404):
        await affinity.forget(response_id)
    return Response(
        upstream.content,
        status_code=upstream.status_code,
        media_type="application/json",
        headers=_answer_headers(upstream, ex),
    )


def add_response_routes(app: FastAPI) -> None:
    state: GatewayState = app.state.gateway
    affinity = ResponseAffinity(state.config.redis_url)
    app.state.response_affinity = affinity

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        ex = _exchange(request, "responses")
        return await _answer(create(state, affinity, request, ex), ex, state)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        ex = _exchange(request, "responses_by_id")
        return await _answer(by_id(state, affinity, request, ex, response_id), ex, state)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        ex = _exchange(request, "responses_by_id")
        return await _answer(by_id(state, affinity, request, ex, response_id), ex, state)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        ex = _exchange(request, "responses_by_id")
        work = by_id(state, affinity, request, ex, response_id, "/cancel")
        return await _answer(work, ex, state)


def _exchange(request: Request, endpoint: str) -> Exchange:
    return Exchange(_request_id(request.headers), endpoint, time.perf_counter())


async def _answer(work: Any, ex: Exchange, state: GatewayState) -> Response:
    """The answer, errors as OpenAI envelopes; the exchange recorded unless a stream is
    still running (its end records it)."""
    try:
        response: Response = await work
    except OpenAIError as err:
        ex.status = err.status
        headers = {**err.headers, "x-request-id": ex.request_id}
        response = JSONResponse(err.body(), status_code=err.status, headers=headers)
    if not ex.responded:
        ex.finish(state.metrics)
    return response
