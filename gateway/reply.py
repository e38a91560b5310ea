"""Answers written to the client over raw ASGI: whole answers with our headers, OpenAI
error envelopes, an upstream error passed on, and the SSE event that ends a broken stream.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Send

from gateway.exchange import Exchange
from prefixgate.wire import error_body, is_error_body

JSON_TYPE = (b"content-type", b"application/json")


async def send_json(
    send: Send,
    status: int,
    body: dict[str, Any],
    ex: Exchange,
    extra: dict[str, str] | None = None,
) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    await send_bytes(send, status, data, [JSON_TYPE, *_encoded(extra)], ex)


def _encoded(headers: dict[str, str] | None) -> list[tuple[bytes, bytes]]:
    if not headers:
        return []
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


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


async def send_error_passthrough(
    send: Send, status: int, raw: bytes, ex: Exchange, extra: dict[str, str] | None = None
) -> None:
    """An upstream error answer, with ``extra`` headers; bodies that are not OpenAI-shaped
    get wrapped."""
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = None
    if is_error_body(parsed):
        await send_bytes(send, status, raw, [JSON_TYPE, *_encoded(extra)], ex)
        return
    text = raw.decode("utf-8", "replace").strip()[:2000]
    body = error_body(
        f"Upstream replica answered {status}: {text or '(empty body)'}",
        type="server_error" if status >= 500 else "invalid_request_error",
        code="upstream_error",
    )
    await send_json(send, status, body, ex, extra)


def error_event(message: str) -> dict[str, Any]:
    """The SSE events that end a stream the replica broke off: an error event, then
    ``[DONE]`` so every SSE client sees the stream end (the answer is committed: the
    status went out with the first byte; OpenAI's SDKs raise on the error event)."""
    payload = error_body(
        message + "; the answer is incomplete.", type="server_error", code="upstream_error"
    )
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    data += b"data: [DONE]\n\n"
    return {"type": "http.response.body", "body": data, "more_body": True}
