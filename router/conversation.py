"""Which conversation a request belongs to, for ring affinity across gateways."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# SageMaker's sticky-session header: a session's requests, for one cache (gateway/sagemaker.py)
_HEADERS = ("x-conversation-id", "session_id", "x-session-id", "x-amzn-sagemaker-session-id")


def conversation_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """``prompt_cache_key`` body field (OpenAI's), then ``session_id`` (vLLM's: "stable
    across the requests of one conversation or agent session"), then the
    ``X-Conversation-Id``, ``session_id``, ``X-Session-ID`` or
    ``X-Amzn-SageMaker-Session-Id`` header (any case), then the
    ``user`` body field; None when none is a non-empty string."""
    for field in ("prompt_cache_key", "session_id"):
        value = body.get(field)
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
