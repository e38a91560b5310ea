"""Forwarding: pick a replica, send the original body, pass the answer back (raw ASGI).

One attempt, and one retry on the next-best replica when the first fails before its first
byte (connection refused, connect timeout, 5xx or 429, no answer in time from a replica
that fails its probes, a 401 to the gateway's own API key); not when a replica that passes
them sent nothing for the whole read timeout (a 504: another replica would take as
long). A request pinned to one replica (the Responses API's stateful turns: only that
replica holds what they refer to) gets one attempt there. After the first byte the
answer is committed: a stream that breaks ends with an SSE error event, never a silent
truncation. Closing an unfinished upstream answer drops its connection, which is how the
replica learns that the client left (gateway/handler.py cancels the forwarding when that
happens).

Each attempt runs inside an ``Attempt`` (gateway/attempt.py), the one place that tells
the router a request started and finished.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from starlette.types import Send

from gateway.attempt import Attempt, settle_server_errors
from gateway.exchange import Exchange
from gateway.http1 import READ_TIMEOUT, Response, UpstreamError
from gateway.reply import error_event, send_bytes, send_error_passthrough, send_json
from gateway.state import GatewayState
from gateway.upstream import OUT_OF_FILES, POOL_TIMEOUT
from gateway.usage import SSEScanner, cached_tokens_in, usage_in
from prefixgate.wire import OpenAIError, error_body
from router.protocol import DATA_PARALLEL_RANK_HEADER
from router.router import Decision, NoHealthyReplica, ReplicaView

if TYPE_CHECKING:
    from gateway.answer_hooks import AnswerHooks, StreamScanner

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
BUSY = frozenset({429, 503})  # the replica turned the request away for now: try another
UPSTREAM_AUTH = "upstream_auth"  # a replica refused the gateway's own credentials
ATTEMPTS = 2  # the first replica, then the next best once


class Forward(NamedTuple):
    """One request to forward: what the router needs and what the replica gets."""

    keys: list[bytes]  # the prompt's block keys
    prompt_tokens: int  # the prompt's length (pseudo-tokens when keyed by bytes)
    conversation: str | None
    model: str | None  # None: any replica (none has said what it serves yet)
    path: str
    body: bytes
    headers: dict[str, str]
    stream: bool
    method: str = "POST"
    pinned: Decision | None = None  # this replica only, once: route() is not asked
    hooks: AnswerHooks | None = None  # None: chat or completions (gateway/answer_hooks.py)
    owned: bool = False  # about a stored object its tenant owns (a response by id): no model


class UpstreamFailure(NamedTuple):
    """Why an attempt failed before its first byte: a 5xx or 429 answer (status, body),
    or no answer the client can have (status None, ``kind`` names the failure)."""

    status: int | None
    body: bytes
    message: str
    kind: str | None = None
    retry: bool = True  # whether another replica may be tried
    after: str | None = None  # the replica's Retry-After, passed on with its answer


async def forward(state: GatewayState, ex: Exchange, request: Forward, send: Send) -> None:
    """Route and send; retry once elsewhere if the replica fails before answering."""
    router = state.router
    attempts: list[Attempt] = []
    try:
        await _forward(state, ex, request, send, attempts)
    finally:
        settle_server_errors(router, attempts)


async def _forward(
    state: GatewayState, ex: Exchange, request: Forward, send: Send, attempts: list[Attempt]
) -> None:
    router = state.router
    tried: list[str] = []
    failure = UpstreamFailure(None, b"", "no replica answered")
    for _ in range(1 if request.pinned is not None else ATTEMPTS):
        try:
            decision = (
                router.route(
                    request.keys,
                    request.conversation,
                    model=request.model,
                    exclude=tuple(tried),
                    prompt_tokens=request.prompt_tokens,
                )
                if request.pinned is None
                else request.pinned
            )
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
        with Attempt(router, decision) as attempt:
            attempts.append(attempt)
            outcome = await _attempt(state, attempt, view, request, ex, send)
        if outcome is None:
            return
        failure = outcome
        if not failure.retry:
            break
    await send_failure(send, failure, ex)


async def _attempt(
    state: GatewayState,
    attempt: Attempt,
    view: ReplicaView,
    request: Forward,
    ex: Exchange,
    send: Send,
) -> UpstreamFailure | None:
    """One replica's try. None when the client got the answer (whole, or as much of a
    stream as the replica sent); the failure when there is nothing to send yet."""
    rid = attempt.replica_id
    headers = request.headers
    if view.data_parallel_rank is not None:  # the rank whose cache the router chose
        headers = {**headers, DATA_PARALLEL_RANK_HEADER: str(view.data_parallel_rank)}
    try:
        response = await state.upstream.request(
            request.method, view.url + request.path, request.body, headers
        )
    except UpstreamError as exc:
        if exc.kind in (POOL_TIMEOUT, OUT_OF_FILES):
            attempt.not_sent()
        elif exc.kind == READ_TIMEOUT and _healthy(state, rid):
            # Alive (its probes answer) and still working on it: a long answer that is not
            # streamed. Another replica would take as long: tried again, it cost two
            # replicas the timeout each and then failed anyway, blamed on both. A replica
            # that is hung fails its probes, and is retried away from as before.
            attempt.timed_out()
            state.metrics.upstream_failure(rid, exc.kind)
            waited = f"{state.config.upstream_timeout_s:g} s"
            message = f"replica {rid} sent nothing in {waited}"
            return UpstreamFailure(None, b"", message, exc.kind, retry=False)
        else:
            attempt.fail()
        state.metrics.upstream_failure(rid, exc.kind)
        return UpstreamFailure(None, b"", f"replica {rid} failed: {exc.kind}", exc.kind)
    attempt.first_byte()
    try:
        if response.status == 401 and state.vouches_upstream:
            # The credentials were the gateway's, not the client's: the client did nothing
            # wrong, and another replica may take them (a key being rotated).
            attempt.refused()
            state.metrics.upstream_failure(rid, "http_401")
            return UpstreamFailure(None, b"", _refusal(state, rid), UPSTREAM_AUTH)
        if response.status in BUSY:
            # Its queue is full, or it is shutting down: another replica may have room. A
            # 503 counted against the breaker when another replica then served the
            # request, so a replica that was only full was taken out of service for the
            # breaker's cooldown, and its share of the traffic went to the others.
            attempt.busy()
            state.metrics.upstream_failure(rid, f"http_{response.status}")
            error = await _read_error(response)
            after = _header(response, b"retry-after")
            return UpstreamFailure(response.status, error, f"replica {rid} is busy", after=after)
        if response.status >= 500:
            attempt.server_error()
            error = await _read_error(response)
            state.metrics.upstream_failure(rid, f"http_{response.status}")
            return UpstreamFailure(response.status, error, f"replica {rid} failed")
        if request.stream and response.status < 400:
            await _send_stream(state, attempt, response, ex, send, request.hooks)
        else:
            await _send_whole(state, attempt, response, ex, send, request.hooks)
        return None
    finally:
        await response.close()


async def _read_error(response: Response) -> bytes:
    try:
        return await response.read()
    except UpstreamError:
        return b""


def _header(response: Response, name: bytes) -> str | None:
    for key, value in response.raw_headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _refusal(state: GatewayState, replica_id: str) -> str:
    if state.config.upstream_api_key is not None:
        return f"replica {replica_id} refused the gateway's --upstream-api-key (HTTP 401)"
    return (
        f"replica {replica_id} requires an API key (HTTP 401); start the gateway with "
        "--upstream-api-key (env PREFIXGATE_UPSTREAM_API_KEY)"
    )


def _healthy(state: GatewayState, replica_id: str) -> bool:
    view = state.router.replicas.get(replica_id)
    return view is not None and view.healthy


async def send_failure(send: Send, failure: UpstreamFailure, ex: Exchange) -> None:
    """After the retry: the last 5xx or 429 as it came (OpenAI-shaped, its Retry-After
    kept), 503 with Retry-After when the last replica tried had no free connection in time
    or the gateway had no file descriptor to spare, 504 when the replica sent nothing
    within the read timeout, 502 naming the flag to fix when it refused the gateway's
    credentials, or 502 if none answered."""
    if failure.status is not None:
        after = {"Retry-After": failure.after} if failure.after else None
        await send_error_passthrough(send, failure.status, failure.body, ex, after)
        return
    if failure.kind == OUT_OF_FILES:
        body = error_body(
            "The gateway is at its open-file limit; retry shortly.",
            type="server_error",
            code="gateway_busy",
        )
        await send_json(send, 503, body, ex, {"Retry-After": RETRY_AFTER_S})
        return
    if failure.kind == READ_TIMEOUT and not failure.retry:
        body = error_body(
            f"No answer in time ({failure.message}, the gateway's --upstream-timeout-s)."
            " A long answer should be streamed, or that timeout raised.",
            type="server_error",
            code="upstream_timeout",
        )
        await send_json(send, 504, body, ex)
        return
    if failure.kind == UPSTREAM_AUTH:
        body = error_body(
            f"The gateway's replicas refused its credentials: {failure.message}.",
            type="server_error",
            code="upstream_auth",
        )
        await send_json(send, 502, body, ex)
        return
    if failure.kind == POOL_TIMEOUT:
        body = error_body(
            f"Every replica tried is at its connection limit ({failure.message}); retry shortly.",
            type="server_error",
            code="upstream_busy",
        )
        await send_json(send, 503, body, ex, {"Retry-After": RETRY_AFTER_S})
        return
    body = error_body(
        f"Upstream replicas failed before answering ({failure.message}); retry the request.",
        type="server_error",
        code="upstream_unavailable",
    )
    await send_json(send, 502, body, ex)


# A token stream must not wait in a proxy in front: nginx buffers answers by default
# (proxy_buffering on) unless they say this, so tokens reached clients ~4 KiB at a time.
# Engines do not all send them (vLLM sends neither).
EVENT_STREAM_HEADERS = ((b"x-accel-buffering", b"no"), (b"cache-control", b"no-cache"))


def _event_stream_headers(present: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    names = {k.lower() for k, _v in present}
    return [(k, v) for k, v in EVENT_STREAM_HEADERS if k not in names]


def passed_headers(upstream: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream response headers the client gets (ours are added on top)."""
    return [(k, v) for k, v in upstream if k.lower() not in DROPPED_HEADERS]


