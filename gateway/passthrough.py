"""The engines' other model endpoints, forwarded as they came: tokenizing, embeddings,
scoring, reranking, classification, pooling, and counting a Messages API request's tokens
(vLLM's paths; SGLang serves the ones it has under the same names).

A client of vLLM calls these on the same base URL as its chats (counting a prompt's
tokens with ``/tokenize`` before sending it, embedding with the same deployment); the
gateway answered them 404. Now each goes to a healthy replica serving its ``model``
(a body may leave it out, as vLLM allows, when the replicas serve one model), the least
loaded by the router's cost model: there is no prompt prefix to match, and these
requests hold no cache worth following. Retries, timeouts, connection limits, keys and
tenants are the chat's (gateway/proxy.py); the body passes unchanged, so whatever the
replica accepts or refuses is its own answer (a replica without the endpoint answers
its own 404).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.auth import Tenant
from gateway.exchange import Exchange
from gateway.handler import (
    answer,
    forward_watched,
    open_exchange,
    read_body,
    unknown_model,
    upstream_request_id,
    with_tenant_fields,
    with_tenant_priority,
)
from gateway.messages import read_x_api_key
from gateway.proxy import Forward, forward_headers
from gateway.state import GatewayState
from prefixgate.json_body import load_json_object
from prefixgate.wire import OpenAIError

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"  # Anthropic's: its errors are Anthropic's
# path -> endpoint label (logs and metrics)
PASSTHROUGH_PATHS: dict[str, str] = {
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/embeddings": "embeddings",
    "/v2/embed": "embeddings",  # Cohere's embed API, as vLLM serves it
    "/pooling": "pooling",
    "/classify": "classify",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    COUNT_TOKENS_PATH: "count_tokens",  # Anthropic's (gateway/messages.py)
    "/tokenizer_info": "tokenizer_info",  # a GET: the one model's tokenizer configuration
    # vLLM's scale-out split (--enable-scale-out): a request rendered to token ids (for
    # /inference/v1/generate: gateway/tokens_api.py), and token ids made an answer again
    "/v1/chat/completions/render": "render",
    "/v1/completions/render": "render",
    "/v1/messages/render": "render",
    "/v1/responses/render": "render",  # before the Responses API's own paths
    "/v1/chat/completions/derender": "derender",
    "/v1/completions/derender": "derender",
}
# vLLM's other generating endpoints (0.32): a batch of chats, one answer each (no stream);
# a prompt's label tokens scored by the model; a structured decision. Their prompts fill
# the engine's prefix cache, so keyed mode puts the tenant's cache_salt in them as in a
# chat. Routed by load: a batch's prompts are many, the others' are one each.
GENERATING_PATHS: dict[str, str] = {
    "/v1/chat/completions/batch": "chat_batch",
    "/generative_scoring": "generative_scoring",
    "/v1/systemone": "structured_decision",
}
PASSTHROUGH_PATHS.update(GENERATING_PATHS)
# The pooling endpoints the engine schedules by the body's ``priority`` (vLLM's pooling
# requests), and SageMaker's /invocations for a pooling model (gateway/sagemaker.py): a
# tenant with a priority of its own has it there (gateway/auth.py).
SCHEDULED_PATHS = frozenset(
    {
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/invocations",
    }
)
# GETs: no body, so the model is the one the replicas serve (lm-evaluation-harness reads
# ``/tokenizer_info`` to tokenize through the server, as vLLM offers with
# ``--enable-tokenizer-info-endpoint``).
GET_PATHS = frozenset({"/tokenizer_info"})


async def serve_passthrough(
    state: GatewayState, scope: Scope, receive: Receive, send: Send
) -> None:
    headers, ex = open_exchange(scope, PASSTHROUGH_PATHS[scope["path"]])
    serving = _serve(state, scope, headers, receive, send, ex)
    await answer(state, ex, send, serving, anthropic=scope["path"] == COUNT_TOKENS_PATH)


async def _serve(
    state: GatewayState,
    scope: Scope,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
) -> None:
    path = scope["path"]
    method = "GET" if path in GET_PATHS else "POST"
    if scope["method"] != method:
        raise OpenAIError(
            f"{scope['method']} {path}: Method Not Allowed", status=405, headers={"Allow": method}
        )
    read_x_api_key(headers)
    tenant = state.auth.authenticate_request(headers)
    ex.admit(tenant)
    body: dict[str, Any] = {}
    raw = b""
    if method == "POST":
        raw = await read_body(receive, headers.get("content-length"), state.config.max_body_bytes)
        body = load_json_object(raw)
    await forward_body(state, tenant, headers, raw, body, receive, send, ex, path, method)


async def forward_body(
    state: GatewayState,
    tenant: Tenant,
    headers: dict[str, str],
    raw: bytes,
    body: dict[str, Any],
    receive: Receive,
    send: Send,
    ex: Exchange,
    path: str,
    method: str = "POST",
) -> None:
    """A model endpoint's request whose body has been read: forwarded to ``path`` on a
    replica serving its model, chosen by load (also SageMaker's ``/invocations`` for
    pooling models, gateway/sagemaker.py)."""
    if path in GENERATING_PATHS:
        raw, _ = with_tenant_fields(state, tenant, body, raw)
    elif path in SCHEDULED_PATHS and with_tenant_priority(tenant, body):
        raw = json.dumps(body, separators=(",", ":")).encode()
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise OpenAIError("model: must be a string", param="model", code="invalid_value")
    if model is None:
        model = the_only_model(state)
    ex.model = model or ""
    if model is not None and state.serving(model) is None:
        if not state.has_unknown_model_replica():
            raise unknown_model(model)
        model = None  # only replicas that have not said what they serve: any may try
    request = Forward(
        keys=[],
        prompt_tokens=0,
        conversation=None,
        model=model,
        path=path,
        body=raw,
        headers=forward_headers(
            upstream_request_id(ex, body), state.upstream_authorization(headers), headers
        ),
        stream=False,
        method=method,
    )
    await forward_watched(state, ex, request, receive, send)


def the_only_model(state: GatewayState) -> str | None:
    """The model a body without one means: the one model the replicas serve (None: none
    has said yet, any may answer); a 400 when they serve several, whose tokenizers and
    embeddings differ."""
    models = sorted({v.model for v in state.router.replicas.values() if v.model})
    if len(models) > 1:
        raise OpenAIError(
            f"model: required, the replicas serve several ({', '.join(models)})",
            param="model",
            code="missing_model",
        )
    return models[0] if models else None
