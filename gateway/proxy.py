"""Forwarding: pick a replica, send the original body, pass the answer back (raw ASGI).

One attempt, and one retry on the next-best replica when the first fails before its first
byte (connection refused, timeout, 5xx). After the first byte the answer is committed: a
stream that breaks ends with an SSE error event, never a silent truncation. Closing an
unfinished upstream answer drops its connection, which is how the replica learns that the
client left (gateway/handler.py cancels the forwarding when that happens).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from starlette.types import Send

from gateway.exchange import Exchange
from gateway.state import GatewayState
from gateway.upstream import UpstreamError, UpstreamResponse
from prefixgate.wire import OpenAIError, error_body, is_error_body
from router.router import NoHealthyReplica

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
JSON_TYPE = (b"content-type", b"application/json")


class Attempt(NamedTuple):
    replica_id: str
    response: UpstreamResponse


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
    headers: dict[str, str],
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
        state.metrics.decision(decision.reason)
        view = router.replicas.get(rid)
        if view is None:  # removed between route() and here
            continue
        router.request_started(rid)
        try:
            response = await state.upstream.post(view.url + path, body, headers)
        except UpstreamError as exc:
            router.request_finished(rid, ok=False)
            state.metrics.upstream_failure(rid, exc.kind)
            failure = UpstreamFailure(None, b"", f"replica {rid} failed: {exc.kind}")
            continue
        except BaseException:  # cancelled (the client left): the replica did nothing wrong
            router.request_finished(rid, ok=True)
            raise
        if response.status < 500:
            return Attempt(rid, response)
        try:
            error = await response.read()
        except UpstreamError:
            error = b""
        finally:
            await response.close()
            router.request_finished(rid, ok=False)
        state.metrics.upstream_failure(rid, f"http_{response.status}")
        failure = UpstreamFailure(response.status, error, f"replica {rid} failed")
    return failure


async def send_failure(send: Send, failure: UpstreamFailure, ex: Exchange) -> None:
    """After the retry: the last 5xx as it came (OpenAI-shaped), or 502 if none answered."""
    if failure.status is None:
        body = error_body(
            f"Upstream replicas failed before answering ({failure.message}); retry the request.",
            type="server_error",
            code="upstream_unavailable",
        )
        await send_json(send, 502, body, ex)
    else:
        await send_error_passthrough(send, failure.status, failure.body, ex)


async def send_error_passthrough(send: Send, status: int, raw: bytes, ex: Exchange) -> None:
    """An upstream error answer; bodies that are not OpenAI-shaped get wrapped."""
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = None
    if is_error_body(parsed):
        await send_bytes(send, status, raw, [JSON_TYPE], ex)
        return
    text = raw.decode("utf-8", "replace").strip()[:2000]
    body = error_body(
        f"Upstream replica answered {status}: {text or '(empty body)'}",
        type="server_error" if status >= 500 else "invalid_request_error",
        code="upstream_error",
    )
    await send_json(send, status, body, ex)


async def send_json(
    send: Send,
    status: int,
    body: dict[str, Any],
    ex: Exchange,
    extra: dict[str, str] | None = None,
) -> None:
    headers = [JSON_TYPE]
    if extra:
        headers.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items())
    data = json.dumps(body, separators=(",", ":")).encode()
    await send_bytes(send, status, data, headers, ex)


async def send_bytes(
    send: Send, status: int, data: bytes, headers: list[tuple[bytes, bytes]], ex: Exchange
) -> None:
    """A whole answer: our headers added, Content-Length set."""
    ex.status = status
    headers.extend(ex.raw_headers())
    headers.append((b"content-length", str(len(data)).encode()))
    ex.responded = True
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def passed_headers(upstream: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream response headers the client gets (ours are added on top)."""
    return [(k, v) for k, v in upstream if k.lower() not in DROPPED_HEADERS]


async def send_buffered(state: GatewayState, attempt: Attempt, ex: Exchange, send: Send) -> None:
    """A non-streaming answer: read it whole, then send it with a Content-Length."""
    upstream = attempt.response
    ok = False
    try:
        raw = await upstream.read()
        ok = True
    except UpstreamError as exc:
        state.metrics.upstream_failure(attempt.replica_id, exc.kind)
        body = error_body(
            f"Replica {attempt.replica_id} failed while answering: {exc.kind}.",
            type="server_error",
            code="upstream_error",
        )
        await send_json(send, 502, body, ex)
        return
    except BaseException:  # cancelled (the client left): the replica did nothing wrong
        ok = True
        raise
    finally:
        ex.ttfb = ex.ttfb or time.perf_counter()
        await upstream.close()
        state.router.request_finished(attempt.replica_id, ok=ok)
    if upstream.status >= 400:
        await send_error_passthrough(send, upstream.status, raw, ex)
        return
    ex.cached_tokens = cached_tokens_in(raw)
    await send_bytes(send, upstream.status, raw, passed_headers(upstream.raw_headers), ex)


async def send_stream(state: GatewayState, attempt: Attempt, ex: Exchange, send: Send) -> None:
    """Pump upstream bytes to the client as they come. Cancelling this (the client left)
    closes the upstream connection mid-answer."""
    upstream = attempt.response
    rid = attempt.replica_id
    scanner = SSEScanner() if upstream.content_type().startswith("text/event-stream") else None
    ex.status = upstream.status
    ex.responded = True
    headers = passed_headers(upstream.raw_headers)
    headers.extend(ex.raw_headers())
    ok = True
    try:
        await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
        async for chunk in upstream.chunks():
            if ex.ttfb is None:
                ex.ttfb = time.perf_counter()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if scanner is not None:
                scanner.feed(chunk)
        if scanner is not None and not scanner.done:
            ok = False
            await send(_error_event(f"replica {rid} ended the stream early"))
    except UpstreamError as exc:
        ok = False
        state.metrics.upstream_failure(rid, f"mid_stream_{exc.kind}")
        await send(_error_event(f"replica {rid} failed mid-stream ({exc.kind})"))
    finally:
        await upstream.close()
        state.router.request_finished(rid, ok=ok)
    if not ok:
        ex.status = 502
    if scanner is not None:
        ex.cached_tokens = scanner.cached_tokens
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
    """``usage.prompt_tokens_details.cached_tokens`` of a JSON body, when it has one.

    Parses only the flat ``prompt_tokens_details`` object, not the whole answer: the key
    with its quotes cannot occur inside a JSON string (quotes there are escaped), and
    only ``usage`` has it. Anything unexpected falls back to parsing the whole body.
    """
    if b'"cached_tokens"' not in raw:
        return None
    key = b'"prompt_tokens_details"'
    at = raw.rfind(key)
    start = raw.find(b"{", at) if at >= 0 else -1
    end = raw.find(b"}", start) if start >= 0 else -1
    if end > start >= 0 and raw[at + len(key) : start].strip() == b":":
        try:
            details = json.loads(raw[start : end + 1])
        except ValueError:
            details = None
        if isinstance(details, dict):
            value = details.get("cached_tokens")
            return value if isinstance(value, int) else None
    try:
        usage = json.loads(raw).get("usage") or {}
        value = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def forward_headers(
    headers: dict[str, str], request_id: str, keep_authorization: bool
) -> dict[str, str]:
    """Headers sent upstream: the content type, the request id, and (open mode) the
    client's Authorization, which a foreign backend may need."""
    out = {"content-type": "application/json", "x-request-id": request_id}
    if keep_authorization and (authorization := headers.get("authorization")):
        out["authorization"] = authorization
    return out
