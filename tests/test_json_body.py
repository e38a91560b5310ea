from __future__ import annotations

import json

import pytest

from prefixgate.json_body import MAX_JSON_DEPTH, load_json_body
from prefixgate.wire import OpenAIError


def _refused(raw: bytes) -> str:
    with pytest.raises(OpenAIError) as err:
        load_json_body(raw)
    assert err.value.status == 400 and err.value.code == "invalid_json"
    return err.value.message


def test_ordinary_bodies_pass_unchanged() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "héllo [x] {y} 😀 \u2028"}],
        "tools": [{"function": {"parameters": {"properties": {"a": {"type": "object"}}}}}],
    }
    for raw in (json.dumps(body).encode(), json.dumps(body, ensure_ascii=False).encode()):
        assert load_json_body(raw) == body


def test_depth_at_the_limit_passes_and_one_more_is_refused() -> None:
    def nested(depth: int) -> bytes:  # an object holding depth - 1 nested arrays
        return b'{"x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"

    assert load_json_body(nested(MAX_JSON_DEPTH))
    assert "deeper than" in _refused(nested(MAX_JSON_DEPTH + 1))
    assert "deeper than" in _refused(nested(200_000))  # past Python's recursion limit


def test_many_brackets_inside_strings_are_not_depth() -> None:
    raw = json.dumps({"prompt": "[" * 10_000 + "{" * 10_000}).encode()
    assert load_json_body(raw) == {"prompt": "[" * 10_000 + "{" * 10_000}
    wide = json.dumps({"messages": [{"role": "user", "content": str(i)} for i in range(500)]})
    assert len(load_json_body(wide.encode())["messages"]) == 500  # type: ignore[index]


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b'{"prompt": "\\ud800"}', "prompt"),
        (b'{"prompt": "a\\uDFFFb"}', "prompt"),
        (b'{"messages": [{"content": "x\\udc00"}]}', "messages[0].content"),
        (b'{"cache_salt": "\\ud83d"}', "cache_salt"),  # a high half without its low half
        (b'{"\\ud800": 1}', "an object key"),
        (b'["\\ud800"]', "body[0]"),
    ],
)
def test_lone_surrogates_are_refused_with_their_place(raw: bytes, where: str) -> None:
    message = _refused(raw)
    assert "lone surrogate" in message and where in message


def test_surrogate_pairs_are_text() -> None:
    assert load_json_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "😀"}


def test_not_utf8_or_not_json() -> None:
    assert "UTF-8" in _refused(b'{"prompt": "\xed\xa0\x80"}')  # a surrogate encoded as bytes
    assert "UTF-8" in _refused(b'{"prompt": "\xff"}')
    assert "not valid JSON" in _refused(b'{"model": ')
    assert "not valid JSON" in _refused(b'{"n": ' + b"9" * 5000 + b"}")  # int digit limit
