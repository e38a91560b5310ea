from __future__ import annotations

from router.conversation import conversation_key


def test_precedence_body_key_then_headers_then_user() -> None:
    body = {"prompt_cache_key": "pck", "user": "u"}
    headers = {"X-Conversation-Id": "hdr"}
    assert conversation_key(body, headers) == "pck"
    assert conversation_key({"user": "u"}, headers) == "hdr"
    assert conversation_key({"user": "u"}, {"SESSION_ID": "sess"}) == "sess"
    assert conversation_key({"user": "u"}, {}) == "u"
    assert conversation_key({}, {}) is None
    assert conversation_key({"prompt_cache_key": "", "user": 3}, {"x-conversation-id": ""}) is None
