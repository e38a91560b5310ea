"""vLLM's run-time LoRA adapters through the gateway: ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM serves them with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

Reinforcement learning with LoRA loads a new adapter into its engines after each training
step, and serving stacks load adapters as tenants bring them. Behind the gateway the
request for an adapter may go to any replica, so each must hold it: the gateway answered
404, and the clients' only way was every engine's own URL, after which the gateway
routed the new name only once its next read of the replicas' model lists came round
(every ``NAMES_REFRESH_S``: a 404 for the name until then).

Now the gateway sends the body to every replica (once per URL: a vLLM's data-parallel
ranks share one), then reads their model lists at once, so the adapter is routed, with
its own cache, from the next request. 200 when every replica said yes (vLLM's text
answer, the first); otherwise the worst status, with each replica's answer. Keyed mode:
admin keys only (an adapter is a model every tenant may call).

SageMaker's adapter routes, as vLLM's image serves them with run-time loading on, do the
same: ``POST /adapters`` (``{"name", "src"}``) loads ``src`` as ``name`` on every
replica, ``DELETE /adapters/NAME`` unloads it, answered with SageMaker's lines
("Adapter NAME registered"). Requests then name it in the
``X-Amzn-SageMaker-Adapter-Identifier`` header (gateway/sagemaker.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import unquote

import httpx
from starlette.types import Receive, Scope, Send

from gateway.auth import Tenant
from gateway.exchange import Exchange
from gateway.handler import answer, open_exchange, read_post
from gateway.probes import refresh_names
from gateway.reply import send_bytes, send_json
from gateway.state import GatewayState
from prefixgate.json_body import load_json_object
from prefixgate.wire import OpenAIError, error_body
from router.protocol import redacted_url

ADAPTER_PATHS: dict[str, str] = {
    "/v1/load_lora_adapter": "load_lora_adapter",
    "/v1/unload_lora_adapter": "unload_lora_adapter",
}


SAGEMAKER_ADAPTERS = "/adapters"  # POST; DELETE /adapters/NAME


def is_sagemaker_adapters_path(path: str) -> bool:
    return path == SAGEMAKER_ADAPTERS or path.startswith(SAGEMAKER_ADAPTERS + "/")


async def serve_adapters(state: GatewayState, scope: Scope, receive: Receive, send: Send) -> None:
    headers, ex = open_exchange(scope, ADAPTER_PATHS[scope["path"]])
    await answer(state, ex, send, _serve(state, scope, headers, receive, send, ex))


async def serve_sagemaker_adapters(
    state: GatewayState, scope: Scope, receive: Receive, send: Send
) -> None:
    path = scope["path"]
    loading = path == SAGEMAKER_ADAPTERS
    headers, ex = open_exchange(scope, "load_lora_adapter" if loading else "unload_lora_adapter")
    await answer(state, ex, send, _serve_sagemaker(state, scope, headers, receive, send, ex))


async def _serve_sagemaker(
    state: GatewayState,
    scope: Scope,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
) -> None:
    path, method = scope["path"], scope["method"]
    if path == SAGEMAKER_ADAPTERS:
        tenant, raw = await read_post(state, scope, headers, receive, ex)
        _admin_only(state, tenant)
        body = load_json_object(raw)
        name, src = body.get("name"), body.get("src")
        for field_name, value in (("name", name), ("src", src)):
            if not isinstance(value, str) or not value:
                raise OpenAIError(f"{field_name}: required, a non-empty string", param=field_name)
        assert isinstance(name, str)
        loaded = json.dumps({"lora_name": name, "lora_path": src}).encode()
        await _fan_out(state, headers, send, ex, "/v1/load_lora_adapter", loaded, name,
                       f"Adapter {name} registered")  # fmt: skip
        return
    name = unquote(path[len(SAGEMAKER_ADAPTERS) + 1 :])
    if not name or "/" in name:
        raise OpenAIError(f"{method} {path}: Not Found", status=404, code="not_found")
    if method != "DELETE":
        raise OpenAIError(
            f"{method} {path}: Method Not Allowed", status=405, headers={"Allow": "DELETE"}
        )
    tenant = state.auth.authenticate_request(headers)
    ex.admit(tenant)
    _admin_only(state, tenant)
    unloaded = json.dumps({"lora_name": name}).encode()
    await _fan_out(state, headers, send, ex, "/v1/unload_lora_adapter", unloaded, name,
                   f"Adapter {name} unregistered")  # fmt: skip


def _admin_only(state: GatewayState, tenant: Tenant) -> None:
    if not (state.auth.open or tenant.admin):
        raise OpenAIError(
            "Loading or unloading an adapter changes every tenant's models: an admin key's to send",
            status=403,
            type="permission_error",
            code="admin_only",
        )


async def _serve(
    state: GatewayState,
    scope: Scope,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
) -> None:
    tenant, raw = await read_post(state, scope, headers, receive, ex)
    _admin_only(state, tenant)
    name = load_json_object(raw).get("lora_name")
    await _fan_out(state, headers, send, ex, scope["path"], raw, name, None)


async def _fan_out(
    state: GatewayState,
    headers: dict[str, str],
    send: Send,
    ex: Exchange,
    path: str,
    raw: bytes,
    name: object,
    said: str | None,
) -> None:
    """``raw`` to ``path`` on every replica, then their model lists read again; 200 with
    ``said`` (None: the first replica's own answer) when every one took it."""
    ex.model = name if isinstance(name, str) else ""
    urls = dict.fromkeys(view.url for view in state.router.replicas.values())
    if not urls:
        raise OpenAIError(
            "No replica to load the adapter into", status=503, code="no_healthy_replica"
        )
    sent = {"content-type": "application/json"}
    if (authorization := state.upstream_authorization(headers)) is not None:
        sent["authorization"] = authorization  # a keyed engine's (state.py)
    answers = await asyncio.gather(*(send_to_replica(state, url + path, raw, sent) for url in urls))
    await refresh_names(state, {})  # every replica's list, now: the name routes at once
    failed = [(url, a) for url, a in zip(urls, answers, strict=True) if a[0] != 200]
    if not failed:
        text = (b"content-type", b"text/plain; charset=utf-8")
        await send_bytes(send, 200, (said or answers[0][1]).encode(), [text], ex)
        return
    status = max(a[0] for _, a in failed)
    message = f"{len(failed)} of {len(urls)} replicas did not take it: {failed[0][1][1][:300]}"
    body: dict[str, Any] = error_body(message, code="adapter_failed")
    body["replicas"] = {
        redacted_url(url): {"status": a[0], "answer": a[1][:1000]}
        for url, a in zip(urls, answers, strict=True)
    }
    await send_json(send, status if 400 <= status < 600 else 502, body, ex)


async def send_to_replica(
    state: GatewayState, url: str, body: bytes, headers: dict[str, str], method: str = "POST"
) -> tuple[int, str]:
    """One replica's (status, answer text) to an operation sent to every replica (also
    gateway/engine_control.py); 502 and the reason when it gave none."""
    try:
        response = await state.client.request(
            method, url, content=body, headers=headers, timeout=state.config.upstream_timeout_s
        )
    except httpx.HTTPError as exc:
        return 502, f"no answer: {type(exc).__name__}"
    return response.status_code, response.text
