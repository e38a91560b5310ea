"""A tenant's ``max_parallel_requests`` (gateway/auth.py) across the gateways that share a
Redis.

Each gateway counts the requests it forwards for each capped tenant, and admits one while
its own count plus the other gateways' stays under the cap (a 429 past it:
gateway/handler.py ``forward_watched``). Without Redis the other gateways' count is 0,
and behind G gateways a tenant could have G × N in flight; a Kubernetes deployment scales
its gateways with load, so the cap moved with their number.

With Redis, every ``SYNC_S`` each gateway writes its counts (``HSET
prefixgate:tenant_in_flight:TENANT GATEWAY "COUNT TIME"``) and reads the others', in one
pipelined round trip: no request waits on Redis. A count not rewritten for ``STALE_S``
is a gateway gone (killed, partitioned) and is dropped, so a crash cannot hold a tenant's
slots. Between syncs the gateways decide on what they last read: the sum may pass the cap
by what arrived at the others within one ``SYNC_S``. While Redis fails, each gateway
counts its own (logged once per outage) and is retried after a backoff. The gateways'
clocks must agree within ``STALE_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.backoff import Backoff
from router.replica_redis import Outage

log = logging.getLogger("prefixgate.gateway")

REDIS_PREFIX = "prefixgate:tenant_in_flight:"
SYNC_S = 0.5
STALE_S = 10.0


@dataclass(slots=True)
class TenantCaps:
    caps: dict[str, int]  # tenant -> its max_parallel_requests
    redis_url: str | None = None
    gateway_id: str = ""
    local: dict[str, int] = field(default_factory=dict)  # this gateway's, in flight now
    others: dict[str, int] = field(default_factory=dict)  # the other gateways', last read
    client: Any = None  # redis.asyncio.Redis, made on first use
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    down_until: float = 0.0
    backoff: Backoff = field(default_factory=lambda: Backoff(1.0, 30.0))
    outage: Outage = field(init=False)

    def __post_init__(self) -> None:
        self.outage = Outage(
            log,
            self.redis_url or "",
            down_note="tenant caps count this gateway's requests only",
            up_note="; tenant caps count every gateway's requests again",
        )

    def acquire(self, tenant: str) -> int | None:
        """Count a request of ``tenant`` in; its cap when that would pass it (not
        counted), None when admitted (or the tenant has no cap)."""
        cap = self.caps.get(tenant)
        if cap is None:
            return None
        held = self.local.get(tenant, 0)
        if held + self.others.get(tenant, 0) >= cap:
            return cap
        self.local[tenant] = held + 1
        return None

    def release(self, tenant: str) -> None:
        """A request ``acquire`` admitted has finished (answered, failed or abandoned)."""
        held = self.local.get(tenant, 0)
        if held <= 1:
            self.local.pop(tenant, None)
        else:
            self.local[tenant] = held - 1

    def stats(self) -> dict[str, dict[str, int]]:
        """Each capped tenant's cap and requests in flight, here and (as last read) at
        the other gateways."""
        return {
            tenant: {
                "cap": cap,
                "here": self.local.get(tenant, 0),
                "others": self.others.get(tenant, 0),
            }
            for tenant, cap in self.caps.items()
        }

    async def run(self) -> None:
        """Sync with the other gateways every ``SYNC_S`` (a task; cancelled at shutdown)."""
        while True:
            await self.sync_once()
            await asyncio.sleep(SYNC_S)  # the sync period

    async def sync_once(self) -> None:
        if self.redis_url is None or not self.caps or self.clock() < self.down_until:
            return
        if self.client is None:
            import redis.asyncio as aioredis

            self.client = aioredis.from_url(self.redis_url, socket_timeout=2.0)
        now = self.wall()
        tenants = list(self.caps)
        try:
            pipe = self.client.pipeline(transaction=False)
            for tenant in tenants:
                key = REDIS_PREFIX + tenant
                pipe.hset(key, self.gateway_id, f"{self.local.get(tenant, 0)} {now:.3f}")
                pipe.expire(key, int(STALE_S * 6))
                pipe.hgetall(key)
            replies = await pipe.execute()
        except Exception as exc:  # Redis down: each gateway counts its own
            self.others.clear()
            self.outage.mark_down(exc)
            self.down_until = self.clock() + self.backoff.next_delay()
            return
        self.outage.mark_up()
        self.backoff.reset()
        stale: list[tuple[str, bytes]] = []
        for tenant, fields in zip(tenants, replies[2::3], strict=True):
            total = 0
            for gateway, value in fields.items():
                count, at = _parsed(value)
                if at < now - STALE_S:
                    stale.append((REDIS_PREFIX + tenant, gateway))
                elif gateway != self.gateway_id.encode():
                    total += count
            self.others[tenant] = total
        if stale:
            try:
                pipe = self.client.pipeline(transaction=False)
                for key, gateway in stale:
                    pipe.hdel(key, gateway)
                await pipe.execute()
            except Exception:  # dropped again at the next sync
                pass

    async def aclose(self) -> None:
        """Take this gateway's counts out of Redis (the others need not wait ``STALE_S``)
        and close the client."""
        if self.client is None:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for tenant in self.caps:
                pipe.hdel(REDIS_PREFIX + tenant, self.gateway_id)
            await pipe.execute()
        except Exception:  # they go stale instead
            pass
        await self.client.aclose()
        self.client = None


def _parsed(value: bytes) -> tuple[int, float]:
    """A gateway's "COUNT TIME"; (0, 0.0), stale at once, when it is not that."""
    try:
        count, at = value.split()
        return max(0, int(count)), float(at)
    except ValueError:
        return 0, 0.0
