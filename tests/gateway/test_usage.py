"""The cache usage read from passing answers (gateway/usage.py)."""

from __future__ import annotations

import json

from gateway.usage import SSEScanner, cached_tokens_in


def test_sse_scanner_across_chunk_boundaries() -> None:
    usage = {"usage": {"prompt_tokens_details": {"cached_tokens": 32}}}
    stream = b"data: {}\n\n" + b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"
    scanner = SSEScanner()
    for i in range(0, len(stream), 7):
        scanner.feed(stream[i : i + 7])
    assert scanner.done and scanner.cached_tokens == 32
    assert cached_tokens_in(b'{"usage":null}') is None


def test_cached_tokens_in_answers_whatever_their_shape() -> None:
    def body(usage: object, content: str = "hi") -> bytes:
        return json.dumps({"choices": [{"text": content}], "usage": usage}).encode()

    details = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}
    assert cached_tokens_in(body(details)) == 7
    assert cached_tokens_in(json.dumps({"usage": details}, indent=2).encode()) == 7
    quoted = '"prompt_tokens_details": {"cached_tokens": 99}'  # text, not the usage
    assert cached_tokens_in(body(details, content=quoted)) == 7
    assert cached_tokens_in(body({"prompt_tokens_details": None}, content=quoted)) is None
    assert cached_tokens_in(body({"prompt_tokens_details": {"cached_tokens": None}})) is None


def test_sse_scanner_sees_the_first_output_not_the_role_chunk() -> None:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    scanner = SSEScanner()
    scanner.feed(role)
    assert not scanner.output
    token = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    scanner.feed(token[:30])  # the event is not complete yet
    assert not scanner.output
    scanner.feed(token[30:])
    assert scanner.output
    for first in (
        b'data: {"choices":[{"text": "x","index":0}]}\n\n',  # a text completion
        b'data: {"choices":[{"delta":{"tool_calls":[{"id":"c"}]}}]}\n\n',
        b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\n',  # no text at all
        # vLLM's token API (output_mode tokens): generated ids only
        b'data: {"request_id":"generate-tokens-1","choices":[{"index":0,"token_ids":[79]}]}\n\n',
    ):
        scanner = SSEScanner()
        scanner.feed(first)
        assert scanner.output, first
    # The prompt's ids (return_token_ids) and an empty list are not output.
    for before in (
        b'data: {"prompt_token_ids":[1,2],"choices":[{"index":0,"token_ids":[]}]}\n\n',
        b'data: {"choices":[{"delta":{"role":"assistant","content":""},"token_ids":[ ]}]}\n\n',
    ):
        scanner = SSEScanner()
        scanner.feed(before)
        assert not scanner.output, before
