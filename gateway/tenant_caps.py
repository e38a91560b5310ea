"""A tenant's ``max_parallel_requests`` (gateway/auth.py) across the gateways that share a
Redis.

Each gateway counts the requests it forwards for each capped tenant (``local``), and a
request past the cap is a 429 (gateway/handler.py ``forward_watched``). Without Redis
that is all: behind G gateways a tenant could have G × N in flight, and a Kubernetes
deployment scales its gateways with load, so the cap moved with their number.

With Redis the count is one hash per tenant, ``prefixgate:tenant_in_flight:TENANT``: each
gateway's count (field ``GATEWAY``) and when it last wrote it (``GATEWAY:t``). A request
is admitted by a script that sums the fresh counts and adds one to this gateway's only if
the sum is under the cap, in one round trip: gateways deciding at the same moment cannot
both take the last slot (counting on a periodic exchange alone let two gateways
together hold twice the cap at moments, measured). A finished request gives its slot back
at once (a decrement, not waited for). Every ``SYNC_S`` each gateway rewrites its count
from ``local`` (undoing any drift from a Redis hiccup) with the time, and reads the
others' for ``/router/stats``. A count not rewritten for ``STALE_S`` is a gateway gone
(killed, partitioned): it no longer counts, so a crash cannot hold a tenant's slots.
While Redis fails, each gateway decides on its own count plus the others' as last read
(logged once per outage; retried after a backoff). The gateways' clocks must agree
within ``STALE_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.replica_redis import BackedOffRedis, Outage

log = logging.getLogger("prefixgate.gateway")

REDIS_PREFIX = "prefixgate:tenant_in_flight:"
SYNC_S = 0.5
STALE_S = 10.0
KEY_TTL_S = 60  # a tenant's hash outlives its last writer by this much

# KEYS[1] the tenant's hash; ARGV gateway, cap, now, stale_s. 1: admitted, 0: full.
ACQUIRE = """
local f = redis.call('HGETALL', KEYS[1])
local now, stale = tonumber(ARGV[3]), tonumber(ARGV[4])
local at = {}
for i = 1, #f, 2 do
  if string.sub(f[i], -2) == ':t' then at[string.sub(f[i], 1, -3)] = tonumber(f[i + 1]) end
end
local total = 0
for i = 1, #f, 2 do
  local name = f[i]
  if string.sub(name, -2) ~= ':t' and (name == ARGV[1] or (at[name] or 0) >= now - stale) then
    total = total + math.max(0, tonumber(f[i + 1]) or 0)
  end
