"""API keys → tenants → cache salts.

With an API-key file every request must carry ``Authorization: Bearer KEY``. Each key
belongs to a tenant; the tenant's cache salt goes into the forwarded request
(``cache_salt``) and into the routing keys, so one tenant can neither hit nor time another
tenant's cached prefixes. A tenant with ``shared_namespace: true`` uses the empty salt
(the namespace every open-mode request shares). In keyed mode a client-sent
``cache_salt`` is always replaced: letting clients pick salts would let them pick another
tenant's.

The file is JSON or YAML, a mapping from key to tenant settings::

    sk-team-a: {tenant: team-a}
    sk-team-b: {tenant: team-b, cache_salt: b-2024}
    sk-docs:   {tenant: docs, shared_namespace: true}
    sk-ops:    {tenant: ops, admin: true}
    sk-batch:  {tenant: batch, priority: 10, max_parallel_requests: 8}
    sk-trial:  {tenant: trial, rpm_limit: 60, tpm_limit: 20000}

``admin: true`` lets a key call the gateway's operations that affect every tenant or show
every tenant's traffic (``POST /reset_prefix_cache``, ``GET /router/stats``); in open
mode anyone may. Conversation ids are scoped per tenant (``scoped_conversation``).

``priority: N`` is the engine's scheduling priority for every request of the key's
tenant, in place of the client's (vLLM's ``--scheduling-policy priority``: lower runs
first). Without it a tenant's ``priority`` field and ``X-Vllm-Priority`` header pass as
sent, and any tenant may put its requests ahead of every other's. It goes into the
``X-Vllm-Priority`` header on everything forwarded (vLLM reads that before the body's)
and into the body's ``priority`` on the endpoints that schedule by it
(``with_tenant_fields``, gateway/handler.py).

``max_parallel_requests: N`` (LiteLLM's name) caps the tenant's requests in flight at once,
a 429 past it (gateway/handler.py ``forward_watched``), so that one tenant's flood cannot
fill every replica's queue ahead of the others; counted over the gateways that share a
Redis (gateway/tenant_caps.py), else at each gateway. Every key of a tenant gives the
same cap.

``models: [NAME, ...]`` (LiteLLM's name) lists the models, served names, aliases and
LoRA adapters alike, that the tenant may call; any other is answered as a model that does
not exist (404 ``model_not_found``: a tenant cannot tell another's adapter is loaded),
and ``/v1/models`` lists only those. Without it, or empty, every model. One list per
tenant.

``rpm_limit: N`` and ``tpm_limit: N`` (LiteLLM's names) limit the tenant's requests and
tokens per minute, over the gateways that share a Redis, else at each gateway; a 429 that
says when to retry past them (gateway/tenant_rates.py). One value per tenant too.

``expires: 2027-01-31T00:00:00Z`` (a key's own, LiteLLM's name) ends the key then: a 401
``This API key has expired`` from that moment (UTC without a zone; a date alone is its
midnight).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path

import yaml

from gateway.tenant_rates import Limits
from prefixgate.wire import OpenAIError


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    cache_salt: str
    shared_namespace: bool = False
    admin: bool = False  # may call operations that affect every tenant
    priority: int | None = None  # forced on the tenant's requests; None: the client's
    max_parallel_requests: int | None = None  # in flight at once; None: no cap
    rpm_limit: int | None = None  # requests per minute; None: no limit
    tpm_limit: int | None = None  # tokens per minute; None: no limit
    models: frozenset[str] | None = None  # the models it may call; None: every one
    expires: float | None = None  # this key's end, seconds since the epoch; None: never

    @property
    def salt(self) -> str:
        """The salt used for this tenant's keys and forwarded requests."""
        return "" if self.shared_namespace else self.cache_salt


def derived_salt(tenant: str) -> str:
    """A stable salt from the tenant's name, equal on every gateway that reads the file."""
    return hashlib.sha256(b"prefixgate-tenant\x00" + tenant.encode()).hexdigest()[:32]


# A tenant's limits, positive integers (gateway/tenant_caps.py, gateway/tenant_rates.py);
# they and its ``models`` (gateway/handler.py forward_watched) are one value for all its keys
TENANT_COUNTS = ("max_parallel_requests", "rpm_limit", "tpm_limit")
# Their bound: a bucket's level in thousandths stays a 64-bit integer in Redis's answer,
# and a limit a float (tenant_rates.py): 10^400 made every request of its tenant a 500.
MAX_LIMIT = 10**15


