"""The hot path: ``POST /v1/chat/completions`` and ``/v1/completions`` as a raw ASGI
handler.

These two paths carry all the traffic, so they skip FastAPI's routing, dependency
solving and middleware stack (which cost more than the proxying itself) and the
Request/Response objects: the body is read from ``receive``, the answer written to
``send``. Every other path stays on the FastAPI app (gateway/app.py).

Client disconnects: one watcher task per request waits on ``receive`` for
``http.disconnect`` and cancels the handler, which closes the upstream connection
mid-answer, so the replica frees the request's blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable
from typing import Any, NamedTuple

from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from gateway.auth import Tenant
from gateway.exchange import Exchange
from gateway.proxy import Forward, forward, forward_headers
from gateway.reply import send_json
from gateway.state import GatewayState
from prefixgate.guard import REQUEST_ID_MADE, REQUEST_ID_OK
from prefixgate.json_body import load_json_object
from prefixgate.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    error_body,
    parse_request,
)
from prefixgate.wire_messages import error_payload
from router.conversation import conversation_key

log = logging.getLogger("prefixgate.gateway")

# path -> (endpoint label, request schema)
HOT_PATHS: dict[str, tuple[str, type[BaseModel]]] = {
    "/v1/chat/completions": ("chat", ChatCompletionRequest),
    "/v1/completions": ("completions", CompletionRequest),
}


async def serve_completion(
    state: GatewayState, scope: Scope, receive: Receive, send: Send, path: str
) -> None:
    endpoint, schema = HOT_PATHS[path]
    headers, ex = open_exchange(scope, endpoint)
    if scope["method"] != "POST":
        not_allowed = OpenAIError(
            f"{scope['method']} {path}: Method Not Allowed", status=405, headers={"Allow": "POST"}
        )
        await answer(state, ex, send, _raise(not_allowed))
        return
    await answer(state, ex, send, _serve(state, headers, receive, send, ex, schema, path))


def open_exchange(scope: Scope, endpoint: str) -> tuple[dict[str, str], Exchange]:
    """A request's headers and its ``Exchange`` (the log line and metrics it ends in),
    with the client's request id or a new one."""
    # ASGI servers hand header names lowercased; latin-1 is HTTP's byte-for-byte decoding.
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    given = headers.get("x-request-id")
    ex = Exchange(
        request_id=given or os.urandom(16).hex(),  # uuid4: 4x the cost
        endpoint=endpoint,
        started=time.perf_counter(),
        id_given=given is not None and not scope.get(REQUEST_ID_MADE, False),
    )
    return headers, ex


def upstream_request_id(ex: Exchange, body: dict[str, Any]) -> str | None:
    """The ``x-request-id`` to send upstream (None: none).

    vLLM names a request by its ``x-request-id`` header, else by the body's
    ``request_id``: the id its answer carries (``chatcmpl-ID``, ``generate-tokens-ID``)
    and the id an abort takes. A client that set only the body's found the gateway's own
    id in its place. So where the client sent no header and the body names the request,
    the body's id is the request's: sent as the header when it can be one (and then the
    exchange's too: the log line and the answer's ``x-request-id``), else no header goes.
    """
    named = body.get("request_id")
    if ex.id_given or not isinstance(named, str) or not named:
        return ex.request_id
    if REQUEST_ID_OK.fullmatch(named.encode("utf-8", "replace")) is None:
        return None
    ex.request_id = named
    return named


class ServedModel(NamedTuple):
    route: str | None  # the name to route by; None: any replica (none has said yet)
    tokenizer: str  # the model whose tokenizer keys the prompt
    keys: str  # the model id of the keys (an adapter's own)
    block_size: int


def served_model(state: GatewayState, model: str) -> ServedModel:
    """How a request for ``model`` is keyed and routed; a 404 when no replica serves it
    (while some replica has not said what it serves, any of them may try)."""
    view = state.serving(model)
    if view is None:
        if not state.has_unknown_model_replica():
            raise unknown_model(model)
        return ServedModel(None, model, model, state.config.block_size)
    # An alias or an adapter is tokenized as the model it is served by.
    return ServedModel(model, view.model, view.key_model(model), int(view.block_size))


def post_only(scope: Scope) -> None:
    """A 405 for any method but POST."""
    if scope["method"] != "POST":
        raise OpenAIError(
            f"{scope['method']} {scope['path']}: Method Not Allowed",
            status=405,
            headers={"Allow": "POST"},
        )


