"""Which conversation a request belongs to, for ring affinity across gateways."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_HEADERS = ("x-conversation-id", "session_id")


def conversation_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """``prompt_cache_key`` body field, then the ``X-Conversation-Id`` or ``session_id``
    header (any case), then the ``user`` body field; None when none is a non-empty string.
    """
    value = body.get("prompt_cache_key")
    if isinstance(value, str) and value:
        return value
    lowered = {name.lower(): v for name, v in headers.items()}
    for name in _HEADERS:
        header = lowered.get(name)
        if header:
            return header
    user = body.get("user")
    if isinstance(user, str) and user:
        return user
    return None
