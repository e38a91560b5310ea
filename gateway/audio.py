"""vLLM's speech-to-text endpoints, forwarded: ``POST /v1/audio/transcriptions`` and
``/v1/audio/translations``.

A vLLM serving a speech model (Whisper and the like) answers OpenAI's audio API, whose
bodies are ``multipart/form-data``: the audio file and text fields (``model``,
``language``, ``stream``, ...). The official client's ``audio.transcriptions.create``
sends them so. The gateway answered 404 (and, with API keys, 415 for a body that is not
JSON). Now the body goes unchanged, with its own content type, to a healthy replica
serving the form's ``model`` (the one the replicas serve when it names none), the least
loaded: there is no prompt prefix to match. Only the form's text fields are read, never
its file; a stream (``stream=true``) passes as a chat's does.
"""

from __future__ import annotations

import re

from starlette.types import Receive, Scope, Send

from gateway.exchange import Exchange
from gateway.handler import (
    answer,
    forward_watched,
    open_exchange,
    read_post,
    unknown_model,
)
from gateway.passthrough import the_only_model
from gateway.proxy import Forward, forward_headers
from gateway.state import GatewayState
from prefixgate.wire import OpenAIError

AUDIO_PATHS: dict[str, str] = {
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
}
FIELDS = frozenset({"model", "stream"})  # the form fields the gateway reads
MAX_FIELD_BYTES = 1024  # a text field longer than this is not one the gateway reads
_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)


async def serve_audio(state: GatewayState, scope: Scope, receive: Receive, send: Send) -> None:
    headers, ex = open_exchange(scope, AUDIO_PATHS[scope["path"]])
    await answer(state, ex, send, _serve(state, scope, headers, receive, send, ex))


async def _serve(
    state: GatewayState,
    scope: Scope,
    headers: dict[str, str],
    receive: Receive,
    send: Send,
    ex: Exchange,
) -> None:
    _, raw = await read_post(state, scope, headers, receive, ex)
    content_type = headers.get("content-type", "")
    fields = form_fields(raw, content_type)
    model = fields.get("model") or the_only_model(state)
    ex.model = model or ""
    ex.stream = fields.get("stream", "").lower() == "true"
    if model is not None and state.serving(model) is None:
        if not state.has_unknown_model_replica():
            raise unknown_model(model)
        model = None  # only replicas that have not said what they serve: any may try
    sent = forward_headers(ex.request_id, state.upstream_authorization(headers), headers)
    sent["content-type"] = content_type  # the form's, with its boundary
    request = Forward(
        keys=[],
        prompt_tokens=0,
        conversation=None,
        model=model,
        path=scope["path"],
        body=raw,
        headers=sent,
        stream=ex.stream,
    )
    await forward_watched(state, ex, request, receive, send)


def form_fields(body: bytes, content_type: str) -> dict[str, str]:
    """The text fields in ``FIELDS`` of a ``multipart/form-data`` body; a 400 for a body
    that is not one. Files and other fields are skipped, never copied."""
    media = content_type.split(";", 1)[0].strip().lower()
    found = _BOUNDARY.search(content_type)
    if media != "multipart/form-data" or found is None:
        raise OpenAIError(
            "the audio API takes multipart/form-data (a file and its fields), "
            f"got {media or 'no content type'}",
            code="invalid_value",
        )
    delimiter = b"--" + found.group(1).encode("latin-1")
    fields: dict[str, str] = {}
    at = body.find(delimiter)
    while at >= 0:
        start = at + len(delimiter)
        if body.startswith(b"--", start):
            break  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", start)
        end = body.find(b"\r\n" + delimiter, head_end + 4) if head_end >= 0 else -1
        if end < 0:
            break
        head = body[start:head_end]
        name = _NAME.search(head)
        if (
            name is not None
            and b"filename=" not in head.lower()
            and name.group(1).decode("latin-1") in FIELDS
            and end - head_end - 4 <= MAX_FIELD_BYTES
        ):
            value = body[head_end + 4 : end].decode("utf-8", "replace")
            fields.setdefault(name.group(1).decode("latin-1"), value)
        at = end + 2
    return fields
