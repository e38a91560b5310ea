"""``GatewayState``: everything the request handlers need, in one object.

Built by ``create_app`` (gateway/app.py), started and stopped by its lifespan, and passed
to the handlers explicitly; nothing here is global. Modules that serve requests import
this module, never the app, so imports point one way: app → handlers → state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from gateway.abortable import Abortable
from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.keys_file import KeysFile
from gateway.metrics import GatewayMetrics
from gateway.response_affinity import ResponseAffinity
from gateway.routing import KeyBuilder
from gateway.sagemaker_sessions import Sessions
from gateway.tenant_caps import TenantCaps
from gateway.tenant_rates import TenantRates
from gateway.upstream import Upstream
from gateway.workers import MergedMetrics
from prefixgate.tls import TLSFiles
from router.router import ReplicaView, Router

if TYPE_CHECKING:
    from router.sync import RedisSync


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    router: Router
    client: httpx.AsyncClient  # probes and model discovery
    upstream: Upstream  # forwarded requests
    keys: KeyBuilder
    auth: Authenticator
    metrics: GatewayMetrics
    affinity: ResponseAffinity  # response id -> replica, for the Responses API
    sync: RedisSync | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    refused_urls: set[str] = field(default_factory=set)  # replicas that refuse our /v1/models
    tls_warned: set[str] = field(default_factory=set)  # replicas whose TLS fails (probes.py)
    # Tenants' requests in flight against their max_parallel_requests (handler.py
    # forward_watched), shared with the other gateways through Redis (tenant_caps.py)
    tenant_caps: TenantCaps = field(default_factory=TenantCaps)
    # Tenants' requests and tokens per minute against their rpm_limit and tpm_limit
    # (forward_watched), in buckets shared with the other gateways through Redis
    # (tenant_rates.py)
    tenant_rates: TenantRates = field(default_factory=TenantRates)
    # replica URL -> when to ask its /is_paused again: it had none (probes.py)
    pause_unasked: dict[str, float] = field(default_factory=dict)
    upstream_tls: TLSFiles | None = None  # the --upstream-* files, reloaded when they change
    # replica id -> name -> the card it lists for that name (gateway/probes.py, CARD_FIELDS)
    cards: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    # replica id -> when its /v1/models was last read (time.monotonic(); probes.py)
    names_read: dict[str, float] = field(default_factory=dict)
    # Requests being forwarded, by the ids they may be aborted by (gateway/abortable.py):
    # vLLM's token API's (gateway/tokens_api.py), SGLang's /generate's (gateway/generate.py)
    generating: Abortable = field(default_factory=Abortable)
    sglang_generating: Abortable = field(default_factory=Abortable)
    # SageMaker's stateful sessions (gateway/sagemaker.py); None: not enabled
    sessions: Sessions | None = None
    # the --api-keys file, watched for changes (gateway/app.py watch_keys); None: open mode
    keys_file: KeysFile | None = None
    # under --workers: every worker's /metrics merged (gateway/workers.py); None: one process
    merged_metrics: MergedMetrics | None = None

    def upstream_authorization(self, headers: dict[str, str]) -> str | None:
        """The Authorization sent upstream: the gateway's --upstream-api-key; else, in open
        mode, the client's own (a keyed replica judges the client's key, as it would
        without the gateway); else none (keyed mode: the client's key is the gateway's)."""
        if self.config.upstream_api_key is not None:
            return f"Bearer {self.config.upstream_api_key}"
        return headers.get("authorization") if self.auth.open else None

    @property
    def vouches_upstream(self) -> bool:
        """Whether a replica's 401 judges the gateway's credentials, not the client's."""
        return self.config.upstream_api_key is not None or not self.auth.open

    def served_block_size(self, model: str) -> int | None:
        """Block size of a replica serving ``model``; None when no replica serves it."""
        view = self.serving(model)
        return None if view is None else int(view.block_size)

    def serving(self, model: str) -> ReplicaView | None:
        """A replica that serves ``model`` by name (its model, an alias or an adapter)."""
        for view in self.router.replicas.values():
            if view.model == model or model in view.names:
                return view
        return None

    def tokenizer_roots(self, model: str) -> list[str]:
        """What ``model``'s replicas list as its ``root`` (vLLM's and SGLang's ``--model``:
        a Hub id or the engine's folder), a source of its tokenizer (gateway/routing.py)."""
        roots = []
        for view in self.router.replicas.values():
            root = self.cards.get(view.replica_id, {}).get(model, {}).get("root")
            if view.model == model and isinstance(root, str) and root and root not in roots:
                roots.append(root)
        return roots

    def has_unknown_model_replica(self) -> bool:
        return any(v.model == "" for v in self.router.replicas.values())

    def card(self, name: str, *, healthy_only: bool) -> dict[str, Any]:
        """``name``'s model card: as a replica serving it lists it (vLLM's has
        ``max_model_len``, ``root``, ``parent``), or a plain one when none has said."""
        for view in self.router.replicas.values():
            listed = self.cards.get(view.replica_id, {}).get(name)
            if listed is not None and (view.healthy or not healthy_only):
                return {**listed, "id": name, "object": "model"}
        return {"id": name, "object": "model", "created": 0, "owned_by": "prefixgate"}

    def models(self, *, healthy_only: bool) -> list[str]:
        return sorted(
            {
                name
                for v in self.router.replicas.values()
                if v.model and (v.healthy or not healthy_only)
                for name in (v.model, *v.names)
            }
        )
