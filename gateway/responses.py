"""The Responses API through the gateway (raw ASGI, like gateway/handler.py), with
affinity for stateful turns.

``POST /v1/responses`` without ``previous_response_id`` is routed like a chat: keys from
``instructions`` + ``input`` rendered as the engine renders them (the same chat mapping
as the replica, prefixgate/wire_responses.py), retried once elsewhere when the replica
fails before answering. Every response id a replica answers with is recorded as id ->
replica (with its tenant and its conversation key) in Redis with a TTL, so every gateway
agrees, and in a bounded local table (gateway/response_affinity.py). A request naming
``previous_response_id``, and ``GET`` / ``DELETE`` / ``POST .../cancel`` by id, go to
that replica once and nowhere else: engines keep responses in their own memory, so
another replica's answer would be a wrong answer. An id no gateway recorded (unknown,
expired or deleted) is a 404, and so is one whose replica is gone; a replica that is
known but unhealthy right now is a 503 with Retry-After.

Every request goes through the proxy (gateway/proxy.py) on the pooled HTTP/1.1 client,
so it gets chat's timeouts, connection limits, attempt accounting, breaker verdicts and
metrics; the Responses-specific reading of answers is gateway/responses_hooks.py.

**Conversation key.** A chain of responses is one conversation for routing: its key is
the first turn's (``prompt_cache_key``, then the ``X-Conversation-Id`` / ``session_id``
header, then ``user``, as for chats), or the first response's own id when that turn had
none. Every response is recorded with its chain's key, and a follow-up inherits it from
its ``previous_response_id``'s record. An explicit ``prompt_cache_key`` or conversation
header on a follow-up still wins, as it does for chats (its response then carries that
key on); a follow-up's ``user`` does not: the chain names the conversation more exactly
than the user does. Affinity pins a follow-up whatever its key, so the key changes no
follow-up's replica; what it gives is one conversation across the chain's turns, through
every gateway, for what reads conversations (the router's ring for the chain's first
turn, the records). A record whose replica is gone keeps its chain's key, but no other
replica holds the stored conversation: the follow-up is a 404 that says to start a new
conversation, never a turn routed by the key to a replica that would answer without the
history (or, with an engine that ignores an unknown id, answer as if there were none).
"""

from __future__ import annotations

from urllib.parse import parse_qs, quote

from starlette.types import Receive, Scope, Send

from gateway.auth import Tenant
from gateway.exchange import Exchange
from gateway.handler import (
    answer,
    forward_watched,
    open_exchange,
    read_body,
    unknown_model,
    with_tenant_fields,
)
from gateway.proxy import Forward, forward_headers
from gateway.response_affinity import AffinityUnavailable, Owner
from gateway.responses_hooks import ResponsesHooks
from gateway.state import GatewayState
from prefixgate.json_body import load_json_object
from prefixgate.wire import ChatCompletionRequest, OpenAIError, parse_request
from prefixgate.wire_responses import ResponsesRequest, chat_body
from router.conversation import conversation_key
from router.router import Decision

PREFIX = "/v1/responses"


def is_responses_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


async def serve_responses(state: GatewayState, scope: Scope, receive: Receive, send: Send) -> None:
    path: str = scope["path"]
    method: str = scope["method"]
    headers, ex = open_exchange(scope, "responses" if path == PREFIX else "responses_by_id")
    await answer(state, ex, send, _serve(state, headers, receive, send, ex, path, method, scope))


async def _serve(
    state: GatewayState,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
    path: str,
    method: str,
    scope: Scope,
) -> None:
    request = await _request(state, headers, receive, ex, path, method, scope)
    await forward_watched(state, ex, request, receive, send)


