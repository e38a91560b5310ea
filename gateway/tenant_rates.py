"""A tenant's ``rpm_limit`` and ``tpm_limit`` (gateway/auth.py; LiteLLM's names): its
requests and tokens per minute, over the gateways that share a Redis.

Each limit is a bucket of one minute's worth, refilled at the limit per minute
(``limit / 60`` a second, never past the limit). A request is admitted while the request
bucket holds one request and the token bucket one token; admitting takes one request.
Its tokens are not known until its answer, so they are charged then (``charge``): the
input and output tokens of the answer's ``usage`` (gateway/usage.py), or, for a stream
that reports none, the gateway's count of the prompt and one token per streamed output
event (vLLM and SGLang stream one token an event by default; vLLM sometimes merges two).
The token bucket may go below zero, down to one minute's worth, so that a long answer
holds its tenant back until its tokens are paid for, and one huge request at most a
minute. A tenant may so burst one minute's worth, and then goes at the limit's rate, as
OpenAI's own limits do. A refused request is a 429 that says which limit and when a retry
will pass (``Retry-After``, and ``retry-after-ms``, which the OpenAI client waits before
its own retries); every answer to a limited tenant carries OpenAI's
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers.

With Redis the two buckets are one hash per tenant, ``prefixgate:tenant_rate:TENANT``
(``r`` requests, ``k`` tokens, ``t`` when last refilled), changed only by ``SCRIPT`` on
Redis's own clock: gateways share the buckets and need not agree on the time. Without
Redis, or while it fails (logged once an outage; retried after a backoff), each gateway
keeps its own buckets: behind G gateways a tenant then gets G times its limits.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.replica_redis import BackedOffRedis, Outage

log = logging.getLogger("prefixgate.gateway")

REDIS_PREFIX = "prefixgate:tenant_rate:"
KEY_TTL_S = 120  # a bucket untouched for this long is full again: Redis may drop it
MINUTE_S = 60.0

# KEYS[1] the tenant's hash; ARGV rpm, tpm (0: none), charge (tokens; 0: admit a request),
# the hash's time to live. Returns 1 when admitted (0 refused; 1 for a charge), and the
# two buckets' levels in thousandths, after the request or charge (Redis turns a Lua
# number into an integer). The rule is ``admissible``'s, in Python, for the buckets kept
# here: the two must agree.
SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm, charge = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], 'r', 'k', 't')
local dt = math.max(0, now - (tonumber(v[3]) or now))
local r, k = 0, 0
if rpm > 0 then r = math.min(rpm, (tonumber(v[1]) or rpm) + dt * rpm / 60) end
if tpm > 0 then k = math.min(tpm, (tonumber(v[2]) or tpm) + dt * tpm / 60) end
local ok = 1
if charge > 0 then
  if tpm > 0 then k = math.max(-tpm, k - charge) end
elseif (rpm > 0 and r < 1) or (tpm > 0 and k < 1) then
  ok = 0
elseif rpm > 0 then
  r = r - 1
end
-- A bucket without its limit is not kept: given one later (the keys file), it starts full.
local function keep(field, limit, level)
  if limit > 0 then redis.call('HSET', KEYS[1], field, tostring(level))
  else redis.call('HDEL', KEYS[1], field) end
end
keep('r', rpm, r)
keep('k', tpm, k)
redis.call('HSET', KEYS[1], 't', tostring(now))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
return {ok, math.floor(r * 1000), math.floor(k * 1000)}
"""


@dataclass(slots=True, frozen=True)
class Limits:
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute


@dataclass(slots=True, frozen=True)
class Verdict:
    """What one admission found: whether the request passes, and the headers its answer
    carries (OpenAI's ``x-ratelimit-*``; on a refusal also ``retry-after``)."""

    admitted: bool
    refused_by: str = ""  # when refused, the limit a retry waits for: "requests", "tokens"
    wait_s: float = 0.0  # until a request would be admitted
    headers: tuple[tuple[bytes, bytes], ...] = ()


@dataclass(slots=True)
class Bucket:
    """A tenant's two buckets at this gateway (no Redis, or Redis failing); a level is
    infinite while its limit is not set."""

    requests: float
    tokens: float
    at: float


