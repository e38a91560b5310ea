"""Response id -> the replica that stored it, for the Responses API's stateful turns.

Shared through Redis (a key per id with a TTL, so every gateway agrees) and kept in a
bounded local table (the only record when there is no Redis, and the first place looked).
Redis failures degrade to the local table with a warning; they never fail a request.

Each record also carries the conversation key of the chain the response belongs to
(gateway/responses.py, ``conversation``), so a follow-up through any gateway continues
the same conversation. In Redis a record is one JSON object
(``{"replica_id", "conversation", "tenant"}``): a conversation key is the client's own string
and may hold any character.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

log = logging.getLogger("prefixgate.gateway")

AFFINITY_TTL_S = 3600.0  # the built-in replica's store keeps a response this long unused
REDIS_PREFIX = "prefixgate:response:"


class Owner(NamedTuple):
    replica_id: str
    conversation: str  # the chain's conversation key, tenant-scoped (never empty)
    tenant: str  # who made it: another tenant's id is answered as unknown


@dataclass(slots=True)
class ResponseAffinity:
    """Response id -> the replica that stored it: Redis (shared, TTL) and a local LRU."""

    redis_url: str | None
    ttl_s: float = AFFINITY_TTL_S
    max_local: int = 100_000
    local: OrderedDict[str, tuple[Owner, float]] = field(default_factory=OrderedDict)
    client: Any = None  # redis.asyncio.Redis, made on first use

    def _redis(self) -> Any:
        if self.redis_url is not None and self.client is None:
            import redis.asyncio as aioredis

            self.client = aioredis.from_url(self.redis_url, socket_timeout=2.0)
        return self.client

    async def record(self, response_id: str, owner: Owner) -> None:
        self.local[response_id] = (owner, time.monotonic() + self.ttl_s)
        self.local.move_to_end(response_id)
        while len(self.local) > self.max_local:
            self.local.popitem(last=False)
        client = self._redis()
        if client is None:
            return
        try:
            await client.set(REDIS_PREFIX + response_id, encode(owner), ex=int(self.ttl_s))
        except Exception as exc:  # Redis down: this gateway still knows; others will 404
            log.warning("response affinity for %s not shared (Redis: %s)", response_id, exc)

    async def lookup(self, response_id: str) -> Owner | None:
        entry = self.local.get(response_id)
        if entry is not None and entry[1] > time.monotonic():
            return entry[0]
        client = self._redis()
        if client is None:
            return None
        try:
            raw = await client.get(REDIS_PREFIX + response_id)
        except Exception as exc:
            log.warning("response affinity lookup for %s failed (Redis: %s)", response_id, exc)
            return None
        if raw is None:
            return None
        owner = decode(raw)
        if owner is None:
            log.warning("response affinity for %s unreadable in Redis: %r", response_id, raw[:200])
        return owner

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    async def forget(self, response_id: str) -> None:
        self.local.pop(response_id, None)
        client = self._redis()
        if client is not None:
            try:
                await client.delete(REDIS_PREFIX + response_id)
            except Exception as exc:
                log.warning("response affinity for %s not removed (Redis: %s)", response_id, exc)


def encode(owner: Owner) -> str:
    return json.dumps(owner._asdict(), separators=(",", ":"))


def decode(raw: bytes) -> Owner | None:
    """A record as ``encode`` writes it; None for anything else (no field may be absent,
    empty or not a string: an owner that cannot be checked is no owner)."""
    try:
        fields = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    values = [fields.get(name) for name in Owner._fields]
    strings = [v for v in values if isinstance(v, str) and v]
    return Owner(*strings) if len(strings) == len(values) else None