async def _request(
    state: GatewayState,
    headers: dict[str, str],
    receive: Receive,
    ex: Exchange,
    path: str,
    method: str,
    scope: Scope,
) -> Forward:
    """What to forward, after authentication; OpenAIError for what cannot go."""
    parts = path[len(PREFIX) :].split("/")  # "" | "/{id}" | "/{id}/cancel"
    if path == PREFIX:
        allowed = "POST"
    elif len(parts) == 2 and parts[1]:
        allowed = "GET, DELETE"
    elif len(parts) == 3 and parts[1] and parts[2] == "cancel":
        allowed = "POST"
    else:
        raise OpenAIError(f"{method} {path}: Not Found", status=404, code="not_found")
    if method not in allowed.split(", "):
        raise OpenAIError(
            f"{method} {path}: Method Not Allowed", status=405, headers={"Allow": allowed}
        )
    tenant = state.auth.authenticate_request(headers)
    ex.admit(tenant)
    if path == PREFIX:
        raw = await read_body(receive, headers.get("content-length"), state.config.max_body_bytes)
        return await _create(state, headers, raw, ex, tenant)
    response_id = parts[1]
    owner = await _owner(state, response_id, tenant.name, None)
    # The id goes on the request line as the client sent it, escaped again (the server
    # decoded it): a decoded space or line break would break the line or add one.
    upstream_path = f"{PREFIX}/{quote(response_id, safe='')}" + (
        "/cancel" if len(parts) == 3 else ""
    )
    query = scope.get("query_string", b"").decode("latin-1")
    hooks = ResponsesHooks(
        state.affinity,
        tenant.name,
        str,
        forget=response_id if method == "DELETE" else None,
    )
    return Forward(
        keys=[],
        prompt_tokens=0,
        conversation=owner.conversation,
        model=None,
        owned=True,  # a stored response, by its id: no model named (its create was checked)
        path=upstream_path + (f"?{query}" if query else ""),
        body=b"",
        headers=forward_headers(ex.request_id, state.upstream_authorization(headers), headers),
        stream=parse_qs(query).get("stream") == ["true"],  # GET ?stream=true: events
        method=method,
        pinned=_pinned(state, owner),
        hooks=hooks,
    )


async def _create(
    state: GatewayState, headers: dict[str, str], raw: bytes, ex: Exchange, tenant: Tenant
) -> Forward:
    body = load_json_object(raw)
    req = parse_request(ResponsesRequest, body)
    ex.model, ex.stream = req.model, req.stream
    raw, salt = with_tenant_fields(state, tenant, body, raw)
    # prompt_cache_key, vLLM's session_id, then the headers (``user`` left out: the chain
    # outranks it), scoped by tenant as chats are
    named = {k: body.get(k) for k in ("prompt_cache_key", "session_id")}
    explicit = conversation_key(named, headers)
    scoped = state.auth.scoped_conversation
    hooks = ResponsesHooks(
        state.affinity,
        tenant.name,
        lambda key: scoped(tenant, key) or key,
        record=True,
        count_cached=req.previous_response_id is None,
    )
    sent = forward_headers(ex.request_id, state.upstream_authorization(headers), headers)
    if req.previous_response_id is not None:
        owner = await _owner(state, req.previous_response_id, tenant.name, "previous_response_id")
        hooks.conversation = scoped(tenant, explicit) or owner.conversation
        ex.block_size = state.served_block_size(req.model) or 0
        return Forward(
            [], 0, hooks.conversation, None, PREFIX, raw, sent, req.stream,
            pinned=_pinned(state, owner), hooks=hooks,
        )  # fmt: skip
    view = state.serving(req.model)
    if view is None:
        raise unknown_model(req.model)
    ex.block_size = block_size = int(view.block_size)
    hooks.conversation = scoped(tenant, conversation_key(body, headers))
    chat = parse_request(ChatCompletionRequest, chat_body(req, [], lenient=True))
    prompt = await state.keys.keys(
        chat, view.model, block_size, salt or "", len(raw), key_model=view.key_model(req.model)
    )
    return Forward(
        prompt.keys, prompt.prompt_tokens, hooks.conversation, req.model, PREFIX, raw, sent,
        req.stream, hooks=hooks,
    )  # fmt: skip


async def _owner(state: GatewayState, response_id: str, tenant: str, param: str | None) -> Owner:
    """The replica that stored ``response_id`` for ``tenant``: 404 when no gateway
    recorded it for this tenant or its replica is gone, 503 when it is unhealthy now or
    only a failing Redis could tell."""
    try:
        owner = await state.affinity.lookup(response_id)
    except AffinityUnavailable as exc:
        raise OpenAIError(
            f"Who stored response '{response_id}' is recorded in Redis, which is not "
            f"answering ({exc}); retry shortly.",
            status=503,
            type="server_error",
            code="response_affinity_unavailable",
            param=param,
            headers={"Retry-After": "1"},
        ) from None
    if owner is None or owner.tenant != tenant:
        raise OpenAIError(
            f"Response with id '{response_id}' not found: no gateway recorded it (unknown, "
            "expired or deleted). Start a new conversation without previous_response_id.",
            status=404,
            param=param,
            code="response_not_found",
        )
    view = state.router.replicas.get(owner.replica_id)
    if view is None:  # its chain's key is known, but no other replica has the history
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
    return owner


def _pinned(state: GatewayState, owner: Owner) -> Decision:
    """The decision that sends a request to its response's replica. The breaker hears of
    the dispatch as it does from ``Router.route``: a half-open breaker lets one trial
    through, pinned or not."""
    state.router.replicas[owner.replica_id].breaker.on_dispatch()
    return Decision(owner.replica_id, "response_affinity", 0, 0)
