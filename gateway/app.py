"""The gateway's ASGI app: OpenAI endpoints, health, readiness and metrics.

``GatewayApp`` sends the two hot paths (chat and text completions) to the raw ASGI
handler in gateway/handler.py, the Responses API to gateway/responses.py, the other
inference APIs to their modules (raw ASGI too: the same proxy), and everything else,
lifespan included, to a FastAPI app.
Everything the handlers need (router, upstream client, tokenizers, tenants, metrics) lives
in one ``GatewayState`` (gateway/state.py), built by ``create_app`` and started and stopped
by the lifespan. This module is the composition root: it imports the handlers, and
nothing in the gateway imports it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import ssl
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gateway.adapters import (
    ADAPTER_PATHS,
    is_sagemaker_adapters_path,
    serve_adapters,
    serve_sagemaker_adapters,
)
from gateway.audio import AUDIO_PATHS, serve_audio
from gateway.auth import Authenticator, Tenant, load_api_keys
from gateway.cache_reset import reset_prefix_caches
from gateway.config import GatewayConfig
from gateway.engine_control import CONTROL_PATHS, serve_engine_control
from gateway.generate import ABORT_PATH as SGLANG_ABORT_PATH
from gateway.generate import PATH as GENERATE_PATH
from gateway.generate import serve_abort, serve_generate
from gateway.handler import HOT_PATHS, serve_completion, unknown_model
from gateway.keys_file import REFRESH_S as KEYS_REFRESH_S
from gateway.keys_file import KeysFile
from gateway.messages import PATH as MESSAGES_PATH
from gateway.messages import serve_messages
from gateway.metrics import GatewayMetrics
from gateway.passthrough import PASSTHROUGH_PATHS, serve_passthrough
from gateway.probes import (
    add_static_replicas,
    learn_static_models,
    names_loop,
    probe_all,
    probe_loop,
)
from gateway.response_affinity import ResponseAffinity
from gateway.responses import is_responses_path, serve_responses
from gateway.routing import KeyBuilder
from gateway.sagemaker import INVOCATIONS_PATH, PING_PATH, serve_invocations, serve_ping
from gateway.sagemaker_sessions import Sessions
from gateway.state import GatewayState
from gateway.tenant_caps import TenantCaps
from gateway.tenant_rates import TenantRates
from gateway.tokens_api import TOKENS_API_PATHS, serve_tokens_api
from gateway.upstream import Upstream
from gateway.workers import MergedMetrics
from prefixgate.tls import TLSFiles
from prefixgate.wire import OpenAIError, error_body
from router.protocol import redacted_url
from router.router import Router

log = logging.getLogger("prefixgate.gateway")


def make_client(config: GatewayConfig, tls: ssl.SSLContext) -> httpx.AsyncClient:
    """The client for probes and model discovery (a few requests a second at most); it
    carries the --upstream-api-key (a keyed vLLM or SGLang guards ``/v1/models``), and
    verifies HTTPS replicas as the proxied requests do (``tls``)."""
    timeout = httpx.Timeout(config.probe_timeout_s, connect=config.connect_timeout_s)
    key = config.upstream_api_key
    headers = {"authorization": f"Bearer {key}"} if key is not None else None
    return httpx.AsyncClient(timeout=timeout, trust_env=False, headers=headers, verify=tls)


class GatewayApp:
    """The ASGI entry point: hot paths straight to the raw handler, the rest to FastAPI."""

    __slots__ = ("fallback", "state")

    def __init__(self, state: GatewayState, fallback: FastAPI) -> None:
        self.state = state
        self.fallback = fallback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in HOT_PATHS:
            await serve_completion(self.state, scope, receive, send, scope["path"])
        elif scope["type"] == "http" and scope["path"] in PASSTHROUGH_PATHS:
            await serve_passthrough(self.state, scope, receive, send)
        elif scope["type"] == "http" and scope["path"] in AUDIO_PATHS:
            await serve_audio(self.state, scope, receive, send)
        elif scope["type"] == "http" and scope["path"] in ADAPTER_PATHS:
            await serve_adapters(self.state, scope, receive, send)
        elif scope["type"] == "http" and is_sagemaker_adapters_path(scope["path"]):
            await serve_sagemaker_adapters(self.state, scope, receive, send)
        elif scope["type"] == "http" and scope["path"] in CONTROL_PATHS:
            await serve_engine_control(self.state, scope, receive, send)
        elif scope["type"] == "http" and is_responses_path(scope["path"]):
            await serve_responses(self.state, scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == GENERATE_PATH:
            await serve_generate(self.state, scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == SGLANG_ABORT_PATH:
            await serve_abort(self.state, scope, receive, send)
        elif scope["type"] == "http" and scope["path"] in TOKENS_API_PATHS:
            await serve_tokens_api(self.state, scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == MESSAGES_PATH:
            await serve_messages(self.state, scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == INVOCATIONS_PATH:
            await serve_invocations(self.state, scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == PING_PATH:
            await serve_ping(self.state, scope, send)
        else:
            await self.fallback(scope, receive, send)


def create_app(
    config: GatewayConfig,
    *,
    router: Router | None = None,
    keys: KeyBuilder | None = None,
) -> GatewayApp:
    # Replicas start unknown: no traffic until a /health probe answers (router/health.py).
    router = router or Router(config.router, policy=config.policy, probe_first=True)
    # Stamped before it is read: a change in between is read again at the first check.
    keys_file = KeysFile(config.api_keys_path) if config.api_keys_path else None
    auth = Authenticator(load_api_keys(config.api_keys_path) if config.api_keys_path else None)
    tls = config.upstream_tls()
    files = (config.upstream_certfile, config.upstream_keyfile, config.upstream_ca_certs)
    state = GatewayState(
        config=config,
        router=router,
        client=make_client(config, tls),
        upstream=Upstream(
            config.max_connections_per_replica,
            config.connect_timeout_s,
            config.upstream_timeout_s,
            config.pool_timeout_s,
            tls,
        ),
        keys=keys or _key_builder(config),
        auth=auth,
        metrics=GatewayMetrics(lambda: router.replicas),
        affinity=ResponseAffinity(config.redis_url),
        upstream_tls=TLSFiles(tls, *files, "upstream") if any(files) else None,
        sessions=Sessions(config.sagemaker_session_s) if config.sagemaker_session_s else None,
        tenant_caps=TenantCaps(config.redis_url, caps=auth.caps),
        tenant_rates=TenantRates(config.redis_url, limits=auth.rates),
        keys_file=keys_file,
        merged_metrics=(
            MergedMetrics(config.worker, config.worker_ports, tls=config.serves_tls)
            if config.worker is not None
            else None
        ),
    )
    state.keys.roots = state.tokenizer_roots  # what its replicas say a model was started from
    app = FastAPI(title="prefixgate gateway", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = state
    _add_routes(app)
    return GatewayApp(state, app)


def _key_builder(config: GatewayConfig) -> KeyBuilder:
    from prefixgate.tokenizer import read_chat_template_file

    every = config.chat_template
    return KeyBuilder(
        config.tokenizer,
        tokenizers=config.model_tokenizers,
        inline_chars=config.inline_tokenize_chars,
        chat_templates={
            model: read_chat_template_file(path)
            for model, path in config.model_chat_templates.items()
        },
        chat_template=read_chat_template_file(every) if every is not None else None,
        memo_bytes=config.key_memo_bytes,
        template_defaults=config.template_defaults,
        tokenizer_modes=config.tokenizer_modes,
        exclude_tools_when_tool_choice_none=config.exclude_tools_when_tool_choice_none,
        content_format=config.content_format,
    )


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
        if not state.auth.open:  # caps counted with the other gateways (tenant_caps.py)
            state.tenant_caps.gateway_id = state.sync.gateway_id
            state.tasks.append(asyncio.create_task(state.tenant_caps.run()))
    await probe_all(state)  # before serving: the replicas that answer take traffic at once
    # Aliases and adapters are tokenized as the model they are served by; after the probe,
    # which read the answering replicas' model cards (a card's root: a tokenizer source).
    served = {*config.models, *(v.model for v in state.router.replicas.values() if v.model)}
    await asyncio.gather(*(state.keys.preload(model) for model in served))  # fetches at once
    state.tasks.append(asyncio.create_task(probe_loop(state)))
    state.tasks.append(asyncio.create_task(names_loop(state)))
    if state.keys_file is not None:  # keys revoked or added on disk are used at once
        state.tasks.append(asyncio.create_task(watch_keys(state, state.keys_file)))
    if state.upstream_tls is not None:  # certificates rotated on disk are used at once
        state.tasks.append(asyncio.create_task(state.upstream_tls.watch()))
    if pending:
        state.tasks.append(asyncio.create_task(learn_static_models(state, pending)))
    log.info(
        "gateway ready: policy=%s replicas=%s redis=%s",
        config.policy,
        list(state.router.replicas),
        redacted_url(config.redis_url) if config.redis_url else "off",
    )
    try:
        yield
    finally:
        for task in state.tasks:
            task.cancel()
        await asyncio.gather(*state.tasks, return_exceptions=True)
        if state.sync is not None:
            await state.sync.aclose()
        await state.affinity.aclose()
        await state.tenant_caps.aclose()
        await state.tenant_rates.aclose()
        await state.client.aclose()
        await state.upstream.aclose()
        if state.merged_metrics is not None:
            await state.merged_metrics.aclose()


async def watch_keys(state: GatewayState, keys_file: KeysFile) -> None:
    """Check the keys file every ``REFRESH_S``; a settled change that parses is used from
    the next request on (gateway/keys_file.py)."""
    while True:
        await asyncio.sleep(KEYS_REFRESH_S)  # the check period
        # In a thread: parsing thousands of keys must not stall the streams being served.
        auth = await asyncio.to_thread(keys_file.check)
        if auth is not None:
            state.auth = auth
            state.tenant_caps.caps = auth.caps
            state.tenant_rates.limits = auth.rates
            log.info("API keys reloaded from %s: %d keys", keys_file.path, auth.key_count)


def _add_routes(app: FastAPI) -> None:
    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        tenant = _tenant(state, request)
        if isinstance(tenant, Response):
            return tenant
        data = [
            state.card(m, healthy_only=True)
            for m in state.models(healthy_only=True)
            if state.auth.may_call(tenant.name, m)
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model:path}")
    async def get_model(request: Request, model: str) -> Response:
        state: GatewayState = request.app.state.gateway
        tenant = _tenant(state, request)
        if isinstance(tenant, Response):
            return tenant
        if model not in state.models(healthy_only=False) or not state.auth.may_call(
            tenant.name, model
        ):
            return JSONResponse(unknown_model(model).body(), 404)
        return JSONResponse(state.card(model, healthy_only=False))

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """200 once at least ``?min_replicas=N`` (default 1) replicas are healthy: probed
        (a replica is unknown until its first /health probe succeeds) and not tripped.
        With N = all of them, a freshly started cluster serves with every replica."""
        state: GatewayState = request.app.state.gateway
        healthy = [rid for rid, v in state.router.replicas.items() if v.healthy]
        raw = request.query_params.get("min_replicas", "1")
        if not (raw.isascii() and raw.isdigit()):
            message = f"min_replicas must be a non-negative integer, got {raw!r}"
            return JSONResponse(error_body(message, param="min_replicas"), 400)
        ok = len(healthy) >= max(1, int(raw))
        return JSONResponse({"ready": ok, "healthy_replicas": healthy}, 200 if ok else 503)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """Reset every replica's prefix cache and the router's view of them
        (gateway/cache_reset.py). Keyed mode: admin keys only. 502 when some replica
        could not be reset."""
        state: GatewayState = request.app.state.gateway
        if denied := _not_admin(state, request, "Resetting the prefix cache affects every tenant"):
            return denied
        results = await reset_prefix_caches(state)
        failed = sorted(rid for rid, r in results.items() if "error" in r)
        if failed:
            message = f"the prefix cache could not be reset on {', '.join(failed)}"
            body = error_body(message, type="server_error", code="reset_failed")
            return JSONResponse({**body, "replicas": results}, 502)
        return JSONResponse({"object": "prefix_cache.reset", "replicas": results})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        config = state.config
        if state.merged_metrics is not None and not _on_own_port(request, config):
            # One of --workers, asked on the shared address: every worker's series.
            body = await state.merged_metrics.get(state.metrics.render)
        else:
            body = state.metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/router/stats")
    async def router_stats(request: Request) -> Response:
        """The router's view of every replica. Keyed mode: admin keys only (it shows
        every tenant's traffic as it grows)."""
        state: GatewayState = request.app.state.gateway
        if denied := _not_admin(state, request, "The router's stats show every tenant's traffic"):
            return denied
        stats = state.router.stats()
        if state.config.worker is not None:  # this worker's view: each has its own
            stats["worker"] = {
                "index": state.config.worker,
                "workers": len(state.config.worker_ports),
            }
        if state.sync is not None:  # Redis: reachable, rebuilds, reconnects, items skipped
            sync = state.sync
            stats["sync"] = {
                "connected": sync.connected,
                "resyncs": sync.resyncs,
                "reconnects": sync.reconnects,
                "malformed": sync.malformed,
            }
        if state.tenant_caps.caps:  # keyed mode's max_parallel_requests
            stats["tenant_caps"] = state.tenant_caps.stats()
        return JSONResponse(stats)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        """A failure inside a route: an OpenAI 500 that names nothing inside (the server
        logs the traceback)."""
        message = "The gateway failed on this request; retry it, or report the request id."
        return JSONResponse(error_body(message, type="server_error", code="internal_error"), 500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, code=code), exc.status_code)


def _on_own_port(request: Request, config: GatewayConfig) -> bool:
    """Whether a worker was reached on its own loopback port (gateway/workers.py)."""
    server = request.scope.get("server") or (None, None)
    return config.worker is not None and server[1] == config.worker_ports[config.worker]


def _tenant(state: GatewayState, request: Request) -> Tenant | Response:
    """The request's tenant, or the 401 answer when keys are configured and the request
    has no valid one."""
    try:
        return state.auth.authenticate(request.headers.get("authorization"))
    except OpenAIError as err:
        return JSONResponse(err.body(), err.status, headers=err.headers)


def _not_admin(state: GatewayState, request: Request, why: str) -> Response | None:
    """The 401 or 403 answer when keys are configured and the request has no admin key;
    ``why`` says what the operation touches."""
    try:
        tenant = state.auth.authenticate(request.headers.get("authorization"))
    except OpenAIError as err:
        return JSONResponse(err.body(), err.status, headers=err.headers)
    if state.auth.open or tenant.admin:
        return None
    body = error_body(f"{why}: it needs an admin key.", type="permission_error", code="forbidden")
    return JSONResponse(body, 403)
