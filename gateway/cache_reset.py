"""``POST /reset_prefix_cache`` on the gateway: reset every replica's prefix cache and the
router's view of them (for benchmarks that repeat a workload on a warm cluster, and for
operators after a model or tokenizer change).

Each replica drops its cached blocks and answers with the block-event sequence number as
of the reset. The router forgets those replicas' blocks at once, then, for replicas that
publish events, waits until its Redis sync has folded in that sequence number: the
replica's own ``cleared`` event is then behind it, and cannot wipe what the first
requests after the reset insert. Conversations and recent decisions start over too: the
histories they stood for are gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from gateway.state import GatewayState
from router.router import Router

log = logging.getLogger("prefixgate.gateway")

SYNC_WAIT_S = 5.0  # how long the reset waits for the replicas' cleared events
_POLL_S = 0.01


# A vLLM serves /reset_prefix_cache only in its development mode.
NOT_SERVED = (
    "it serves neither /reset_prefix_cache nor /flush_cache (a vLLM serves the first only "
    "with VLLM_SERVER_DEV_MODE=1 in its environment)"
)


async def reset_one(client: httpx.AsyncClient, url: str, timeout: float) -> dict[str, Any]:
    """One replica's answer, or ``{"error": ...}`` (never raises for the replica's fault).

    The built-in replica and vLLM serve ``/reset_prefix_cache`` (vLLM answers ``{"success":
    false}`` while running requests hold blocks, and older releases an empty 200); SGLang
    serves ``/flush_cache`` instead, tried when the first is a 404."""
    try:
        response = await client.post(url + "/reset_prefix_cache", timeout=timeout)
        if response.status_code == 404:
            response = await client.post(url + "/flush_cache", timeout=timeout)
            if response.status_code == 404:
                return {"error": NOT_SERVED}
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if response.status_code != 200:
        return {"error": f"HTTP {response.status_code}: {response.text[:200]}"}
    try:
        body = response.json()
    except ValueError:
        body = None  # SGLang's plain text, an older vLLM's empty body: done, no sequence
    if not isinstance(body, dict):
        return {"freed_blocks": None, "seq": None}
    if body.get("success") is False:
        return {"error": "the engine did not reset: running requests hold blocks; retry when idle"}
    seq, freed = body.get("seq"), body.get("freed_blocks")
    return {"freed_blocks": freed, "seq": seq if isinstance(seq, int) else None}


async def wait_for_events(router: Router, seqs: dict[str, int], timeout_s: float) -> list[str]:
    """Wait until the router has folded in each replica's event ``seqs[replica]``; returns
    the replicas it gave up on (Redis down or slow: their ``cleared`` event comes later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        behind = []
        for replica_id, seq in seqs.items():
            view = router.replicas.get(replica_id)
            if view is not None and view.publishes_events and (view.last_seq or 0) < seq:
                behind.append(replica_id)
        if not behind or time.monotonic() >= deadline:
            return behind
        await asyncio.sleep(_POLL_S)  # the sync task advances last_seq meanwhile


async def reset_prefix_caches(state: GatewayState) -> dict[str, dict[str, Any]]:
    """Reset every known replica; per replica its answer or its error."""
    views = list(state.router.replicas.values())
    timeout = max(state.config.probe_timeout_s, 10.0)
    answers = await asyncio.gather(*(reset_one(state.client, v.url, timeout) for v in views))
    results = {v.replica_id: a for v, a in zip(views, answers, strict=True)}
    done = [rid for rid, a in results.items() if "error" not in a]
    state.router.forget_cached_state(done)
    seqs = {rid: a["seq"] for rid, a in results.items() if a.get("seq") is not None}
    if state.sync is not None and seqs:
        for replica_id in await wait_for_events(state.router, seqs, SYNC_WAIT_S):
            results[replica_id]["warning"] = "its cleared event has not reached this gateway yet"
    failed = {rid: a["error"] for rid, a in results.items() if "error" in a}
    if failed:
        log.warning("prefix cache reset failed on %s", failed)
    log.info("prefix cache reset on %d of %d replicas", len(done), len(results))
    return results
