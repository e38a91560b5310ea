"""Chat templates' ``tojson`` filter, with the strings of values seen lately kept.

Agents send the same tool definitions at every turn, and chats their whole history, so
a template serializes the same values again and again: on agent turns with 30 tools it
was the gateway's largest cost (a quarter of its CPU; ``benchmarks/gateway_workers.py``).
Each request's values are new objects (its body is parsed anew), so they are recognised
by content: by their ``marshal`` bytes, which C writes several times faster than
``json.dumps`` and which tell apart what ``==`` would not and JSON would (``True`` from
``1``, ``1`` from ``1.0``, one key order from another). Format version 2: it writes
neither back-references nor whether a string is interned, so equal content gives equal
bytes whatever the objects' identities (the later versions' bytes depend on those).
Equal bytes are the same value, hence the same string: the result is ``json.dumps``'s
exactly. A value ``marshal`` cannot write (a subclass, a template's own object) is
serialized every time.

Bounded by entries and bytes, oldest out first; thread-safe (templates are also
rendered in worker threads).
"""

from __future__ import annotations

import json
import marshal
import threading
from collections import OrderedDict
from typing import Any

MAX_BYTES = 32 << 20  # keys' bytes and strings' characters held
MAX_ENTRIES = 65_536
MAX_VALUE_BYTES = 256 << 10  # a larger value is serialized every time, not kept
MARSHAL_VERSION = 2

_memo: OrderedDict[tuple[bytes, bool, int | str | None, Any, bool], str] = OrderedDict()
_held = 0
_lock = threading.Lock()


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``json.dumps`` with these options (transformers' ``tojson``: Jinja's own escapes
    HTML characters, and chat templates expect plain JSON)."""
    try:
        data = marshal.dumps(value, MARSHAL_VERSION)
    except ValueError:  # not plain data: nothing to recognise it by
        data = None
    if data is None or len(data) > MAX_VALUE_BYTES:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip
    key = (data, ensure_ascii, indent, None if separators is None else tuple(separators), sort_keys)
    with _lock:
        text = _memo.get(key)
        if text is not None:
            _memo.move_to_end(key)
            return text
    text = json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
        sort_keys=sort_keys,
    )  # fmt: skip
    _keep(key, text)
    return text


def _keep(key: tuple[bytes, bool, int | str | None, Any, bool], text: str) -> None:
    global _held
    size = len(key[0]) + len(text)
    with _lock:
        if key in _memo:
            return
        _memo[key] = text
        _held += size
        while _held > MAX_BYTES or len(_memo) > MAX_ENTRIES:
            (data, *_), old = _memo.popitem(last=False)
            _held -= len(data) + len(old)


def clear() -> None:
    """Forget every string (tests)."""
    global _held
    with _lock:
        _memo.clear()
        _held = 0
