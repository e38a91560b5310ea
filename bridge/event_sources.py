"""The engine's own account of its KV-event publisher, against the bridge's flags.

vLLM (0.32 on) serves ``GET /kv_event_sources``: each data-parallel rank's
``--kv-events-config`` as its engine core runs it. A bridge whose ``--kv-events`` does
not meet it receives nothing, and nothing says so: the engine's cache stays invisible to
routing while everything else works. Three ways it happens, each read here:

* both sides connect. vLLM binds only a wildcard (``tcp://*:5557``), ``ipc://`` or
  ``inproc://`` endpoint and connects to any other; so an engine given
  ``tcp://127.0.0.1:5557`` and a bridge given the same address both connect, and no
  socket listens. The bridge then binds the engine's address itself (it is on its own
  host when the engine is on the same one), and says so; where it cannot, it names the
  flag.
* the topics differ. A SUB socket receives the messages whose topic starts with its
  subscription: a bridge subscribed to ``kv`` misses an engine publishing on ``""``. The
  bridge subscribes to the engine's topic as well, and says so.
* the engine publishes nothing: events off, or the ``null`` publisher. Named, with the
  flag that turns them on.

An engine without the endpoint (older vLLM, SGLang) is not checked.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import zmq

from bridge.zmq_source import EngineEvents, binds

log = logging.getLogger("prefixgate.bridge")

TURN_ON = (
    '--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq", '
    '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\''
)


async def fetch_sources(http: httpx.AsyncClient, engine_url: str) -> dict[str, Any] | None:
    """``/kv_event_sources``, or None when the engine does not serve it."""
    try:
        reply = await http.get(engine_url.rstrip("/") + "/kv_event_sources")
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    try:
        sources = reply.json()
    except ValueError:
        return None
    return sources if isinstance(sources, dict) else None


def meet(sources: dict[str, Any], rank: int, events: EngineEvents, engine_url: str) -> list[str]:
    """Make the bridge's socket meet the engine's publisher where it can; what was found
    and done, one line each (also logged)."""
    config = sources.get(str(rank))
    said: list[str] = []
    if not isinstance(config, dict):
        if sources:  # a rank the engine does not have
            said.append(f"the engine lists no events for rank {rank} (it has {sorted(sources)})")
        else:
            said.append(f"the engine publishes no KV events: start it with {TURN_ON}")
    elif not config.get("enable_kv_cache_events") or config.get("publisher") in (None, "null"):
        said.append(f"the engine publishes no KV events: start it with {TURN_ON}")
    else:
        said += _meet_endpoint(config.get("endpoint"), events)
        said += _meet_topic(config.get("topic"), events)
    for line in said:
        log.warning("engine %s: %s", engine_url, line)
    return said


def _meet_endpoint(endpoint: object, events: EngineEvents) -> list[str]:
    if not isinstance(endpoint, str) or binds(endpoint) or binds(events.endpoint):
        return []  # one side binds: they can meet (a wrong port is not told apart here)
    try:
        events.bind_also(endpoint)
    except zmq.ZMQError as exc:
        return [
            f"it connects its event publisher to {endpoint}, and so does the bridge "
            f"(--kv-events {events.endpoint}), and the bridge cannot bind it ({exc}): run the "
            "bridge on that host with --kv-events tcp://*:PORT, or give the engine a "
            "wildcard endpoint (tcp://*:PORT), which it binds"
        ]
    return [
        f"it connects its event publisher to {endpoint}, as the bridge did "
        f"(--kv-events {events.endpoint}); the bridge now binds {endpoint} so they meet "
        "(give the bridge --kv-events tcp://*:PORT to say so)"
    ]


def _meet_topic(topic: object, events: EngineEvents) -> list[str]:
    if not isinstance(topic, str) or topic.encode("utf-8").startswith(events.topic):
        return []
    events.subscribe_also(topic)
    return [
        f"it publishes on topic {topic!r}, which the bridge's --topic "
        f"{events.topic.decode('utf-8')!r} does not receive; the bridge subscribed to it"
    ]