async def _send_whole(
    state: GatewayState,
    attempt: Attempt,
    upstream: Response,
    ex: Exchange,
    send: Send,
    hooks: AnswerHooks | None,
) -> None:
    """A non-streaming answer (or a 4xx): read it whole, then send it with a
    Content-Length."""
    rid = attempt.replica_id
    try:
        raw = await upstream.read()
    except UpstreamError as exc:
        attempt.fail()
        state.metrics.upstream_failure(rid, exc.kind)
        body = error_body(
            f"Replica {rid} failed while answering: {exc.kind}.",
            type="server_error",
            code="upstream_error",
        )
        await send_json(send, 502, body, ex)
        return
    finally:
        ex.ttfb = ex.ttfb or time.perf_counter()
        await upstream.close()
        attempt.finish()
    if hooks is not None:
        await hooks.answered(attempt.replica_id, upstream.status, raw)
    if upstream.status >= 400:
        await send_error_passthrough(send, upstream.status, raw, ex)
        return
    ex.cached_tokens = cached_tokens_in(raw) if hooks is None else hooks.cached_tokens(raw)
    ex.usage = usage_in(raw)
    await send_bytes(send, upstream.status, raw, passed_headers(upstream.raw_headers), ex)


async def _send_stream(
    state: GatewayState,
    attempt: Attempt,
    upstream: Response,
    ex: Exchange,
    send: Send,
    hooks: AnswerHooks | None,
) -> None:
    """Pump upstream bytes to the client as they come. Cancelling this (the client left)
    closes the upstream connection mid-answer."""
    rid = attempt.replica_id
    scanner: StreamScanner | None = None
    if upstream.content_type().startswith("text/event-stream"):
        scanner = SSEScanner() if hooks is None else hooks.scanner()
    broken = error_event if hooks is None else hooks.error_event
    ex.status = upstream.status
    ex.responded = True
    headers = passed_headers(upstream.raw_headers)
    if scanner is not None:
        headers.extend(_event_stream_headers(headers))
    headers.extend(ex.raw_headers())
    prefilled = False  # the router was told of the first output
    partial = b""  # an SSE event not yet complete: held so a break never cuts one in two
    try:
        await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
        async for chunk in upstream.chunks():
            if ex.ttfb is None:
                ex.ttfb = time.perf_counter()
            if scanner is not None:
                scanner.feed(chunk)
                if hooks is not None:
                    await hooks.streamed(rid, scanner)
                chunk, partial = split_complete_events(partial + chunk)
            if not prefilled and (scanner is None or scanner.output):
                prefilled = True
                attempt.prefill_done()
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if partial:  # the stream ended cleanly on bytes that end no event: pass them on
            await send({"type": "http.response.body", "body": partial, "more_body": True})
            partial = b""
        if scanner is not None and not scanner.done:
            attempt.fail()
            await send(broken(f"replica {rid} ended the stream early"))
    except UpstreamError as exc:
        attempt.fail()
        state.metrics.upstream_failure(rid, f"mid_stream_{exc.kind}")
        await send(broken(f"replica {rid} failed mid-stream ({exc.kind})"))
    finally:
        await upstream.close()
        attempt.finish()
    if attempt.failed:
        ex.status = 502
    if scanner is not None:
        ex.cached_tokens = scanner.cached_tokens
        ex.usage = scanner.usage
        ex.output_events = scanner.outputs
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def split_complete_events(data: bytes) -> tuple[bytes, bytes]:
    """``data`` cut after its last complete SSE event (a blank line, LF or CRLF): what can
    go to the client now, and the incomplete rest to hold."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
    return data[:end], data[end:]


# Request headers engines read, passed on as the client sent them: W3C trace context
# (vLLM with --otlp-traces-endpoint makes its spans children of the caller's), and vLLM's
# per-request priority (--scheduling-policy priority) and session id (named in its block
# events). Nothing else of the client's goes upstream.
PASSED_ON = ("traceparent", "tracestate", "x-vllm-priority", "x-session-id")


def forward_headers(
    request_id: str | None, authorization: str | None, client: Mapping[str, str]
) -> dict[str, str]:
    """Headers sent upstream: the content type, the request id (None: none, the body's
    ``request_id`` names the request: gateway/handler.py ``upstream_request_id``), the
    Authorization a keyed replica needs (``GatewayState.upstream_authorization``), and
    the ``PASSED_ON`` headers of the ``client``'s (lower-cased, as ASGI gives them)."""
    out = {"content-type": "application/json"}
    if request_id is not None:
        out["x-request-id"] = request_id
    if authorization:
        out["authorization"] = authorization
    for name in PASSED_ON:
        value = client.get(name)
        if value is not None:
            out[name] = value
    return out
