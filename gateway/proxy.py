"""Forwarding: pick a replica, send the original body, stream the answer back.

One attempt, and one retry on the next-best replica when the first fails before its first
byte (connection refused, timeout, 5xx). After the first byte the answer is committed: a
stream that breaks ends with an SSE error event, never a silent truncation. A client that
goes away closes the upstream response, so the replica sees the disconnect and frees the
request's blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.exchange import Exchange
from prefixgate.wire import OpenAIError, error_body, is_error_body
from router.router import NoHealthyReplica

if TYPE_CHECKING:
    from gateway.app import GatewayState

# Upstream response headers we never pass on: hop-by-hop, or ones we set ourselves.
DROPPED_HEADERS = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"date",
        b"server",
        b"x-request-id",
        b"x-prefixgate-replica",
        b"x-prefixgate-route",
    }
)
RETRY_AFTER_S = "1"


class Attempt(NamedTuple):
    replica_id: str
    response: httpx.Response


class UpstreamFailure(NamedTuple):
    """Why the last attempt failed: a 5xx answer (status, body) or no answer (status None)."""

    status: int | None
    body: bytes
    message: str


async def open_upstream(
    state: GatewayState,
    ex: Exchange,
    keys: list[bytes],
    conversation: str | None,
    model: str | None,
    path: str,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
) -> Attempt | UpstreamFailure:
    """Route and send; retry once elsewhere if the replica fails before answering."""
    router = state.router
    tried: list[str] = []
    failure = UpstreamFailure(None, b"", "no replica answered")
    for _ in range(2):
        try:
            decision = router.route(keys, conversation, model=model, exclude=tuple(tried))
        except NoHealthyReplica:
            if tried:
                break
            raise OpenAIError(
                f"No healthy replica serves model {ex.model!r} right now; retry shortly.",
                status=503,
                type="server_error",
                code="no_healthy_replica",
                headers={"Retry-After": RETRY_AFTER_S},
            ) from None
        rid = decision.replica_id
        if tried:
            ex.retries += 1
            state.metrics.retries.inc()
        tried.append(rid)
        ex.set_decision(rid, decision)
        state.metrics.decisions.labels(decision.reason.split(" ", 1)[0]).inc()
        view = router.replicas.get(rid)
        if view is None:  # removed between route() and here
            continue
        router.request_started(rid)
        request = state.client.build_request("POST", view.url + path, content=body, headers=headers)
        try:
            response = await state.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            router.request_finished(rid, ok=False)
            state.metrics.upstream_failures.labels(rid, type(exc).__name__).inc()
            failure = UpstreamFailure(None, b"", f"replica {rid} failed: {type(exc).__name__}")
            continue
        if response.status_code < 500:
            return Attempt(rid, response)
        try:
            error = await response.aread()
        except httpx.HTTPError:
            error = b""
        finally:
            await response.aclose()
        router.request_finished(rid, ok=False)
        state.metrics.upstream_failures.labels(rid, f"http_{response.status_code}").inc()
        failure = UpstreamFailure(response.status_code, error, f"replica {rid} failed")
    return failure


def failure_response(failure: UpstreamFailure, ex: Exchange) -> Response:
    """After the retry: the last 5xx as it came (OpenAI-shaped), or 502 if none answered."""
    if failure.status is None:
        body = error_body(
            f"Upstream replicas failed before answering ({failure.message}); retry the request.",
            type="server_error",
            code="upstream_unavailable",
        )
        return json_response(502, body, ex)
    return error_passthrough(failure.status, failure.body, ex)


def error_passthrough(status: int, raw: bytes, ex: Exchange) -> Response:
    """An upstream error answer; bodies that are not OpenAI-shaped get wrapped."""
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = None
    if is_error_body(parsed):
        return Response(raw, status, headers=ex.headers(), media_type="application/json")
    text = raw.decode("utf-8", "replace").strip()[:2000]
    body = error_body(
        f"Upstream replica answered {status}: {text or '(empty body)'}",
        type="server_error" if status >= 500 else "invalid_request_error",
        code="upstream_error",
    )
    return json_response(status, body, ex)


def json_response(
    status: int, body: dict[str, Any], ex: Exchange, extra: dict[str, str] | None = None
) -> Response:
    ex.status = status
    headers = ex.headers()
    if extra:
        headers.update(extra)
    return Response(
        json.dumps(body, separators=(",", ":")).encode(),
        status,
        headers=headers,
        media_type="application/json",
    )


def response_headers(upstream: httpx.Response, ex: Exchange) -> list[tuple[bytes, bytes]]:
    raw = [(k, v) for k, v in upstream.headers.raw if k.lower() not in DROPPED_HEADERS]
    raw.extend((k.encode(), v.encode()) for k, v in ex.headers().items())
    return raw


async def buffered_response(
    state: GatewayState, attempt: Attempt, ex: Exchange, receive: Receive
) -> Response:
    """A non-streaming answer: read it whole (the client leaving cancels the read)."""
    upstream = attempt.response
    ok = False
    try:
        raw = await _unless_disconnected(upstream.aread(), receive)
        ok = True
    except httpx.HTTPError as exc:
        state.metrics.upstream_failures.labels(attempt.replica_id, type(exc).__name__).inc()
        ex.status = 502
        body = error_body(
            f"Replica {attempt.replica_id} failed while answering: {type(exc).__name__}.",
            type="server_error",
            code="upstream_error",
        )
        return json_response(502, body, ex)
    except ClientGone:
        ex.status = 499
        ok = True  # the replica did nothing wrong
        return Response(b"", 499)
    finally:
        ex.ttfb = ex.ttfb or time.perf_counter()
        await upstream.aclose()
        state.router.request_finished(attempt.replica_id, ok=ok)
    if upstream.status_code >= 400:
        ex.status = upstream.status_code
        return error_passthrough(upstream.status_code, raw, ex)
    ex.status = upstream.status_code
    ex.cached_tokens = cached_tokens_in(raw)
    response = Response(raw, upstream.status_code)
    response.raw_headers = [*response_headers(upstream, ex), *response.raw_headers]
    return response


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def _unless_disconnected(work: Any, receive: Receive) -> bytes:
    task: asyncio.Task[bytes] = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if task.done():
        watch.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class StreamingProxy(Response):
    """Pumps upstream bytes to the client as they come, watching for the client leaving."""

    def __init__(self, state: GatewayState, attempt: Attempt, ex: Exchange) -> None:
        self.state = state
        self.attempt = attempt
        self.ex = ex
        self.status_code = attempt.response.status_code
        self.raw_headers = response_headers(attempt.response, ex)
        self.background = None
        is_sse = attempt.response.headers.get("content-type", "").startswith("text/event-stream")
        self.scanner = SSEScanner() if is_sse else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.ex.status = self.status_code
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
        if not pump.done():  # the client left: cancelling the pump closes the upstream
            self.ex.status = 499
            pump.cancel()
        else:
            watch.cancel()
        await asyncio.gather(pump, watch, return_exceptions=True)
        self.ex.finish(self.state)

    async def _pump(self, send: Send) -> None:
        upstream = self.attempt.response
        ok = True
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for chunk in upstream.aiter_raw():
                if self.ex.ttfb is None:
                    self.ex.ttfb = time.perf_counter()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if self.scanner is not None:
                    self.scanner.feed(chunk)
        except httpx.HTTPError as exc:
            ok = False
            self.state.metrics.upstream_failures.labels(
                self.attempt.replica_id, f"mid_stream_{type(exc).__name__}"
            ).inc()
            await send(
                _error_event(
                    f"replica {self.attempt.replica_id} failed mid-stream ({type(exc).__name__})"
                )
            )
        else:
            if self.scanner is not None and not self.scanner.done:
                ok = False
                await send(
                    _error_event(f"replica {self.attempt.replica_id} ended the stream early")
                )
        finally:
            await upstream.aclose()
            self.state.router.request_finished(self.attempt.replica_id, ok=ok)
        if not ok:
            self.ex.status = 502
        if self.scanner is not None:
            self.ex.cached_tokens = self.scanner.cached_tokens
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error_event(message: str) -> dict[str, Any]:
    payload = error_body(
        message + "; the answer is incomplete.", type="server_error", code="upstream_error"
    )
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    return {"type": "http.response.body", "body": data, "more_body": True}


class SSEScanner:
    """Watches a passing SSE stream for ``[DONE]`` and the usage chunk, without copying
    more than the one event that straddles a chunk boundary."""

    __slots__ = ("cached_tokens", "done", "tail")

    def __init__(self) -> None:
        self.tail = b""
        self.done = False
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        data = self.tail + chunk if self.tail else chunk
        events = data.replace(b"\r\n", b"\n").split(b"\n\n")
        self.tail = events.pop()
        for event in events:
            self._event(event)

    def _event(self, event: bytes) -> None:
        if event.startswith(b"data: [DONE]"):
            self.done = True
        elif b'"cached_tokens"' in event and event.startswith(b"data:"):
            found = cached_tokens_in(event[5:])
            if found is not None:
                self.cached_tokens = found


def cached_tokens_in(raw: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a JSON body, when it has one."""
    if b'"cached_tokens"' not in raw:
        return None
    try:
        usage = json.loads(raw).get("usage") or {}
        value = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def forward_headers(
    items: Iterable[tuple[bytes, bytes]], request_id: str, keep_authorization: bool
) -> list[tuple[bytes, bytes]]:
    """Headers sent upstream: the content type, the request id, and (open mode) the
    client's Authorization, which a foreign backend may need."""
    out = [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]
    if keep_authorization:
        out.extend((k, v) for k, v in items if k == b"authorization")
    return out
