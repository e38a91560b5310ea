"""A gateway at its open-file limit, flooded with more streams than it has descriptors
for: those within its connection cap are served, the rest are refused with 503 and
Retry-After (or, beyond the descriptors left to accept them, closed), and it serves on
afterwards with its replica still healthy (prefixgate/open_files.py, the cap in
prefixgate/http_limits.py).

Before the cap, a gateway at 256 descriptors given 400 streams at once accepted clients
until none was left for an upstream connection: 0 of 400 answered, each a 502 blaming
the replica."""

from __future__ import annotations

import asyncio
import resource
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest

from prefixgate.procs import free_port
from tests.gateway.conftest import Server, start

pytestmark = pytest.mark.timeout(180)

LIMIT = 128  # the gateway's open files (soft and hard: it cannot raise them)
CAP = (LIMIT - LIMIT // 8) // 2  # prefixgate/open_files.py: 2 per connection, 1/8 reserved
CLIENTS = 120


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    root = tmp_path_factory.mktemp("open-files")
    port = free_port()
    replica = start(
        ["-m", "prefixgate", "replica", "--model", "sim", "--port", str(port)],
        port,
        root,
        "replica",
    )
    try:
        port = free_port()
        args = ["-m", "prefixgate", "gateway", "--port", str(port), "--replica", replica.url]
        gateway = start(
            [*args, "--probe-interval-s", "0.5"], port, root, "gw", "/ready", _limit_open_files
        )
    except Exception:
        replica.stop()
        raise
    yield gateway, replica
    gateway.stop()
    replica.stop()


async def _stream(client: openai.AsyncOpenAI, i: int) -> str:
    try:
        stream = await client.chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": f"request {i}: " + "tell me more " * 20}],
            max_tokens=40,
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
    except openai.APIStatusError as exc:
        retry = exc.response.headers.get("retry-after")
        return f"{exc.status_code} {exc.code} retry-after={retry}"
    except openai.APIConnectionError:
        return "closed"
    finished = chunks and chunks[-1].choices and chunks[-1].choices[0].finish_reason
    return "served" if finished or any(c.usage for c in chunks) else "cut"


async def _flood(base_url: str, clients: int) -> Counter[str]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
        return Counter(await asyncio.gather(*(_stream(client, i) for i in range(clients))))


def test_a_flood_beyond_the_descriptors_is_refused_cleanly_and_the_rest_are_served(
    cluster: tuple[Server, Server],
) -> None:
    gateway, replica = cluster
    assert f"client connections held at once: {CAP}" in gateway.log_text()
    outcomes = asyncio.run(_flood(gateway.url + "/v1", CLIENTS))
    refused = "503 service_unavailable retry-after=1"  # beyond the cap
    # Within it, while refused connections still hold their descriptors: no descriptor
    # for the upstream connection, which is not the replica's failure.
    busy = "503 gateway_busy retry-after=1"
    assert set(outcomes) <= {"served", refused, busy, "closed"}, outcomes
    # Within the cap, how many find a descriptor for their upstream connection depends on
    # when the refused connections let go of theirs: 10 to 56 of the 56 were served in
    # nine runs on this 2-core VM (fewer than CAP // 2 in 2 of them), the rest answered
    # gateway_busy; served and busy made 56 in every run. Both are clean answers.
    assert outcomes["served"] > 0, outcomes
    assert outcomes["served"] + outcomes[busy] >= CAP // 2, outcomes
    assert outcomes[refused] > 0, outcomes
    assert "connection(s) refused" in gateway.log_text()
    # It serves on, and its replica was never taken for down.
    ready = httpx.get(gateway.url + "/ready", timeout=5).json()
    assert ready["healthy_replicas"] == [replica.url.removeprefix("http://")]
    assert asyncio.run(_flood(gateway.url + "/v1", 4)) == Counter({"served": 4})
