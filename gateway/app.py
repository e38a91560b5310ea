"""The FastAPI app: OpenAI endpoints, health, readiness and metrics.

Everything the handlers need (router, HTTP client, tokenizers, tenants, metrics) lives on
``app.state.gateway`` — built by ``create_app``, started and stopped by its lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from gateway.auth import Authenticator, load_api_keys
from gateway.config import GatewayConfig
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.probes import add_static_replicas, learn_static_models, probe_loop
from gateway.proxy import (
    StreamingProxy,
    UpstreamFailure,
    buffered_response,
    failure_response,
    forward_headers,
    json_response,
    open_upstream,
)
from gateway.routing import KeyBuilder
from prefixgate.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    error_body,
    parse_request,
)
from router.conversation import conversation_key
from router.router import Router

if TYPE_CHECKING:
    from router.sync import RedisSync

log = logging.getLogger("prefixgate.gateway")


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    router: Router
    client: httpx.AsyncClient
    keys: KeyBuilder
    auth: Authenticator
    metrics: GatewayMetrics
    sync: RedisSync | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def served_block_size(self, model: str) -> int | None:
        """Block size of a replica serving ``model``; None when no replica serves it."""
        for view in self.router.replicas.values():
            if view.model == model:
                return int(view.block_size)
        return None

    def models(self, *, healthy_only: bool) -> list[str]:
        return sorted(
            {
                v.model
                for v in self.router.replicas.values()
                if v.model and (v.healthy or not healthy_only)
            }
        )


def make_client(config: GatewayConfig) -> httpx.AsyncClient:
    """One pooled keep-alive client for every upstream call. The aiohttp transport keeps
    httpx's API at a fraction of its default transport's per-request cost."""
    limits = httpx.Limits(
        max_connections=config.max_connections,
        max_keepalive_connections=config.max_connections,
        keepalive_expiry=30.0,
    )
    timeout = httpx.Timeout(
        connect=config.connect_timeout_s,
        read=config.upstream_timeout_s,
        write=config.upstream_timeout_s,
        pool=config.upstream_timeout_s,
    )
    if config.transport == "aiohttp":
        from httpx_aiohttp import AiohttpTransport

        transport = AiohttpTransport(limits=limits, trust_env=False)
        return httpx.AsyncClient(transport=transport, timeout=timeout, trust_env=False)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def create_app(
    config: GatewayConfig,
    *,
    router: Router | None = None,
    keys: KeyBuilder | None = None,
) -> FastAPI:
    router = router or Router(policy=config.policy)
    auth = Authenticator(load_api_keys(config.api_keys_path) if config.api_keys_path else None)
    state = GatewayState(
        config=config,
        router=router,
        client=make_client(config),
        keys=keys or KeyBuilder(config.tokenizer, inline_chars=config.inline_tokenize_chars),
        auth=auth,
        metrics=GatewayMetrics(lambda: router.replicas),
    )
    app = FastAPI(title="prefixgate gateway", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = state
    _add_routes(app)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: GatewayState = app.state.gateway
    config = state.config
    if state.auth.open:
        log.warning(
            "no --api-keys: the gateway is OPEN (no authentication) and every request "
            "shares one cache namespace; fine for local use only"
        )
    pending = await add_static_replicas(state)
    if config.redis_url:
        from router.sync import RedisSync

        state.sync = RedisSync(state.router, config.redis_url, gateway_id=config.gateway_id)
        started = state.sync.start()
        if inspect.isawaitable(started):
            await started
    for model in {*config.models, *state.models(healthy_only=False)}:
        await state.keys.preload(model)
    state.tasks.append(asyncio.create_task(probe_loop(state)))
    if pending:
        state.tasks.append(asyncio.create_task(learn_static_models(state, pending)))
    log.info(
        "gateway ready: policy=%s replicas=%s redis=%s",
        config.policy,
        list(state.router.replicas),
        config.redis_url or "off",
    )
    try:
        yield
    finally:
        for task in state.tasks:
            task.cancel()
        await asyncio.gather(*state.tasks, return_exceptions=True)
        if state.sync is not None:
            await state.sync.aclose()
        await state.client.aclose()


def _add_routes(app: FastAPI) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat", ChatCompletionRequest, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completions", CompletionRequest, "/v1/completions")

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        if denied := _denied(state, request):
            return denied
        data = [_model_card(m) for m in state.models(healthy_only=True)]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model:path}")
    async def get_model(request: Request, model: str) -> Response:
        state: GatewayState = request.app.state.gateway
        if denied := _denied(state, request):
            return denied
        if model not in state.models(healthy_only=False):
            return JSONResponse(_unknown_model(model).body(), 404)
        return JSONResponse(_model_card(model))

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        healthy = [rid for rid, v in state.router.replicas.items() if v.healthy]
        return JSONResponse(
            {"ready": bool(healthy), "healthy_replicas": healthy}, 200 if healthy else 503
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/router/stats")
    async def router_stats(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        return JSONResponse(state.router.stats())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, code=code), exc.status_code)


async def handle(request: Request, endpoint: str, schema: type[BaseModel], path: str) -> Response:
    state: GatewayState = request.app.state.gateway
    ex = Exchange(
        request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
        endpoint=endpoint,
        started=time.perf_counter(),
    )
    try:
        response = await _proxy(state, request, ex, schema, path)
    except OpenAIError as err:
        response = json_response(err.status, err.body(), ex, err.headers)
    except Exception:
        log.exception("request %s failed inside the gateway", ex.request_id)
        body = error_body("The gateway failed on this request.", type="server_error")
        response = json_response(500, body, ex)
    if not isinstance(response, StreamingProxy):  # a stream records itself when it ends
        ex.finish(state)
    return response


async def _proxy(
    state: GatewayState, request: Request, ex: Exchange, schema: type[BaseModel], path: str
) -> Response:
    tenant = state.auth.authenticate(request.headers.get("authorization"))
    ex.tenant = tenant.name
    raw = await read_body(request, state.config.max_body_bytes)
    try:
        body = json.loads(raw)
    except ValueError:
        raise OpenAIError("The request body is not valid JSON.", code="invalid_json") from None
    parsed = parse_request(schema, body)
    assert isinstance(parsed, ChatCompletionRequest | CompletionRequest)
    ex.model = parsed.model
    ex.stream = parsed.stream
    block_size = state.served_block_size(parsed.model)
    route_model: str | None = parsed.model
    if block_size is None:
        if not any(v.model == "" for v in state.router.replicas.values()):
            raise _unknown_model(parsed.model)
        # Only replicas whose model is not known yet: let any of them try.
        route_model, block_size = None, state.config.block_size
    ex.block_size = block_size

    salt = state.auth.forwarded_salt(tenant, parsed.cache_salt)
    if salt != body.get("cache_salt"):
        # The only case where the body is re-serialized; otherwise the bytes pass as sent.
        if salt is None:
            body.pop("cache_salt", None)
        else:
            body["cache_salt"] = salt
        raw = json.dumps(body, separators=(",", ":")).encode()

    prompt = await state.keys.keys(parsed, parsed.model, block_size, salt or "")
    conversation = conversation_key(body, request.headers)
    headers = forward_headers(request.headers.raw, ex.request_id, state.auth.open)
    result = await open_upstream(
        state, ex, prompt.keys, conversation, route_model, path, raw, headers
    )
    if isinstance(result, UpstreamFailure):
        return failure_response(result, ex)
    if parsed.stream and result.response.status_code < 400:
        return StreamingProxy(state, result, ex)
    return await buffered_response(state, result, ex, request.receive)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _denied(state: GatewayState, request: Request) -> Response | None:
    """The 401 answer when keys are configured and the request has no valid one."""
    try:
        state.auth.authenticate(request.headers.get("authorization"))
    except OpenAIError as err:
        return JSONResponse(err.body(), err.status, headers=err.headers)
    return None


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"The request body is larger than the gateway's limit of {limit} bytes.",
        status=413,
        code="request_too_large",
    )


def _unknown_model(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist or no replica serves it.",
        status=404,
        param="model",
        code="model_not_found",
    )


def _model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "prefixgate"}
