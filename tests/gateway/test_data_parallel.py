"""An engine with several data-parallel ranks behind one URL (vLLM's
``--data-parallel-size``), a bridge per rank: the gateway sees each rank as a replica of
its own, and each request it sends names the rank it chose (``X-data-parallel-rank``),
which vLLM reads on its chat and completions endpoints. Without the header the engine
picks the rank itself, whatever cache the router placed the request by.

The engine's serving side is the stub backend (it records each request's headers); its
metrics side, with two ranks' gauges, the bridge tests' fake engine. The gateway is also
given the engine's URL, as ``prefixgate up`` gives it: the ranks, once registered, stand
for it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bridge.service import Bridge, BridgeConfig
from router.protocol import DATA_PARALLEL_RANK_HEADER
from tests.bridge.fake_engine import FakeEngineHTTP
from tests.bridge.test_data_parallel import TWO_RANKS
from tests.conftest import RedisServer, wait_until_async
from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

MODEL = "stub-model"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Engine:
    def __init__(self, stub: Server, bridges: list[Bridge], gateway: Server) -> None:
        self.stub, self.bridges, self.gateway = stub, bridges, gateway

    @property
    def rank_ids(self) -> list[str]:
        return [b.config.resolved_replica_id for b in self.bridges]


@pytest.fixture
async def engine(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Engine]:
    stub = start_stub(tmp_path, "engine", "--model", MODEL)
    metrics = FakeEngineHTTP(model=MODEL, metrics=TWO_RANKS)
    metrics.start()
    bridges = [
        Bridge(
            BridgeConfig(
                metrics.url,
                "tcp://127.0.0.1:1",  # no events: the ranks' caches stay empty here
                redis_server.url,
                model=MODEL,
                advertise_url=stub.url,  # what the gateway calls
                data_parallel_rank=rank,
                check_tokenizer=False,
                heartbeat_s=0.2,
                info_ttl_s=30.0,
            )
        )
        for rank in (0, 1)
    ]
    flags = ("--redis-url", redis_server.url, "--policy", "round_robin", "--model", MODEL)
    gateway = start_gateway(tmp_path, "gateway", [stub.url], *flags)
    try:
        for bridge in bridges:
            await bridge.start()
        yield Engine(stub, bridges, gateway)
    finally:
        for bridge in bridges:
            await bridge.stop()
        gateway.stop()
        metrics.stop()
        stub.stop()


async def _replicas(gateway: Server) -> list[str]:
    async with httpx.AsyncClient() as client:
        stats = (await client.get(gateway.url + "/router/stats")).json()
    return sorted(stats["replicas"])


async def _ranks_registered(engine: Engine) -> None:
    async def ranks_only() -> bool:
        return await _replicas(engine.gateway) == sorted(engine.rank_ids)

    await wait_until_async(ranks_only, 15, "the two ranks, in place of the engine's URL")  # type: ignore[arg-type]

    async def both_healthy() -> bool:  # probed: a replica not yet probed takes no requests
        async with httpx.AsyncClient() as client:
            ready = await client.get(engine.gateway.url + "/ready?min_replicas=2")
        return ready.status_code == 200

    await wait_until_async(both_healthy, 15, "both ranks healthy")  # type: ignore[arg-type]


async def test_each_request_names_the_rank_the_router_chose(engine: Engine) -> None:
    await _ranks_registered(engine)
    client = openai.AsyncOpenAI(base_url=engine.gateway.url + "/v1", api_key="x", max_retries=0)
    chosen: dict[str, str] = {}  # request id -> the replica the gateway reports
    for i in range(6):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"question {i}"}]
        )
        chosen[raw.headers["x-request-id"]] = raw.headers["x-prefixgate-replica"]
    await client.close()
    async with httpx.AsyncClient() as http:
        seen: list[dict[str, Any]] = (await http.get(engine.stub.url + "/stub/requests")).json()
    named = {
        r["headers"]["x-request-id"]: r["headers"].get(DATA_PARALLEL_RANK_HEADER)
        for r in seen
        if r.get("path") == "/v1/chat/completions"
    }
    rank_of = {rid: str(rank) for rank, rid in enumerate(engine.rank_ids)}
    assert {request: named.get(request) for request in chosen} == {
        request: rank_of[replica] for request, replica in chosen.items()
    }
    assert set(chosen.values()) == set(engine.rank_ids)  # both ranks served


async def test_a_client_cannot_pick_the_rank(engine: Engine) -> None:
    """The header is the gateway's: a client's own is not passed on."""
    await _ranks_registered(engine)
    async with httpx.AsyncClient() as http:
        answer = await http.post(
            engine.gateway.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers={DATA_PARALLEL_RANK_HEADER: "7"},
        )
        assert answer.status_code == 200
        seen = (await http.get(engine.stub.url + "/stub/requests")).json()
    last = next(r for r in reversed(seen) if r.get("path") == "/v1/chat/completions")
    assert last["headers"].get(DATA_PARALLEL_RANK_HEADER) != "7"
