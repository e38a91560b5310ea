"""Background upkeep: active health probes and the models replicas serve.

Every ``probe_interval_s`` each replica's ``/health`` is fetched and the outcome fed to
``router.report_probe`` (the breaker's active half; request outcomes are the passive
half), and a healthy vLLM's ``/is_paused`` to ``router.report_paused`` (``paused_once``).
Static replicas (``--replica URL``) are asked once at start what they serve
(``/v1/models``); one that does not answer is added with the ``--model`` fallback and
asked again in the background until it does.

A replica may serve more than one name, and clients send any of them: vLLM lists every
``--served-model-name`` (aliases of one model, one cache) and every LoRA adapter (a card
with a ``parent``: keys of its own, as the bridge publishes its blocks). Every replica's
``/v1/models`` is read when it first answers a probe, before it is reported healthy, and
every ``NAMES_REFRESH_S`` after (adapters can be loaded at run time), into
``ReplicaView.names``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httpx

from gateway.state import GatewayState
from prefixgate.open_files import out_of_files
from prefixgate.tls import tls_failure

log = logging.getLogger("prefixgate.gateway")


def static_replica_id(url: str) -> str:
    """A static replica is named by its address: stable across gateways and restarts."""
    parts = urlsplit(url)
    return parts.netloc or url


async def probe_once(
    client: httpx.AsyncClient, url: str, timeout: float, state: GatewayState | None = None
) -> bool | None:
    """Whether the replica answered its health check; None when the gateway could not
    ask (no file descriptor to spare here: no verdict on the replica). An HTTPS replica
    whose TLS fails is named in a warning once (``state.tls_warned``)."""
    try:
        response = await client.get(url + "/health", timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL is no HTTPError
        if state is not None and url.startswith("https:") and url not in state.tls_warned:
            shows = state.config.upstream_certfile is not None
            if why := tls_failure(exc, "upstream", shows):
                state.tls_warned.add(url)
                log.warning("replica %s is never healthy while %s", url, why)
        return None if out_of_files(exc) else False
    if state is not None:
        state.tls_warned.discard(url)
    return response.status_code == 200


# How long an engine without ``/is_paused`` is not asked again (one restarted with
# vLLM's development mode on may have it next time).
PAUSE_ASK_AGAIN_S = 30.0


async def paused_once(state: GatewayState, url: str, timeout: float) -> bool | None:
    """Whether a vLLM is paused or asleep (``GET /is_paused``: its ``/pause`` and
    ``/sleep``, both of vLLM's development mode); None when it cannot say (no answer, or
    not asked). An engine without the endpoint cannot be paused this way (SGLang, the
    built-in replica, a vLLM without development mode): False, and not asked again for
    ``PAUSE_ASK_AGAIN_S``.

    Such an engine answers ``/health`` and takes requests, and runs none until it
    resumes: a request routed there waited the upstream timeout while others idled."""
    now = time.monotonic()
    if state.pause_unasked.get(url, 0.0) > now:
        return None
    try:
        response = await state.client.get(url + "/is_paused", timeout=timeout)
    except httpx.HTTPError:
        return None
    if response.status_code in (404, 405):
        state.pause_unasked[url] = now + PAUSE_ASK_AGAIN_S
        return False
    try:
        paused = response.json().get("is_paused") if response.status_code == 200 else None
    except (ValueError, AttributeError):
        paused = None
    return paused if isinstance(paused, bool) else None


async def probe_all(state: GatewayState) -> None:
    views = list(state.router.replicas.values())
    timeout = state.config.probe_timeout_s
    results = await asyncio.gather(
        *(probe_once(state.client, v.url, timeout, state) for v in views)
    )
    urls = list(dict.fromkeys(v.url for v, ok in zip(views, results, strict=True) if ok))
    for gone in state.pause_unasked.keys() - {v.url for v in views}:
        del state.pause_unasked[gone]  # a replica no longer listed
    answers = await asyncio.gather(*(paused_once(state, url, timeout) for url in urls))
    pauses = dict(zip(urls, answers, strict=True))
    # A replica answering for the first time is routed with every name it serves, not
    # only its model: its list (aliases, adapters) is read in this round, before it is
    # reported healthy. Else a client naming an alias right after start got a 404 until
    # the next read.
    unread = {
        v.replica_id
        for v, ok in zip(views, results, strict=True)
        if ok and v.replica_id not in state.names_read
    }
    if unread:
        await refresh_names(state, state.names_read, among=unread)
    for view, ok in zip(views, results, strict=True):
        if view.replica_id not in state.router.replicas:  # removed meanwhile
            continue
        if ok is not None:
            state.router.report_probe(view.replica_id, ok)
        paused = pauses.get(view.url)
        if paused is not None and state.router.report_paused(view.replica_id, paused):
            if paused:
                log.warning(
                    "replica %s is paused or asleep (its engine's /pause or /sleep): no "
                    "requests go to it until it resumes",
                    view.replica_id,
                )
            else:
                log.info("replica %s resumed: routed again", view.replica_id)


async def probe_loop(state: GatewayState) -> None:
    while True:
        await asyncio.sleep(state.config.probe_interval_s)  # the probe period
        try:
            await probe_all(state)
        except Exception:  # a probe bug must not end probing
            log.exception("health probe round failed")


NAMES_REFRESH_S = 30.0


class Served(NamedTuple):
    """What a server lists at ``/v1/models``: its model (the first card without a
    parent) and its other names, each with the model id of its block keys; ``cards``: each
    name's card, as much of it as ``CARD_FIELDS`` keeps (the gateway lists them)."""

    model: str
    names: dict[str, str]
    cards: dict[str, dict[str, Any]]


