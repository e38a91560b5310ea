"""Response id -> the replica that stored it, for the Responses API's stateful turns.

Shared through Redis (a key per id with a TTL, so every gateway agrees) and kept in a
bounded local table (the only record when there is no Redis, and the first place looked).
Redis failures degrade to the local table; they never fail a request that the local
table can answer. A lookup that only Redis could answer while Redis fails raises
``AffinityUnavailable`` (a 503 with Retry-After: the client's retry finds the record
once Redis is back), not a 404 that would end the client's conversation.

After a failure Redis is left alone for a backoff (``router.backoff.Backoff``: up to 1 s,
doubling to 30 s, with jitter; reset by a success), and the outage is logged once
(``Outage``): a hung Redis (a failover, a network partition) made every stored response
wait out the 2 s socket timeout, and logged a warning each.

Each record also carries the conversation key of the chain the response belongs to
(gateway/responses.py, ``conversation``), so a follow-up through any gateway continues
the same conversation. In Redis a record is one JSON object
(``{"replica_id", "conversation", "tenant"}``): a conversation key is the client's own string
and may hold any character.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from router.replica_redis import BackedOffRedis, Outage

log = logging.getLogger("prefixgate.gateway")

AFFINITY_TTL_S = 3600.0  # the built-in replica's store keeps a response this long unused
REDIS_PREFIX = "prefixgate:response:"


class AffinityUnavailable(Exception):
    """Only Redis could say who stored a response, and Redis is failing."""


class Owner(NamedTuple):
    replica_id: str
    conversation: str  # the chain's conversation key, tenant-scoped (never empty)
    tenant: str  # who made it: another tenant's id is answered as unknown


@dataclass(slots=True)
class ResponseAffinity(BackedOffRedis):
    """Response id -> the replica that stored it: Redis (shared, TTL) and a local LRU."""

    ttl_s: float = AFFINITY_TTL_S
    max_local: int = 100_000
    local: OrderedDict[str, tuple[Owner, float]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.outage = Outage(
            log,
            self.redis_url or "",
            down_note="response affinity stays in this gateway; a lookup only Redis could"
            " answer is a 503 until it answers",
            up_note="; response affinity is shared again",
        )

    async def record(self, response_id: str, owner: Owner) -> None:
        self.local[response_id] = (owner, self.clock() + self.ttl_s)
        self.local.move_to_end(response_id)
        while len(self.local) > self.max_local:
            self.local.popitem(last=False)
        client = self._redis()
        if client is None:
            return
        try:
            await client.set(REDIS_PREFIX + response_id, encode(owner), ex=int(self.ttl_s))
        except Exception as exc:  # Redis down: this gateway still knows; others cannot
            self._failed(exc)
            return
        self._answered()

    async def lookup(self, response_id: str) -> Owner | None:
        """The owner, or None when nobody recorded ``response_id``; raises
        ``AffinityUnavailable`` when only a failing Redis could tell."""
        entry = self.local.get(response_id)
        if entry is not None and entry[1] > self.clock():
            return entry[0]
        if self.redis_url is None:
            return None
        client = self._redis()
        if client is None:
            raise AffinityUnavailable("it failed moments ago; retried after a backoff")
        try:
            raw = await client.get(REDIS_PREFIX + response_id)
        except Exception as exc:
            self._failed(exc)
            raise AffinityUnavailable(str(exc)) from None
        self._answered()
        if raw is None:
            return None
        owner = decode(raw)
        if owner is None:
            log.warning("response affinity for %s unreadable in Redis: %r", response_id, raw[:200])
        return owner

    async def aclose(self) -> None:
        await self._close_client()

    async def forget(self, response_id: str) -> None:
        self.local.pop(response_id, None)
        client = self._redis()
        if client is not None:
            try:
                await client.delete(REDIS_PREFIX + response_id)
            except Exception as exc:  # its record expires within the TTL
                self._failed(exc)
                return
            self._answered()


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
