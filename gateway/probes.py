"""Background upkeep: active health probes and the models of static replicas.

Every ``probe_interval_s`` each replica's ``/health`` is fetched and the outcome fed to
``router.report_probe`` (the breaker's active half; request outcomes are the passive
half). Static replicas (``--replica URL``) are asked once at start what they serve
(``/v1/models``); one that does not answer is added with the ``--model`` fallback and
asked again in the background until it does.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import httpx

from gateway.state import GatewayState
from prefixgate.open_files import out_of_files

log = logging.getLogger("prefixgate.gateway")


def static_replica_id(url: str) -> str:
    """A static replica is named by its address: stable across gateways and restarts."""
    parts = urlsplit(url)
    return parts.netloc or url


async def probe_once(client: httpx.AsyncClient, url: str, timeout: float) -> bool | None:
    """Whether the replica answered its health check; None when the gateway could not
    ask (no file descriptor to spare here: no verdict on the replica)."""
    try:
        response = await client.get(url + "/health", timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL is no HTTPError
        return None if out_of_files(exc) else False
    return response.status_code == 200


async def probe_all(state: GatewayState) -> None:
    views = list(state.router.replicas.values())
    timeout = state.config.probe_timeout_s
    results = await asyncio.gather(*(probe_once(state.client, v.url, timeout) for v in views))
    for view, ok in zip(views, results, strict=True):
        if ok is not None and view.replica_id in state.router.replicas:  # not removed meanwhile
            state.router.report_probe(view.replica_id, ok)


async def probe_loop(state: GatewayState) -> None:
    while True:
        await asyncio.sleep(state.config.probe_interval_s)  # the probe period
        try:
            await probe_all(state)
        except Exception:  # a probe bug must not end probing
            log.exception("health probe round failed")


async def fetch_model(client: httpx.AsyncClient, url: str, timeout: float) -> str | None:
    """The first model a server lists at ``/v1/models``; None when it does not answer."""
    try:
        response = await client.get(url + "/v1/models", timeout=timeout)
        data = response.json()["data"]
        model = data[0]["id"] if response.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
    return model if isinstance(model, str) else None


async def add_static_replicas(state: GatewayState) -> list[str]:
    """Add every ``--replica``; returns the URLs whose model is still unknown."""
    config = state.config
    fallback = config.models[0] if config.models else ""
    timeout = config.probe_timeout_s
    models = await asyncio.gather(*(fetch_model(state.client, u, timeout) for u in config.replicas))
    pending = []
    for url, model in zip(config.replicas, models, strict=True):
        if model is None:
            pending.append(url)
            log.warning("replica %s did not say its model; assuming %r for now", url, fallback)
        _put_static(state, url, model or fallback)
    return pending


async def learn_static_models(state: GatewayState, pending: list[str]) -> None:
    """Keep asking the static replicas that did not answer at start for their model."""
    waiting = list(pending)
    while waiting:
        await asyncio.sleep(state.config.probe_interval_s)  # the retry period
        for url in list(waiting):
            model = await fetch_model(state.client, url, state.config.probe_timeout_s)
            if model is None:
                continue
            waiting.remove(url)
            await state.keys.preload(model)
            rid = static_replica_id(url)
            view = state.router.replicas.get(rid)
            if view is None or view.model != model:
                _put_static(state, url, model)
            log.info("replica %s serves %r", url, model)


def _put_static(state: GatewayState, url: str, model: str) -> None:
    # add_replica refreshes a known replica in place (its index entries survive).
    state.router.add_replica(
        static_replica_id(url), url, model=model, block_size=state.config.block_size, static=True
    )
