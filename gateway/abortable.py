"""Requests being forwarded, by the id a client may abort them by.

An engine aborts a request by an id its client chose (vLLM's token API: the answer's
``generate-tokens-ID``; SGLang's ``/generate``: its ``rid``), and only the engine running
it can. The gateway keeps each such request while it forwards it, with its tenant and its
``Exchange`` (whose ``replica`` is the replica trying it now), and sends an abort to that
replica alone. An id it is not forwarding may be another gateway's: in open mode it goes
to every replica (each ignores an id it does not run); in keyed mode it is dropped, for
a tenant may abort only what it sent, and its requests are known only where they came in.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from gateway.exchange import Exchange
from gateway.http1 import UpstreamError
from gateway.upstream import Upstream
from router.protocol import redacted_url
from router.router import ReplicaView

log = logging.getLogger("prefixgate.gateway.abort")


class Abortable:
    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, Exchange]] = {}  # id -> (tenant, exchange)

    def __len__(self) -> int:
        return len(self._held)

    @contextmanager
    def hold(self, ids: Iterable[str], tenant: str, ex: Exchange) -> Iterator[None]:
        """Keep ``ex``'s request under ``ids`` while the block runs. An id already held
        stays its first request's (engines refuse or abort duplicates themselves); only
        the request that holds an id lets it go."""
        mine = [i for i in dict.fromkeys(ids) if i not in self._held]
        for request_id in mine:
            self._held[request_id] = (tenant, ex)
        try:
            yield
        finally:
            for request_id in mine:
                del self._held[request_id]

    def targets(
        self,
        ids: Iterable[str],
        tenant: str,
        replicas: Mapping[str, ReplicaView],
        broadcast_unknown: bool,
    ) -> dict[str, list[str]]:
        """Replica URL -> the ids to abort there. By URL: a vLLM's data-parallel ranks
        are replicas behind one URL, and one abort there reaches every rank."""
        out: dict[str, list[str]] = {}
        unknown: list[str] = []
        for request_id in dict.fromkeys(ids):
            held = self._held.get(request_id)
            if held is None:
                unknown.append(request_id)
                continue
            owner, ex = held
            view = replicas.get(ex.replica) if ex.replica is not None else None
            if owner == tenant and view is not None:
                out.setdefault(view.url, []).append(request_id)
        if unknown and broadcast_unknown:
            for url in dict.fromkeys(view.url for view in replicas.values()):
                out.setdefault(url, []).extend(unknown)
        return out


async def abort_at(
    upstream: Upstream, url: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> None:
    """One abort sent to one replica; a failure is logged, not the client's (engines
    answer an abort 200 whatever they found, and the request may have ended meanwhile)."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    try:
        response = await upstream.request("POST", url + path, raw, headers)
        await response.read()
    except UpstreamError as exc:
        log.warning("abort at %s failed: %s", redacted_url(url), exc.kind)
        return
    if response.status != 200:
        log.warning("abort at %s answered %d", redacted_url(url), response.status)
