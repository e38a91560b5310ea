"""vLLM's engine controls through the gateway, sent to every replica: ``POST /sleep``
(``?level=``, ``?mode=``), ``/wake_up`` (``?tags=``), ``/pause`` (``?mode=``), ``/resume``,
and what they report, ``GET /is_sleeping`` and ``/is_paused``. vLLM serves them in its
development mode (``VLLM_SERVER_DEV_MODE=1``).

Reinforcement-learning frameworks put their engines to sleep or pause them while they
train and load new weights; operators free GPUs shared between models. Behind the gateway
they had to find each engine's own URL, and the gateway learned of the change only at its
next probe: requests routed meanwhile waited for the engine. Now one call reaches every
replica (once per URL: a vLLM's data-parallel ranks share one), with its query string.
Then the gateway asks every replica's ``/is_paused`` at once (gateway/probes.py), so a
cluster put to sleep is out of routing, and a woken one back in, before the answer.

A sleep at level 1 or 2 and a pause (unless ``mode=keep`` or ``clear_cache=false``) make
vLLM drop its prefix cache, and it publishes that only with its next step, after the
wake or resume: the gateway forgets those replicas' blocks as the engines answer, as its
own cache reset does (gateway/cache_reset.py), rather than route the first requests
after by blocks gone.

A control answers 200 with the first replica's answer when every replica said 200, else
the worst status with each replica's answer. ``/is_sleeping`` and ``/is_paused`` say true
only when every replica does, with each replica's answer. Keyed mode: admin keys only
(they stop every tenant's traffic).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import parse_qs

from starlette.types import Receive, Scope, Send

from gateway.adapters import send_to_replica
from gateway.exchange import Exchange
from gateway.handler import answer, open_exchange, read_body
from gateway.probes import probe_all
from gateway.reply import send_bytes, send_json
from gateway.state import GatewayState
from prefixgate.wire import OpenAIError, error_body
from router.protocol import redacted_url

CONTROL_PATHS: dict[str, str] = {  # path -> its method
    "/sleep": "POST",
    "/wake_up": "POST",
    "/pause": "POST",
    "/resume": "POST",
    "/is_sleeping": "GET",
    "/is_paused": "GET",
}


async def serve_engine_control(
    state: GatewayState, scope: Scope, receive: Receive, send: Send
) -> None:
    path = scope["path"]
    headers, ex = open_exchange(scope, path[1:])
    await answer(state, ex, send, _serve(state, scope, headers, receive, send, ex))


async def _serve(
    state: GatewayState,
    scope: Scope,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
) -> None:
    path, method = scope["path"], CONTROL_PATHS[scope["path"]]
    if scope["method"] != method:
        raise OpenAIError(
            f"{scope['method']} {path}: Method Not Allowed", status=405, headers={"Allow": method}
        )
    tenant = state.auth.authenticate_request(headers)
    ex.admit(tenant)
    if not (state.auth.open or tenant.admin):
        raise OpenAIError(
            f"{path} stops or starts every tenant's traffic: an admin key's to send",
            status=403,
            type="permission_error",
            code="admin_only",
        )
    if method == "POST":  # vLLM reads none; read so the connection stays usable
        await read_body(receive, headers.get("content-length"), state.config.max_body_bytes)
    urls = list(dict.fromkeys(view.url for view in state.router.replicas.values()))
    if not urls:
        raise OpenAIError("No replica to send it to", status=503, code="no_healthy_replica")
    query = scope.get("query_string", b"").decode("latin-1")
    target = path + (f"?{query}" if query else "")
    sent = {}
    if (authorization := state.upstream_authorization(headers)) is not None:
        sent["authorization"] = authorization  # a keyed engine's (state.py)
    answers = await asyncio.gather(
        *(send_to_replica(state, url + target, b"", sent, method) for url in urls)
    )
    if method == "POST":
        if drops_caches(path, query):
            done = {url for url, (status, _) in zip(urls, answers, strict=True) if status == 200}
            views = state.router.replicas.values()
            state.router.forget_cached_state([v.replica_id for v in views if v.url in done])
        await probe_all(state)  # each replica's pause state now, not at the next probe
    replicas = {
        redacted_url(url): {"status": status, "answer": _parsed(text)}
        for url, (status, text) in zip(urls, answers, strict=True)
    }
    failed = [a for a in answers if a[0] != 200]
    if failed:
        status = max(s for s, _ in failed)
        message = f"{len(failed)} of {len(urls)} replicas did not do it: {failed[0][1][:300]}"
        body: dict[str, Any] = error_body(message, code="engine_control_failed")
        body["replicas"] = replicas
        await send_json(send, status if 400 <= status < 600 else 502, body, ex)
        return
    if method == "GET":  # true only when every replica says so
        key = path[1:]
        said = [_parsed(text) for _, text in answers]
        every = all(isinstance(a, dict) and a.get(key) is True for a in said)
        await send_json(send, 200, {key: every, "replicas": replicas}, ex)
        return
    kind = (b"content-type", b"application/json")
    await send_bytes(send, 200, answers[0][1].encode(), [kind], ex)


def drops_caches(path: str, query: str) -> bool:
    """Whether vLLM (0.32) drops its prefix cache for this control: ``/sleep`` unless at
    ``level=0`` (a pause only; the default is 1), ``/pause`` unless ``mode=keep`` or
    ``clear_cache`` is false (the default is true)."""
    params = {name: values[-1].strip().lower() for name, values in parse_qs(query).items()}
    if path == "/sleep":
        level = params.get("level", "1")
        return not (level.isdigit() and int(level) == 0)
    if path == "/pause":
        falsy = ("false", "0", "off", "no", "f", "n")
        return params.get("mode") != "keep" and params.get("clear_cache", "true") not in falsy
    return False


def _parsed(text: str) -> Any:
    """A replica's answer as JSON when it is, else its first 1,000 characters."""
    try:
        return json.loads(text)
    except ValueError:
        return text[:1000]