# The fields of a model card passed on from a replica's list: OpenAI's, and vLLM's
# ``root``, ``parent`` and ``max_model_len`` (clients size their context by the last).
CARD_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len")


def _card(card: dict[str, Any]) -> dict[str, Any]:
    """A replica's card reduced to ``CARD_FIELDS`` whose values are plain scalars."""
    return {
        k: card[k]
        for k in CARD_FIELDS
        if k in card and (card[k] is None or isinstance(card[k], str | int | float))
    }


def served_names(cards: object) -> Served | None:
    """``/v1/models``' ``data`` read as ``Served``; None when it names no model."""
    if not isinstance(cards, list):
        return None
    listed = [
        (card["id"], card.get("parent"))
        for card in cards
        if isinstance(card, dict) and isinstance(card.get("id"), str) and card["id"]
    ]
    bases = [name for name, parent in listed if not parent]
    if not listed:
        return None
    model = bases[0] if bases else listed[0][0]
    names = {name: (name if parent else model) for name, parent in listed if name != model}
    kept = {
        card["id"]: _card(card)
        for card in cards
        if isinstance(card, dict) and isinstance(card.get("id"), str) and card["id"]
    }
    return Served(model, names, kept)


async def fetch_models(state: GatewayState, url: str) -> Served | None:
    """What a server serves (``served_names``); None when it does not answer. A server
    that refuses the gateway its list (a vLLM or SGLang started with --api-key guards
    ``/v1/models``) is named in a warning once, with the flag that fixes it: meanwhile
    its model is unknown, so its prompts cannot be matched to its cache."""
    try:
        response = await state.client.get(url + "/v1/models", timeout=state.config.probe_timeout_s)
    except (httpx.HTTPError, httpx.InvalidURL):
        return None
    if response.status_code in (401, 403):
        if url not in state.refused_urls:
            state.refused_urls.add(url)
            given = state.config.upstream_api_key is not None
            log.warning(
                "replica %s refused GET /v1/models (HTTP %d): %s",
                url,
                response.status_code,
                "it does not take the gateway's --upstream-api-key"
                if given
                else "it wants an API key; start the gateway with --upstream-api-key "
                "(env PREFIXGATE_UPSTREAM_API_KEY)",
            )
        return None
    state.refused_urls.discard(url)
    if response.status_code != 200:
        return None
    try:
        return served_names(response.json().get("data"))
    except (ValueError, AttributeError):
        return None


