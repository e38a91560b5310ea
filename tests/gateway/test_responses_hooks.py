"""``ResponsesScanner`` (gateway/responses_hooks.py) reads a Responses event stream
however it is cut into chunks: named or unnamed events, LF or CRLF."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.responses_hooks import ResponsesScanner


def stream(named: bool, newline: bytes) -> bytes:
    response: dict[str, Any] = {"id": "resp_1", "status": "in_progress"}
    done = {**response, "usage": {"input_tokens_details": {"cached_tokens": 32}}}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": response}),
        ("response.in_progress", {"response": response}),
        ("response.output_text.delta", {"delta": "hi"}),
        ("response.completed", {"response": done}),
    ]
    out = b""
    for kind, fields in events:
        data = json.dumps({**fields, "type": kind}).encode()  # "type" last, as vLLM writes it
        head = b"event: " + kind.encode() + newline if named else b""
        out += head + b"data: " + data + newline + newline
    return out


@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
def test_the_scanner_reads_every_cut(named: bool, newline: bytes, size: int) -> None:
    data = stream(named, newline)
    scanner = ResponsesScanner()
    seen: list[tuple[str | None, bool, bool]] = []
    for at in range(0, len(data), size):
        scanner.feed(data[at : at + size])
        seen.append((scanner.response_id, scanner.output, scanner.done))
    assert scanner.response_id == "resp_1" and scanner.done and scanner.cached_tokens == 32
    # the id is known before any output, the output before the end
    assert all(rid == "resp_1" for rid, output, _ in seen if output)
    assert all(output for _, output, done in seen if done)


def test_an_error_event_ends_the_stream_without_output() -> None:
    scanner = ResponsesScanner(count_cached=False)
    scanner.feed(b'event: response.created\ndata: {"type":"response.created","response":')
    scanner.feed(b'{"id":"resp_2","usage":{"input_tokens_details":{"cached_tokens":5}}}}\n\n')
    scanner.feed(b'event: error\ndata: {"type":"error","message":"x"}\n\n')
    assert scanner.response_id == "resp_2" and scanner.done and not scanner.output
    assert scanner.cached_tokens is None  # not counted
    scanner.feed(b": keep-alive\n\n")
    assert scanner.done
