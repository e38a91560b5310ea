"""Stored responses (``store: true``): the conversation each one ended, for
``previous_response_id``, and its body, for ``GET /v1/responses/{id}``.

Bounded in memory: at most ``max_entries``, least recently used dropped first, and each
dropped ``ttl_s`` after its last use. A dropped id answers 404 like an unknown one.
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


@dataclass(slots=True)
class ResponseStore:
    max_entries: int = 4096
    ttl_s: float = 3600.0
    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def put(self, response_id: str, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        self.entries[response_id] = StoredResponse(messages, body, time.monotonic())
        self.entries.move_to_end(response_id)
        self._expire()

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self.entries.get(response_id)
        if entry is not None:
            entry.used = time.monotonic()
            self.entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self.entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)
        cutoff = time.monotonic() - self.ttl_s
        while self.entries:
            oldest = next(iter(self.entries.values()))
            if oldest.used >= cutoff:
                break
            self.entries.popitem(last=False)

    def check_invariants(self) -> None:
        assert len(self.entries) <= self.max_entries
        used = [e.used for e in self.entries.values()]
        assert used == sorted(used), "LRU order follows last use"