async def names_loop(state: GatewayState) -> None:
    """Keep every replica's other served names (``ReplicaView.names``) current."""
    while True:
        await asyncio.sleep(state.config.probe_interval_s)
        try:
            await refresh_names(state, state.names_read)
        except Exception:  # a bug here must not end the upkeep
            log.exception("reading the replicas' model lists failed")


async def refresh_names(
    state: GatewayState, fetched_at: dict[str, float], among: set[str] | None = None
) -> None:
    """Read ``/v1/models`` of the replicas (``among`` these ids) not read within
    ``NAMES_REFRESH_S`` (as ``fetched_at`` says; updated)."""
    now = time.monotonic()
    due = [
        v
        for v in state.router.replicas.values()
        if v.model
        and (among is None or v.replica_id in among)
        and now - fetched_at.get(v.replica_id, -NAMES_REFRESH_S) >= NAMES_REFRESH_S
    ]
    found = await asyncio.gather(*(fetch_models(state, v.url) for v in due))
    for view, served in zip(due, found, strict=True):
        if served is None:
            continue  # no answer: what it served before stands
        fetched_at[view.replica_id] = now
        # Its registered model may be another of its aliases than the first listed
        # (a bridge given one): that one names the shared keys.
        names = {
            name: view.model if key == served.model else key
            for name, key in (*served.names.items(), (served.model, served.model))
        }
        state.router.set_names(view.replica_id, names)
        state.cards[view.replica_id] = served.cards
        state.keys.load_soon(view.model)  # a tokenizer source its card names (its root)
    for gone in fetched_at.keys() - state.router.replicas.keys():
        del fetched_at[gone]
    for gone in state.cards.keys() - state.router.replicas.keys():
        del state.cards[gone]  # replicas come and go (new pods, new addresses)


async def add_static_replicas(state: GatewayState) -> list[str]:
    """Add every ``--replica``; returns the URLs whose model is still unknown."""
    config = state.config
    fallback = config.models[0] if config.models else ""
    found = await asyncio.gather(*(fetch_models(state, u) for u in config.replicas))
    pending = []
    for url, served in zip(config.replicas, found, strict=True):
        if served is None:
            pending.append(url)
            log.warning("replica %s did not say its model; assuming %r for now", url, fallback)
        _put_static(state, url, fallback if served is None else served.model)
        if served is not None:
            state.router.set_names(static_replica_id(url), served.names)
            state.cards[static_replica_id(url)] = served.cards
            state.names_read[static_replica_id(url)] = time.monotonic()
    return pending


async def learn_static_models(state: GatewayState, pending: list[str]) -> None:
    """Keep asking the static replicas that did not answer at start for their model."""
    waiting = list(pending)
    while waiting:
        await asyncio.sleep(state.config.probe_interval_s)  # the retry period
        for url in list(waiting):
            served = await fetch_models(state, url)
            if served is None:
                continue
            waiting.remove(url)
            model = served.model
            rid = static_replica_id(url)
            state.cards[rid] = served.cards  # its root: a source of the model's tokenizer
            await state.keys.preload(model)
            view = state.router.replicas.get(rid)
            if view is None or view.model != model:
                _put_static(state, url, model)
            state.router.set_names(rid, served.names)
            log.info("replica %s serves %r", url, model)


def _put_static(state: GatewayState, url: str, model: str) -> None:
    # add_replica refreshes a known replica in place (its index entries survive).
    state.router.add_replica(
        static_replica_id(url), url, model=model, block_size=state.config.block_size, static=True
    )