end
if total >= tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('HSET', KEYS[1], ARGV[1] .. ':t', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
return 1
"""


@dataclass(slots=True)
class TenantCaps(BackedOffRedis):
    caps: dict[str, int] = field(default_factory=dict)  # tenant -> max_parallel_requests
    gateway_id: str = ""
    local: dict[str, int] = field(default_factory=dict)  # this gateway's, in flight now
    others: dict[str, int] = field(default_factory=dict)  # the other gateways', last read
    script: Any = None  # ACQUIRE, registered with the client
    wall: Callable[[], float] = time.time
    releases: set[asyncio.Task[None]] = field(default_factory=set)  # decrements in flight

    def __post_init__(self) -> None:
        self.outage = Outage(
            log,
            self.redis_url or "",
            down_note="tenant caps count this gateway's requests and the others' as last read",
            up_note="; tenant caps are counted in Redis again",
        )

    async def acquire(self, tenant: str) -> int | None:
        """Count a request of ``tenant`` in; its cap when that would pass it (not
        counted), None when admitted (or the tenant has no cap)."""
        cap = self.caps.get(tenant)
        if cap is None:
            return None
        held = self.local.get(tenant, 0)
        self.local[tenant] = held + 1  # before the round trip: a sync meanwhile counts it
        client = self._redis()
        if client is not None:
            try:
                admitted = await self.script(
                    keys=[REDIS_PREFIX + tenant],
                    args=[self.gateway_id, cap, f"{self.wall():.3f}", STALE_S, KEY_TTL_S],
                    client=client,
                )
            except Exception as exc:  # Redis failing: decided here, as without it
                self._failed(exc)
            else:
                self._answered()
                if admitted:
                    return None
                self.release(tenant, upstream=False)
                return cap
        if held + self.others.get(tenant, 0) >= cap:
            self.release(tenant, upstream=False)
            return cap
        return None

    def release(self, tenant: str, upstream: bool = True) -> None:
        """A request ``acquire`` admitted has finished (answered, failed or abandoned):
        its slot back here, and (``upstream``) in Redis, not waited for."""
        held = self.local.get(tenant)
        if held is None:
            return  # no cap: never counted
        if held <= 1:
            del self.local[tenant]
        else:
            self.local[tenant] = held - 1
        client = self._redis() if upstream else None
        if client is not None:
            task = asyncio.get_running_loop().create_task(self._decrement(client, tenant))
            self.releases.add(task)
            task.add_done_callback(self.releases.discard)

    async def _decrement(self, client: Any, tenant: str) -> None:
        try:
            await client.hincrby(REDIS_PREFIX + tenant, self.gateway_id, -1)
        except Exception as exc:  # the next sync rewrites this gateway's count
            self._failed(exc)

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
        """Rewrite this gateway's counts, read the others', drop the stale ones."""
        client = self._redis()
        if client is None or not self.caps:
            return
        now = self.wall()
        tenants = list(self.caps)
        try:
            pipe = client.pipeline(transaction=False)
            for tenant in tenants:
                key = REDIS_PREFIX + tenant
                mine = {
                    self.gateway_id: self.local.get(tenant, 0),
                    f"{self.gateway_id}:t": f"{now:.3f}",
                }
                pipe.hset(key, mapping=mine)
                pipe.expire(key, KEY_TTL_S)
                pipe.hgetall(key)
            replies = await pipe.execute()
            stale: list[tuple[str, str]] = []
            for tenant, fields in zip(tenants, replies[2::3], strict=True):
                counts, at = _counts(fields)
                self.others[tenant] = sum(
                    n
                    for gateway, n in counts.items()
                    if gateway != self.gateway_id and at.get(gateway, 0.0) >= now - STALE_S
                )
                stale += [
                    (REDIS_PREFIX + tenant, gateway)
                    for gateway in counts
                    if gateway != self.gateway_id and at.get(gateway, 0.0) < now - STALE_S
                ]
            if stale:
                pipe = client.pipeline(transaction=False)
                for key, gateway in stale:
                    pipe.hdel(key, gateway, f"{gateway}:t")
                await pipe.execute()
        except Exception as exc:  # Redis down: decided on the others' count as last read
            self._failed(exc)
            return
        self._answered()

    def _made(self, client: Any) -> None:
        self.script = client.register_script(ACQUIRE)

    async def aclose(self) -> None:
        """Take this gateway's counts out of Redis (the others need not wait ``STALE_S``)
        and close the client."""
        if self.client is None:
            return
        await asyncio.gather(*self.releases, return_exceptions=True)
        try:
            pipe = self.client.pipeline(transaction=False)
            for tenant in self.caps:
                pipe.hdel(REDIS_PREFIX + tenant, self.gateway_id, f"{self.gateway_id}:t")
            await pipe.execute()
        except Exception:  # they go stale instead
            pass
        await self._close_client()


def _counts(fields: dict[bytes, bytes]) -> tuple[dict[str, int], dict[str, float]]:
    """A tenant's hash: each gateway's count and the time it wrote it (unreadable values
    count 0, written never: stale at once)."""
    counts: dict[str, int] = {}
    at: dict[str, float] = {}
    for raw_name, raw_value in fields.items():
        name = raw_name.decode("utf-8", "replace")
        try:
            if name.endswith(":t"):
                at[name[:-2]] = float(raw_value)
            else:
                counts[name] = max(0, int(raw_value))
        except ValueError:
            continue
    return counts, at
