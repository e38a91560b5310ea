"""SGLang's native ``POST /generate``, routed by prefix.

SGLang's own API takes a prompt as ``text`` or as token ids (``input_ids``), with
``sampling_params``, and streams SSE when ``stream`` is true. Reinforcement-learning
frameworks drive their rollouts through it, sending token ids, and many samples of one
prompt (a GRPO group) that should land where that prompt is cached; sglang-router routes
it by prefix. The gateway answered 404.

Now a single prompt is keyed as a completion's (gateway/routing.py: token ids exactly,
text through the model's tokenizer) and routed like one, and the body goes to the replica
unchanged. A batch (a list of texts or of id lists) is keyed by its first prompt. The body
names no model (an SGLang server serves one): it is the one model the replicas serve, and
a 400 when they serve several. Tenants: SGLang's ``/generate`` takes no ``cache_salt``, so
in keyed mode only a tenant with ``shared_namespace: true`` may use it (403 otherwise),
as with the Messages API (gateway/messages.py).

SGLang's ``POST /abort_request`` (``rid``, or ``abort_all``: RL frameworks stop a
rollout's stragglers so) was a 404 too: a ``rid`` now goes to the replica running it,
``abort_all`` to every replica.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.abortable import abort_at
from gateway.exchange import Exchange
from gateway.handler import (
    answer,
    forward_watched,
    open_exchange,
    read_post,
    refuse_salted,
    with_tenant_priority,
)
from gateway.passthrough import the_only_model
from gateway.proxy import Forward, forward_headers
from gateway.reply import send_bytes
from gateway.state import GatewayState
from prefixgate.json_body import load_json_object
from prefixgate.wire import CompletionRequest, OpenAIError, parse_request

PATH = "/generate"
ABORT_PATH = "/abort_request"


async def serve_generate(state: GatewayState, scope: Scope, receive: Receive, send: Send) -> None:
    headers, ex = open_exchange(scope, "generate")
    await answer(state, ex, send, _serve(state, scope, headers, receive, send, ex))


async def _serve(
    state: GatewayState,
    scope: Scope,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
) -> None:
    tenant, raw = await read_post(state, scope, headers, receive, ex)
    refuse_salted(state, tenant, f"{PATH} (SGLang's native API)")
    body = load_json_object(raw)
    if with_tenant_priority(tenant, body):
        raw = json.dumps(body, separators=(",", ":")).encode()
    model = the_only_model(state)
    ex.model, ex.stream = model or "", body.get("stream") is True
    block_size = state.config.block_size
    keys: list[bytes] = []
    prompt_tokens = 0
    prompt = first_prompt(body)
    view = state.serving(model) if model is not None else None
    if prompt is not None and view is not None:
        block_size = int(view.block_size)
        request = parse_request(CompletionRequest, {"model": model, "prompt": prompt})
        assert isinstance(request, CompletionRequest)
        keyed = await state.keys.keys(request, view.model, block_size, "", len(raw))
        keys, prompt_tokens = keyed.keys, keyed.prompt_tokens
    ex.block_size = block_size
    forwarded = Forward(
        keys=keys,
        prompt_tokens=prompt_tokens,
        conversation=None,
        model=model,
        path=PATH,
        body=raw,
        headers=forward_headers(ex.request_id, state.upstream_authorization(headers), headers),
        stream=ex.stream,
    )
    with state.sglang_generating.hold(_rids(body.get("rid")), tenant.name, ex):
        await forward_watched(state, ex, forwarded, receive, send)


def _rids(rid: object) -> list[str]:
    """The ids a ``/generate`` request may be aborted by: its ``rid``, or a batch's."""
    if isinstance(rid, str):
        return [rid] if rid else []
    if isinstance(rid, list):
        return [r for r in rid if isinstance(r, str) and r]
    return []


async def serve_abort(state: GatewayState, scope: Scope, receive: Receive, send: Send) -> None:
    headers, ex = open_exchange(scope, "abort_request")
    await answer(state, ex, send, _abort(state, scope, headers, receive, send, ex))


async def _abort(
    state: GatewayState,
    scope: Scope,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
) -> None:
    """SGLang's ``POST /abort_request``: ``rid`` to the replica running it
    (gateway/abortable.py); ``abort_all`` to every replica, in open mode or from an admin
    tenant (it stops every tenant's requests)."""
    tenant, raw = await read_post(state, scope, headers, receive, ex)
    body = load_json_object(raw)
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(abort_all, bool):
        raise OpenAIError(
            "rid: a request id (a string); abort_all: a boolean", param="rid", code="invalid_value"
        )
    forwarded = forward_headers(ex.request_id, state.upstream_authorization(headers), headers)
    if abort_all:
        if not (state.auth.open or tenant.admin):
            raise OpenAIError(
                "abort_all stops every tenant's requests: an admin key's to send",
                status=403,
                type="permission_error",
                code="admin_only",
            )
        urls = dict.fromkeys(view.url for view in state.router.replicas.values())
        sent = [abort_at(state.upstream, url, ABORT_PATH, body, forwarded) for url in urls]
    else:
        targets = state.sglang_generating.targets(
            [rid] if rid else [], tenant.name, state.router.replicas, state.auth.open
        )
        sent = [
            abort_at(state.upstream, url, ABORT_PATH, {**body, "rid": one}, forwarded)
            for url, rids in targets.items()
            for one in rids
        ]
    await asyncio.gather(*sent)
    await send_bytes(send, 200, b"", [], ex)  # as the engines answer an abort


MEDIA_FIELDS = ("image_data", "audio_data", "video_data")


def first_prompt(body: dict[str, Any]) -> str | list[int] | None:
    """The prompt to key by: ``input_ids`` (ids, or the first of a batch) over ``text``
    (a string, or the first of a batch); None when neither is usable (the replica answers
    for the body: the gateway only routes), or when the prompt carries media: SGLang
    keys a media item's tokens by the item as well, and where they fall in the prompt is
    its own expansion's, so two images would look like one cached prefix."""
    if any(body.get(name) for name in MEDIA_FIELDS):
        return None
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]
    if isinstance(ids, list) and ids and all(_is_id(i) for i in ids):
        return ids
    text = body.get("text")
    if isinstance(text, list) and text:
        text = text[0]
    return text if isinstance(text, str) and text else None


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32
