"""``Guard``: the ASGI middleware in front of both servers' apps. Torch-free.

Per request, before the app sees it:

* ``X-Request-Id``: kept when it is 1-128 printable ASCII characters, otherwise replaced
  by a fresh id (in the scope, so the app and everything it forwards to see the clean
  one); echoed on the response when the app does not set it.
* Body size: a declared ``Content-Length`` over ``max_body_bytes`` gets 413 at once; a
  body that grows past it while being read is cut off (the app sees a disconnect) and
  gets 413.
* ``require_json``: a ``POST`` with a body whose ``Content-Type`` is not
  ``application/json`` gets 415. A browser sends a cross-site "simple" request
  (``text/plain``, form types, or a Blob with no type) without asking the server first;
  with this on, none is served.

And after it: an exception that escapes the app before its answer began becomes a 500
OpenAI envelope that says nothing of the internals (the traceback goes to the log);
after the answer began, the connection is dropped (a truncated answer must not look
whole).

Slow and oversized heads, and bodies that stop arriving, are cut off a layer below, in
the HTTP protocol (prefixgate/http_limits.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixgate.wire import error_body

log = logging.getLogger("prefixgate.guard")

REQUEST_ID_OK = re.compile(rb"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
# Set in the scope when the request id is the guard's, not the client's.
REQUEST_ID_MADE = "prefixgate.request_id_made"


@dataclass(slots=True, frozen=True)
class GuardConfig:
    max_body_bytes: int = 16 * 1024 * 1024
    require_json: bool = False  # POST bodies must be application/json
    # ... except these paths' bodies, which may be multipart/form-data (file uploads)
    form_paths: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")


class Guard:
    __slots__ = ("app", "config")

    def __init__(self, app: ASGIApp, config: GuardConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id, content_type, declared, chunked = _settle_headers(scope)
        limit = self.config.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(send, 413, _too_large(limit), "request_too_large", request_id)
            return
        if (
            self.config.require_json
            and scope["method"] == "POST"
            and (chunked or declared not in (None, b"0"))  # a POST with a body
            and not _is_json(content_type)
            and not (scope["path"] in self.config.form_paths and _is_form(content_type))
        ):
            shown = content_type.decode("latin-1") if content_type else "none"
            message = f"POST bodies must be sent with Content-Type: application/json (got {shown})."
            await _refuse(send, 415, message, "unsupported_media_type", request_id)
            return
        cycle = _Cycle(receive, send, limit, request_id)
        try:
            # A declared length within the limit needs no counting: the HTTP parser
            # delivers no more body than the Content-Length says.
            counted = cycle.receive if declared is None else receive
            await self.app(scope, counted, cycle.send)
        except Exception:
            if cycle.started:
                raise  # mid-answer: the server drops the connection
            if not cycle.too_large:
                log.exception("request %s failed inside the server", request_id.decode())
                body = "The server failed on this request; retry it, or report the request id."
                await _refuse(send, 500, body, "internal_error", request_id, "server_error")
                return
        if cycle.too_large and not cycle.started:
            await _refuse(send, 413, _too_large(limit), "request_too_large", request_id)


class _Cycle:
    """One request's receive and send as the app sees them: the body counted against
    the limit, the answer watched (begun? request id set?)."""

    __slots__ = ("_receive", "_send", "limit", "received", "request_id", "started", "too_large")

    def __init__(self, receive: Receive, send: Send, limit: int, request_id: bytes) -> None:
        self._receive = receive
        self._send = send
        self.limit = limit
        self.request_id = request_id
        self.received = 0
        self.started = False
        self.too_large = False

    async def receive(self) -> Message:
        if self.too_large:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.too_large = True  # the guard answers 413 once the app is done
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if not self.started:  # the answer's head: checked once, the body passes straight
            if self.too_large:
                return  # the 413 is the guard's to send
            self.started = True
            headers = message.get("headers", ())
            for name, _ in headers:
                if name.lower() == b"x-request-id":
                    break
            else:
                message = {**message, "headers": [*headers, (b"x-request-id", self.request_id)]}
        await self._send(message)


def _settle_headers(scope: Scope) -> tuple[bytes, bytes | None, bytes | None, bool]:
    """(request id, content type, content length, chunked body?); a bad or missing
    request id is replaced in ``scope['headers']``."""
    request_id = content_type = declared = None
    chunked = False
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            request_id = value
        elif name == b"content-type":
            content_type = value
        elif name == b"content-length":
            declared = value
        elif name == b"transfer-encoding":
            chunked = True
    if request_id is None or not REQUEST_ID_OK.fullmatch(request_id):
        request_id = os.urandom(16).hex().encode()  # uuid4() costs 4x as much
        scope[REQUEST_ID_MADE] = True
        scope["headers"] = [
            *((k, v) for k, v in scope["headers"] if k != b"x-request-id"),
            (b"x-request-id", request_id),
        ]
    return request_id, content_type, declared, chunked


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


def _is_form(content_type: bytes | None) -> bool:
    return content_type is not None and content_type.split(b";", 1)[0].strip().lower() == (
        b"multipart/form-data"
    )


def _too_large(limit: int) -> str:
    return f"The request body is larger than this server's limit of {limit} bytes."


async def _refuse(
    send: Send,
    status: int,
    message: str,
    code: str,
    request_id: bytes,
    type: str = "invalid_request_error",
) -> None:
    body = json.dumps(error_body(message, type=type, code=code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id),
    ]
    if status in (413, 500):
        headers.append((b"connection", b"close"))  # an unread or suspect body: start afresh
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