def parse_api_keys(data: object) -> dict[str, Tenant]:
    if not isinstance(data, Mapping):
        raise ValueError("the API key file must map each key to {tenant: ...}")
    tenants: dict[str, Tenant] = {}
    for key, spec in data.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"API key {key!r} must be a non-empty string")
        if isinstance(spec, str):
            spec = {"tenant": spec}
        if not isinstance(spec, Mapping) or not isinstance(spec.get("tenant"), str):
            raise ValueError(f"API key {key[:6]}…: give a tenant name (tenant: NAME)")
        name = spec["tenant"]
        salt = spec.get("cache_salt") or derived_salt(name)
        shared = spec.get("shared_namespace", False)
        admin = spec.get("admin", False)
        if not isinstance(salt, str) or not isinstance(shared, bool) or not isinstance(admin, bool):
            raise ValueError(
                f"API key {key[:6]}…: cache_salt is a string, shared_namespace and admin bools"
            )
        priority = spec.get("priority")
        if priority is not None and (
            not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) >= 2**63
        ):
            raise ValueError(f"API key {key[:6]}…: priority is an integer (a 64-bit one)")
        limits = [spec.get(field_name) for field_name in TENANT_COUNTS]
        for limit, field_name in zip(limits, TENANT_COUNTS, strict=True):
            if limit is not None and (
                not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT
            ):
                raise ValueError(
                    f"API key {key[:6]}…: {field_name} is a positive integer, at most 10^15"
                )
        models = spec.get("models")
        if models is not None and (
            not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)
        ):
            raise ValueError(f"API key {key[:6]}…: models is a list of model names")
        allowed = frozenset(models) if models else None  # [] as LiteLLM reads it: every one
        cap, rpm, tpm = limits
        expires = _expiry(key, spec.get("expires"))
        tenants[key] = Tenant(name, salt, shared, admin, priority, cap, rpm, tpm, allowed, expires)
    for field_name in (*TENANT_COUNTS, "models"):
        seen: dict[str, object] = {}
        for tenant in tenants.values():
            value = getattr(tenant, field_name)
            if seen.setdefault(tenant.name, value) != value:
                raise ValueError(
                    f"tenant {tenant.name}: its keys give different {field_name} (one limit "
                    "per tenant)"
                )
    return tenants


def _expiry(key: str, value: object) -> float | None:
    """A key's ``expires``: a date and time (YAML reads one unquoted as such) or an ISO
    8601 string; without a zone it is UTC."""
    if value is None:
        return None
    when = value
    if isinstance(value, str):
        try:
            when = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            when = None
    elif isinstance(value, date) and not isinstance(value, datetime):
        when = datetime(value.year, value.month, value.day)
    if not isinstance(when, datetime):
        raise ValueError(f"API key {key[:6]}…: expires is a date and time (2027-01-31T00:00:00Z)")
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


# libyaml's safe loader where PyYAML has it: the same values, three times faster (10,000
# keys: 1.0 s against 3.2 s), and the file is read again whenever it changes.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_api_keys(path: Path) -> dict[str, Tenant]:
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=SAFE_LOADER)
    return parse_api_keys(data)


OPEN_TENANT = Tenant("default", "", shared_namespace=True)


class Authenticator:
    """Checks bearer keys; built without keys it is open (one shared namespace)."""

    __slots__ = ("_by_digest", "caps", "models", "rates")

    def __init__(self, keys: Mapping[str, Tenant] | None = None) -> None:
        # Looked up by the key's digest, so lookup time says nothing about near misses.
        self._by_digest: dict[bytes, Tenant] | None = (
            None if keys is None else {_digest(k): t for k, t in keys.items()}
        )
        # tenant name -> its max_parallel_requests, for the tenants that have one
        self.caps: dict[str, int] = {
            t.name: t.max_parallel_requests
            for t in (keys or {}).values()
            if t.max_parallel_requests is not None
        }
        # tenant name -> its rpm_limit and tpm_limit, for the tenants that have either
        self.rates: dict[str, Limits] = {
            t.name: Limits(t.rpm_limit, t.tpm_limit)
            for t in (keys or {}).values()
            if t.rpm_limit is not None or t.tpm_limit is not None
        }
        # tenant name -> the models it may call, for the tenants that have a list
        self.models: dict[str, frozenset[str]] = {
            t.name: t.models for t in (keys or {}).values() if t.models is not None
        }

    def may_call(self, tenant: str, model: str) -> bool:
        """Whether ``tenant`` may call ``model`` (its ``models`` list, if it has one)."""
        allowed = self.models.get(tenant)
        return allowed is None or model in allowed

    @property
    def open(self) -> bool:
        return self._by_digest is None

    @property
    def key_count(self) -> int:
        return len(self._by_digest or ())

    def authenticate(self, authorization: str | None) -> Tenant:
        if self._by_digest is None:
            return OPEN_TENANT
        if not authorization or authorization[:7].lower() != "bearer ":
            raise _unauthorized("Missing API key: send `Authorization: Bearer YOUR_KEY`.")
        tenant = self._by_digest.get(_digest(authorization[7:].strip()))
        if tenant is None:
            raise _unauthorized("Incorrect API key provided.")
        if tenant.expires is not None and time.time() >= tenant.expires:
            raise _unauthorized("This API key has expired.")
        return tenant

    def authenticate_request(self, headers: dict[str, str]) -> Tenant:
        """``authenticate`` a request by its headers; a tenant with a ``priority`` of its
        own has it in their ``x-vllm-priority`` (the header sent on), in place of the
        client's."""
        tenant = self.authenticate(headers.get("authorization"))
        if tenant.priority is not None:
            headers["x-vllm-priority"] = str(tenant.priority)
        return tenant

    def forwarded_salt(self, tenant: Tenant, client_salt: str | None) -> str | None:
        """The ``cache_salt`` the replica must see (None: send none).

        Open mode keeps the client's own; keyed mode always uses the tenant's, and the
        shared namespace sends none (the empty salt, which some servers reject as a value).
        """
        if self._by_digest is None:
            return client_salt or None
        return tenant.salt or None

    def scoped_conversation(self, tenant: Tenant, key: str | None) -> str | None:
        """The conversation key routing uses. Keyed mode puts the tenant's name in front:
        two tenants that send the same ``prompt_cache_key`` or session id hold two
        conversations (neither may steer, or learn where, the other's goes)."""
        if key is None or self._by_digest is None:
            return key
        return f"{tenant.name}\x00{key}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(
        message,
        status=401,
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