async def read_post(
    state: GatewayState, scope: Scope, headers: dict[str, str], receive: Receive, ex: Exchange
) -> tuple[Tenant, bytes]:
    """A POST's tenant (named in ``ex``) and body within the limit: a 405 for another
    method, a 401 for a bad key, a 413 for a body too large."""
    post_only(scope)
    tenant = state.auth.authenticate_request(headers)
    ex.admit(tenant)
    raw = await read_body(receive, headers.get("content-length"), state.config.max_body_bytes)
    return tenant, raw


def with_tenant_fields(
    state: GatewayState, tenant: Tenant, body: dict[str, Any], raw: bytes
) -> tuple[bytes, str | None]:
    """``raw`` with what keyed mode puts in a tenant's request to an engine, and the salt:
    the ``cache_salt`` the replica must see (``forwarded_salt``: keyed mode replaces the
    client's with the tenant's) and the tenant's own ``priority``, if it has one
    (gateway/auth.py). The body is re-encoded only when that changes it; otherwise its
    bytes pass as sent. A salt that is not a string passes, for the replica's 400 (unless
    keyed mode replaces it)."""
    client_salt = body.get("cache_salt")
    salt = state.auth.forwarded_salt(tenant, client_salt if isinstance(client_salt, str) else None)
    changed = without_report_mode(body)
    changed = without_transfer_params(state, tenant, body) or changed
    changed = with_tenant_priority(tenant, body) or changed
    if not (salt == client_salt or (salt is None and not isinstance(client_salt, str))):
        changed = True
        if salt is None:
            body.pop("cache_salt", None)
        else:
            body["cache_salt"] = salt
    return (json.dumps(body, separators=(",", ":")).encode() if changed else raw), salt


# vLLM's per-request event mode, in ``vllm_xargs`` (the token API's
# ``sampling_params.extra_args``): "full" re-announces the cached blocks a request reuses,
# as stores no removal follows. The bridge cannot tell those from a second copy of a block
# (each copy leaves with a removal of its own), so the keys would stay published after
# the engine evicted their blocks, and draw requests there. The engines' events are the
# bridge's to read: the gateway drops the field.
REPORT_MODE = "kv_cache_report_mode"


def without_report_mode(body: dict[str, Any]) -> bool:
    """Drops ``REPORT_MODE`` from the body's engine arguments; True when there was one."""
    changed = False
    for args in _engine_args(body):
        if isinstance(args, dict) and REPORT_MODE in args:
            del args[REPORT_MODE]
            changed = True
    return changed


# vLLM's disaggregation fields: what a KV (or encoder) cache connector is to do with the
# request's cache, set by the proxy that splits prefill from decode. An engine that reads
# them, whether or not it has a connector, trusts them: ``do_remote_prefill`` with
# ``remote_prefill_cached_tokens`` sets the ``cached_tokens`` it reports (a tenant's bill),
# and with NIXL, ``remote_block_ids`` and an engine's address read those blocks, whoever's
# prompt they hold, while ``do_remote_decode`` keeps a request's blocks after it ends.
# Keyed mode keeps them for admin keys (a disaggregating proxy's); a tenant's are dropped.
TRANSFER_PARAMS = ("kv_transfer_params", "ec_transfer_params")


def without_transfer_params(state: GatewayState, tenant: Tenant, body: dict[str, Any]) -> bool:
    """Checks the body's ``TRANSFER_PARAMS`` and, in keyed mode, drops a tenant's (not an
    admin's) from it and its engine arguments; True when that changed the body.

    In every mode, a ``kv_transfer_params`` among the engine arguments that is not an
    object is a 400: vLLM would read it as one, fail with a 500 after taking the
    request, and the gateway would try it on a second replica."""
    engine_args = [a for a in _engine_args(body) if isinstance(a, dict)]
    for args in engine_args:
        value = args.get("kv_transfer_params")
        if value is not None and not isinstance(value, dict):
            where = "vllm_xargs" if args is body.get("vllm_xargs") else "extra_args"
            raise OpenAIError(
                f"{where}.kv_transfer_params must be an object, got {type(value).__name__}",
                param=f"{where}.kv_transfer_params",
            )
    if state.auth.open or tenant.admin:
        return False
    changed = False
    for fields in (body, *engine_args):
        for name in TRANSFER_PARAMS:
            if name in fields:
                del fields[name]
                changed = True
    return changed


