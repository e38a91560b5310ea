"""Stored responses (``store: true``, the Responses API's default): the conversation each
one ended, for ``previous_response_id``, and its body, for ``GET /v1/responses/{id}``.

Bounded in memory: at most ``max_entries`` and ``max_bytes``, least recently used dropped
first, and each dropped ``ttl_s`` after its last use. A dropped id answers 404 like an
unknown one. An entry's size is the text of its conversation and body (strings' lengths,
a few bytes per other value): a chain's entries share their history's objects, so this
overcounts them, and a long chain's oldest turns go first, which its next turn does not
need. Counted alone, 4,096 entries of a long-context model's prompts (~500 KB of text)
would hold ~2 GiB.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StoredResponse:
    messages: list[dict[str, Any]]  # the conversation, this response's output included
    body: dict[str, Any]
    used: float  # monotonic seconds
    size: int  # bytes charged against ``max_bytes`` (``text_size``)


@dataclass(slots=True)
class ResponseStore:
    max_entries: int = 4096
    ttl_s: float = 3600.0
    max_bytes: int = 1 << 30
    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    held_bytes: int = 0  # the entries' sizes, summed

    def put(self, response_id: str, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        self.delete(response_id)
        size = text_size(messages) + text_size(body)
        self.entries[response_id] = StoredResponse(messages, body, time.monotonic(), size)
        self.held_bytes += size
        self._expire()

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self.entries.get(response_id)
        if entry is not None:
            entry.used = time.monotonic()
            self.entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.held_bytes -= entry.size
        return True

    def _expire(self) -> None:
        # The newest entry stays whatever its size: its next turn needs it.
        while len(self.entries) > self.max_entries or (
            self.held_bytes > self.max_bytes and len(self.entries) > 1
        ):
            self._drop_oldest()
        cutoff = time.monotonic() - self.ttl_s
        while self.entries:
            oldest = next(iter(self.entries.values()))
            if oldest.used >= cutoff:
                break
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, entry = self.entries.popitem(last=False)
        self.held_bytes -= entry.size

    def check_invariants(self) -> None:
        assert len(self.entries) <= self.max_entries
        assert self.held_bytes == sum(e.size for e in self.entries.values())
        assert self.held_bytes <= self.max_bytes or len(self.entries) <= 1
        used = [e.used for e in self.entries.values()]
        assert used == sorted(used), "LRU order follows last use"


def text_size(value: Any) -> int:
    """Roughly the bytes ``value`` (JSON-like) holds: its strings' lengths, 8 per other
    value. Iterative: a conversation may nest deeply."""
    size, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, dict):
            size += 8 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            size += 8 * len(item)
            stack.extend(item)
        else:
            size += 8
    return size