@dataclass(slots=True)
class TenantRates(BackedOffRedis):
    limits: dict[str, Limits] = field(default_factory=dict)  # for the limited tenants only
    local: dict[str, Bucket] = field(default_factory=dict)  # this gateway's own buckets
    script: Any = None  # SCRIPT, registered with the client
    charges: set[asyncio.Task[None]] = field(default_factory=set)  # charges in flight
    monotonic: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.outage = Outage(
            log,
            self.redis_url or "",
            down_note="tenant rate limits are kept by each gateway alone",
            up_note="; tenant rate limits are kept in Redis again",
        )

    def counts_tokens(self, tenant: str) -> bool:
        limits = self.limits.get(tenant)
        return limits is not None and limits.tpm is not None

    async def admit(self, tenant: str) -> Verdict:
        """One request of ``tenant`` (one with limits) against its buckets."""
        limits = self.limits[tenant]
        client = self._redis()
        if client is not None:
            try:
                reply = await self.script(
                    keys=[REDIS_PREFIX + tenant],
                    args=[limits.rpm or 0, limits.tpm or 0, 0, KEY_TTL_S],
                    client=client,
                )
            except Exception as exc:  # Redis failing: this gateway's own buckets
                self._failed(exc)
            else:
                self._answered()
                ok, requests, tokens = (int(x) for x in reply)
                return verdict(limits, bool(ok), requests / 1e3, tokens / 1e3)
        return self._admit_here(tenant, limits)

    def charge(self, tenant: str, tokens: int) -> None:
        """``tokens`` used by an admitted request of ``tenant`` (not waited for)."""
        limits = self.limits.get(tenant)
        if limits is None or limits.tpm is None or tokens <= 0:
            return
        client = self._redis()
        if client is None:
            bucket = self._refilled(tenant, limits)
            bucket.tokens = max(-limits.tpm, bucket.tokens - tokens)
            return
        task = asyncio.get_running_loop().create_task(self._charge(client, tenant, limits, tokens))
        self.charges.add(task)
        task.add_done_callback(self.charges.discard)

    async def _charge(self, client: Any, tenant: str, limits: Limits, tokens: int) -> None:
        try:
            await self.script(
                keys=[REDIS_PREFIX + tenant],
                args=[limits.rpm or 0, limits.tpm, tokens, KEY_TTL_S],
                client=client,
            )
        except Exception as exc:  # the tokens go uncharged: the tenant gets them free
            self._failed(exc)
            bucket = self._refilled(tenant, limits)
            bucket.tokens = max(-(limits.tpm or 0), bucket.tokens - tokens)
        else:
            self._answered()

    def _admit_here(self, tenant: str, limits: Limits) -> Verdict:
        bucket = self._refilled(tenant, limits)
        ok = admissible(limits, bucket.requests, bucket.tokens)
        if ok and limits.rpm:
            bucket.requests -= 1
        return verdict(limits, ok, bucket.requests, bucket.tokens)

    def _refilled(self, tenant: str, limits: Limits) -> Bucket:
        now = self.monotonic()
        bucket = self.local.get(tenant)
        if bucket is None:
            bucket = self.local[tenant] = Bucket(math.inf, math.inf, now)
        elapsed = max(0.0, now - bucket.at)
        bucket.requests = _refill(limits.rpm, bucket.requests, elapsed)
        bucket.tokens = _refill(limits.tpm, bucket.tokens, elapsed)
        bucket.at = now
        return bucket

    def _made(self, client: Any) -> None:
        self.script = client.register_script(SCRIPT)

    async def aclose(self) -> None:
        await asyncio.gather(*self.charges, return_exceptions=True)
        await self._close_client()


def _refill(limit: int | None, level: float, elapsed_s: float) -> float:
    """A bucket's level ``elapsed_s`` later; without its limit it is full (infinite), so
    that a limit given later (the keys file) starts full, as in SCRIPT."""
    if limit is None:
        return math.inf
    return min(limit, level + elapsed_s * limit / MINUTE_S)


def admissible(limits: Limits, requests: float, tokens: float) -> bool:
    """A request passes while each limited bucket holds one (SCRIPT's rule too)."""
    return not ((limits.rpm and requests < 1) or (limits.tpm and tokens < 1))


def verdict(limits: Limits, admitted: bool, requests: float, tokens: float) -> Verdict:
    """The answer's verdict and headers from the buckets' levels after the request: what
    is left, when each bucket is full again and, refused, when a retry passes (the
    bucket a retry waits longer for names the limit)."""
    headers: list[tuple[bytes, bytes]] = []
    waits: list[tuple[float, str]] = []
    for limit, level, kind in ((limits.rpm, requests, "requests"), (limits.tpm, tokens, "tokens")):
        if limit is None:
            continue
        per_s = limit / MINUTE_S
        headers += [
            (f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()),
            (f"x-ratelimit-remaining-{kind}".encode(), str(max(0, math.floor(level))).encode()),
            (f"x-ratelimit-reset-{kind}".encode(), duration((limit - level) / per_s).encode()),
        ]
        if level < 1:
            waits.append(((1 - level) / per_s, kind))
    if admitted:
        return Verdict(True, headers=tuple(headers))
    wait_s, refused_by = max(waits)
    headers += [
        (b"retry-after", str(max(1, math.ceil(wait_s))).encode()),
        (b"retry-after-ms", str(max(1, math.ceil(wait_s * 1e3))).encode()),
    ]
    return Verdict(False, refused_by, wait_s, tuple(headers))


def duration(seconds: float) -> str:
    """OpenAI's form of a reset time: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1e3))}ms"
    if seconds < MINUTE_S:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"
