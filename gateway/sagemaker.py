"""Amazon SageMaker's container contract, as vLLM serves it: ``GET|POST /ping`` and
``POST /invocations``.

SageMaker sends a container's health checks to ``/ping`` and every request to
``/invocations``, and vLLM's image serves both (vLLM's
``entrypoints/serve/sagemaker``). A multi-GPU instance running one engine per GPU
behind this gateway is the deployment it is for, and the gateway answered both 404.

* ``/ping`` is 200 once a replica is healthy (``/ready``'s test), else 503: SageMaker
  sends no traffic to a container before its ping answers 200.
* ``/invocations`` takes the body vLLM's takes and serves it as the endpoint vLLM would
  pick: a body with ``messages`` is a chat, one with ``prompt`` or ``prompt_embeds`` a
  completion, each keyed and routed by its prompt as on its own path. Any other body
  (a pooling model's embedding, score or rerank) goes to a replica's own
  ``/invocations``, by load, for vLLM to tell by the model's task.
* vLLM's ``/invocations`` reads the model from the ``X-Amzn-SageMaker-Adapter-Identifier``
  header (an adapter, or the model) and ignores the body's; here the header wins too,
  and a body's ``model`` that no replica serves is dropped, so the one model answers it
  as vLLM's does.
* Stateful sessions (``SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true``, lasting
  ``SAGEMAKER_SESSIONS_EXPIRATION`` seconds, vLLM's variables): ``{"requestType":
  "NEW_SESSION"}`` and ``"CLOSE"`` bodies open and close one, and a request carrying
  ``X-Amzn-SageMaker-Session-Id`` must name an open one, with vLLM's answers and errors.
  vLLM keeps them in its own process, so each replica would know only the sessions it
  opened itself: the gateway keeps them, and the session id is the request's
  conversation key (router/conversation.py), so a session's turns follow its cache
  to one replica, which is what SageMaker's sticky sessions are for. The header does
  not go upstream. Sessions live in the gateway's memory: a gateway restarted, or a
  second one, does not know them (SageMaker runs one container per instance).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from gateway.exchange import Exchange
from gateway.handler import answer, open_exchange, read_post, serve_body
from gateway.passthrough import forward_body, the_only_model
from gateway.reply import send_bytes
from gateway.sagemaker_sessions import Sessions, bad_request
from gateway.state import GatewayState
from prefixgate.json_body import load_json_object
from prefixgate.wire import ChatCompletionRequest, CompletionRequest, OpenAIError

INVOCATIONS_PATH = "/invocations"
PING_PATH = "/ping"
SESSION_TYPES = ("NEW_SESSION", "CLOSE")
SESSION_HEADER = "x-amzn-sagemaker-session-id"
ADAPTER_HEADER = "x-amzn-sagemaker-adapter-identifier"


async def serve_ping(state: GatewayState, scope: Scope, send: Send) -> None:
    """200 (empty, as vLLM's) once a replica is healthy; 503 before. Not logged, as
    ``/health`` is not: SageMaker asks every few seconds."""
    if scope["method"] in ("GET", "POST"):
        ready = any(v.healthy for v in state.router.replicas.values())
        status, body, extra = (200 if ready else 503), b"", []
    else:
        status, extra = 405, [(b"allow", b"GET, POST")]
        message = f"{scope['method']} {PING_PATH}: Method Not Allowed"
        body = json.dumps(OpenAIError(message, status=405).body()).encode()
        extra.append((b"content-type", b"application/json"))
    headers = [*extra, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def serve_invocations(
    state: GatewayState, scope: Scope, receive: Receive, send: Send
) -> None:
    headers, ex = open_exchange(scope, "invocations")
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
    body = load_json_object(raw)
    session = headers.get(SESSION_HEADER)
    if "requestType" in body:
        await _session_request(state.sessions, body, session, send, ex)
        return
    if session is not None:
        if state.sessions is None:
            raise bad_request(
                "Invalid payload. stateful sessions not enabled, "
                "X-Amzn-SageMaker-Session-Id header not supported"
            )
        state.sessions.check(session)
    if _model_of_invocation(state, body, headers.get(ADAPTER_HEADER)):
        raw = json.dumps(body, separators=(",", ":")).encode()
    schema: type[BaseModel]
    if "messages" in body:
        ex.endpoint = "chat"
        path, schema = "/v1/chat/completions", ChatCompletionRequest
    elif "prompt" in body or "prompt_embeds" in body:
        ex.endpoint = "completions"
        path, schema = "/v1/completions", CompletionRequest
    else:
        await forward_body(state, tenant, headers, raw, body, receive, send, ex, INVOCATIONS_PATH)
        return
    await serve_body(state, tenant, headers, raw, body, receive, send, ex, schema, path)


def _model_of_invocation(state: GatewayState, body: dict[str, Any], adapter: str | None) -> bool:
    """vLLM's ``/invocations`` takes the model from the adapter header and ignores the
    body's: the header's is set; else a body's model that a replica serves stays, and
    any other (or none) becomes the one model the replicas serve (a 400 when they serve
    several). True when the body changed."""
    if adapter:
        body["model"] = adapter
        return True
    model = body.get("model")
    if isinstance(model, str) and state.serving(model) is not None:
        return False
    only = the_only_model(state)
    if only is None:  # no replica has said what it serves: let one answer
        changed = "model" in body
        body.pop("model", None)
        return changed
    body["model"] = only
    return True


async def _session_request(
    sessions: Sessions | None,
    body: dict[str, Any],
    session: str | None,
    send: Send,
    ex: Exchange,
) -> None:
    """``{"requestType": "NEW_SESSION"}`` or ``"CLOSE"`` (nothing else in the body),
    answered as vLLM does: a line of text, the session in a header."""
    ex.endpoint = "session"
    kind = body["requestType"]
    if kind not in SESSION_TYPES or len(body) != 1:
        raise bad_request(
            "requestType: must be 'NEW_SESSION' or 'CLOSE', alone in the body", "requestType"
        )
    if sessions is None:
        raise bad_request("Invalid payload. stateful sessions not enabled")
    if kind == "NEW_SESSION":
        made, expires = sessions.open()
        stamp = datetime.fromtimestamp(expires, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        header = (b"x-amzn-sagemaker-new-session-id", f"{made}; Expires={stamp}".encode())
        text = f"Session {made} created"
    else:
        sessions.close(session)
        assert session is not None
        header = (b"x-amzn-sagemaker-closed-session-id", session.encode("latin-1"))
        text = f"Session {session} closed"
    content_type = (b"content-type", b"text/plain; charset=utf-8")
    await send_bytes(send, 200, text.encode(), [content_type, header], ex)