def _engine_args(body: dict[str, Any]) -> tuple[Any, Any]:
    """The body's free-form engine arguments: ``vllm_xargs``, and the token API's
    ``sampling_params.extra_args``."""
    params = body.get("sampling_params")
    return body.get("vllm_xargs"), params.get("extra_args") if isinstance(params, dict) else None


def with_tenant_priority(tenant: Tenant, body: dict[str, Any]) -> bool:
    """The tenant's own ``priority`` in place of the body's (a tenant without one: the
    body's as sent); True when that changed the body."""
    if tenant.priority is None or (
        body.get("priority") == tenant.priority and type(body.get("priority")) is int
    ):
        return False
    body["priority"] = tenant.priority
    return True


def refuse_salted(state: GatewayState, tenant: Tenant, what: str) -> None:
    """A 403 in keyed mode for a tenant with a salt of its own, on an API that cannot
    carry ``cache_salt`` (``what``): its prompts would share the engine's cache with every
    other tenant's."""
    if state.auth.forwarded_salt(tenant, None) is not None:
        raise OpenAIError(
            f"{what} cannot carry your tenant's cache salt (it has no cache_salt), so its "
            "prompts would share the cache with other tenants; use the OpenAI API, or a "
            "key whose tenant has shared_namespace: true",
            status=403,
            type="permission_error",
            code="no_cache_salt",
        )


async def answer(
    state: GatewayState,
    ex: Exchange,
    send: Send,
    serve: Awaitable[None],
    anthropic: bool = False,
) -> None:
    """Await one request's serving; what it raises becomes the client's answer: an
    ``OpenAIError`` its status and body, a client gone a 499 in the log, anything else a
    500 (or, mid-answer, a dropped connection). The exchange is finished either way.
    ``anthropic``: the body in Anthropic's shape, for the Messages API's clients."""
    try:
        await serve
    except OpenAIError as err:
        body = error_payload(err.status, err.message) if anthropic else err.body()
        await send_json(send, err.status, body, ex, err.headers)
    except ClientGone:
        ex.status = 499
    except Exception:
        log.exception("request %s failed inside the gateway", ex.request_id)
        if ex.responded:
            raise  # mid-answer: nothing left to do but drop the connection
        message = "The gateway failed on this request."
        body = (
            error_payload(500, message) if anthropic else error_body(message, type="server_error")
        )
        await send_json(send, 500, body, ex)
    finally:
        ex.finish(state.metrics)


async def _raise(err: OpenAIError) -> None:
    raise err


async def _serve(
    state: GatewayState,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
    schema: type[BaseModel],
    path: str,
) -> None:
    tenant = state.auth.authenticate_request(headers)
    ex.admit(tenant)
    raw = await read_body(receive, headers.get("content-length"), state.config.max_body_bytes)
    body = load_json_object(raw)  # 400 for deep nesting and lone surrogates too
    await serve_body(state, tenant, headers, raw, body, receive, send, ex, schema, path)


async def serve_body(
    state: GatewayState,
    tenant: Tenant,
    headers: dict[str, str],
    raw: bytes,
    body: dict[str, Any],
    receive: Receive,
    send: Send,
    ex: Exchange,
    schema: type[BaseModel],
    path: str,
) -> None:
    """A chat or completion whose body has been read: keyed, routed and forwarded to
    ``path`` (also SageMaker's ``/invocations``, gateway/sagemaker.py)."""
    parsed = parse_request(schema, body)
    assert isinstance(parsed, ChatCompletionRequest | CompletionRequest)
    ex.model = parsed.model
    ex.stream = parsed.stream
    route_model, tokenizer_model, key_model, block_size = served_model(state, parsed.model)
    ex.block_size = block_size

    raw, salt = with_tenant_fields(state, tenant, body, raw)

    prompt = await state.keys.keys(
        parsed,
        tokenizer_model,
        block_size,
        salt or "",
        len(raw),
        served=route_model is not None,
        key_model=key_model,
    )
    conversation = state.auth.scoped_conversation(tenant, conversation_key(body, headers))
    request = Forward(
        # A prompt the engine scores is computed whole wherever it goes: routed, and
        # priced, with nothing cached (and its answer's time teaches the fit so).
        keys=[] if parsed.scores_prompt else prompt.keys,
        prompt_tokens=prompt.prompt_tokens,
        conversation=conversation,
        model=route_model,
        path=path,
        body=raw,
        headers=forward_headers(
            upstream_request_id(ex, body), state.upstream_authorization(headers), headers
        ),
        stream=parsed.stream,
    )
    await forward_watched(state, ex, request, receive, send)


