"""Faults injected where a test cannot reach them otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from router.replica_redis import ReplicaRedis


def fail_writes_once(monkeypatch: pytest.MonkeyPatch, error: Exception) -> list[Exception]:
    """The next ``ReplicaRedis.write_events`` raises ``error`` (not a Redis error: a bug
    on the writer's side); the ones after write as usual. Returns the pending failures:
    empty once it has fired."""
    write_events = ReplicaRedis.write_events
    failures = [error]

    async def failing_once(self: ReplicaRedis, *args: Any, **kwargs: Any) -> None:
        if failures:
            raise failures.pop()
        await write_events(self, *args, **kwargs)

    monkeypatch.setattr(ReplicaRedis, "write_events", failing_once)
    return failures
