"""A request body as JSON, refused with a 400 OpenAI error when it is not fit to use.

``json.loads`` accepts things the rest of a server cannot take: nesting deep enough to
exhaust Python's recursion limit in whatever walks the value next (validation,
re-serialization, a chat template), and ``\\ud800``-style escapes that decode to lone
surrogates, which no UTF-8 encoder (tokenizer, HTTP client, Redis) accepts. Both are
client errors, so both are refused here, at the door, by both servers.

The checks cost nothing on ordinary bodies: the depth is only measured when the body
holds more brackets than the limit, and strings are only checked when it holds a
``\\uD8``-``\\uDF`` escape.
"""

from __future__ import annotations

import json
import re
from typing import Any

from prefixgate.wire import OpenAIError

MAX_JSON_DEPTH = 64
"""Nesting of arrays and objects (a top-level object is depth 1). OpenAI request bodies
need under 20 even with nested tool schemas; Python's recursion limit is 1,000."""

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def load_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> object:
    """The decoded body; OpenAIError (400, ``invalid_json``) when it is not UTF-8 JSON,
    nests deeper than ``max_depth`` or holds a lone surrogate."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = f"The request body is not valid UTF-8 ({exc.reason} at byte {exc.start})."
        raise _invalid(message) from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:
        raise _invalid(f"The request body is not valid JSON: {exc}.") from None
    if text.count("[") + text.count("{") > max_depth and _depth(value) > max_depth:
        raise _too_deep(max_depth)
    if _SURROGATE_ESCAPE.search(text) and (where := _lone_surrogate(value)) is not None:
        raise _invalid(
            f"The request body has an invalid Unicode escape at {where}: a lone surrogate "
            "(\\ud800-\\udfff not in a high-low pair). Send text as UTF-8 or as valid pairs."
        )
    return value


def _depth(value: object) -> int:
    """The nesting depth of a decoded JSON value, level by level (no recursion, and no
    per-node tuples: bodies with dozens of tool schemas hold thousands of nodes)."""
    depth = 0
    level: list[object] = [value]
    while level:
        children: list[object] = []
        for item in level:
            if isinstance(item, dict):
                children.extend(item.values())
            elif isinstance(item, list):
                children.extend(item)
            else:
                continue
            children.append(None)  # marks this level as holding a container
        if not children:
            break
        depth += 1
        level = children
    return depth


def _lone_surrogate(value: object) -> str | None:
    """Where (a JSON path such as ``messages[0].content``) a string, or an object key,
    holds a lone surrogate; None when none does."""
    stack: list[tuple[object, str]] = [(value, "body")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if not _encodable(key):
                    return f"{path} (an object key)"
                stack.append((child, f"{path}.{key}" if path != "body" else key))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _invalid(message: str) -> OpenAIError:
    return OpenAIError(message, code="invalid_json")


def _too_deep(max_depth: int) -> OpenAIError:
    return _invalid(f"The request body nests arrays and objects deeper than {max_depth} levels.")


def load_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """``load_json_body`` for a body that must be a JSON object (every OpenAI request)."""
    value = load_json_body(raw, max_depth)
    if not isinstance(value, dict):
        raise _invalid("The request body must be a JSON object.")
    return value