async def forward_watched(
    state: GatewayState, ex: Exchange, request: Forward, receive: Receive, send: Send
) -> None:
    """``forward`` the request, abandoned (a 499 in the log) if the client disconnects;
    a 429 when its tenant has its ``max_parallel_requests`` in flight already (at the
    gateways sharing a Redis: gateway/tenant_caps.py) or has used its ``rpm_limit`` or
    ``tpm_limit`` (gateway/tenant_rates.py); a 404 for a model outside its tenant's
    ``models`` (gateway/auth.py)."""
    if not (request.owned or state.auth.may_call(ex.tenant, ex.model)):
        if not ex.model:
            raise OpenAIError(
                "Name the model: your key may call only some of the models served.",
                param="model",
                code="missing_model",
            )
        raise unknown_model(ex.model)
    caps = state.tenant_caps
    counted = ex.tenant in caps.caps  # the keys may change before it ends (keys_file.py)
    if counted and (cap := await caps.acquire(ex.tenant)) is not None:
        raise OpenAIError(
            f"Your key's tenant has {cap} requests in flight, its max_parallel_requests: "
            "retry when one has finished.",
            status=429,
            type="rate_limit_error",
            code="max_parallel_requests",
            headers={"Retry-After": "1"},
        )
    rates = state.tenant_rates
    ex.prompt_tokens = request.prompt_tokens
    charged = False  # its tokens count against its tenant's tpm_limit
    try:
        if ex.tenant in rates.limits:  # after the cap: a request it refuses costs no rate
            charged = await _admit_rate(state, ex)
        watch = DisconnectWatch(receive)
        try:
            await forward(state, ex, request, send)
        except asyncio.CancelledError:
            if not watch.gone:
                raise  # not ours: the server is shutting down
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            ex.status = 499
        finally:
            watch.stop()
    finally:
        if counted:
            caps.release(ex.tenant)
        if charged and (tokens := ex.tokens()) is not None:
            rates.charge(ex.tenant, sum(tokens))


async def _admit_rate(state: GatewayState, ex: Exchange) -> bool:
    """Take one request from the tenant's per-minute buckets, or refuse it with a 429
    that names the limit and when a retry passes (its headers in ``ex.rate_headers``);
    whether its tokens are charged (the tenant has a ``tpm_limit``)."""
    verdict = await state.tenant_rates.admit(ex.tenant)
    ex.rate_headers = verdict.headers
    if not verdict.admitted:
        limit = "rpm_limit" if verdict.refused_by == "requests" else "tpm_limit"
        raise OpenAIError(
            f"Your key's tenant has used its {limit} ({verdict.refused_by} per minute): "
            f"retry in {verdict.wait_s:.1f} s.",
            status=429,
            type="rate_limit_error",
            code=limit,
        )
    return state.tenant_rates.counts_tokens(ex.tenant)


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class DisconnectWatch:
    """Cancels the current task when the client disconnects (one task per request,
    started once the request body has been read)."""

    __slots__ = ("_task", "active", "gone")

    _task: asyncio.Task[None] | None

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self.active = True
        target = asyncio.current_task()
        assert target is not None
        self._task = asyncio.get_running_loop().create_task(self._watch(receive, target))

    async def _watch(self, receive: Receive, target: asyncio.Task[object]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        # After the answer is sent the server reports a disconnect too: not a client leaving.
        if self.active:
            self.gone = True
            target.cancel()

    def stop(self) -> None:
        """Ends the watch. The reference to its task is dropped first: the cancelled
        task keeps its CancelledError, whose traceback keeps the watch's frame, and so
        this watch; a watch keeping the task back would make every request leave a
        reference cycle (about 30 objects) for the garbage collector to find."""
        self.active = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"The request body is larger than the gateway's limit of {limit} bytes.",
        status=413,
        code="request_too_large",
    )


def unknown_model(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist or no replica serves it.",
        status=404,
        param="model",
        code="model_not_found",
    )
