"""A tenant's ``max_parallel_requests`` (gateway/auth.py): its requests in flight at once
at a gateway, a 429 past it (gateway/handler.py ``forward_watched``). Without it one
tenant's flood filled every replica's queue ahead of every other tenant's requests."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.auth import parse_api_keys
from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)

MODEL = "cap-model"
KEYS = {
    "sk-flood": {"tenant": "flood", "max_parallel_requests": 2},
    "sk-flood-2": {"tenant": "flood", "max_parallel_requests": 2},
    "sk-other": {"tenant": "other"},
}


class Servers:
    def __init__(self, root: Path) -> None:
        self.stub = start_stub(root, "stub", "--model", MODEL, "--delay-ms", "600")
        keys = root / "keys.json"
        keys.write_text(json.dumps(KEYS))
        self.gateway = start_gateway(root, "keyed", [self.stub.url], "--api-keys", str(keys))

    def stop(self) -> None:
        self.gateway.stop()
        self.stub.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("tenant-caps"))
    yield s
    s.stop()


async def _chats(gateway: Server, keys: list[str], timeout: float = 30) -> list[httpx.Response]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=timeout) as client:
        return list(
            await asyncio.gather(
                *(
                    client.post(
                        "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {k}"}
                    )
                    for k in keys
                )
            )
        )


def test_a_tenant_past_its_cap_gets_429_and_others_are_served(servers: Servers) -> None:
    answers = asyncio.run(
        _chats(servers.gateway, ["sk-flood", "sk-flood-2"] * 3 + ["sk-other"] * 3)
    )
    flood, other = answers[:6], answers[6:]
    assert sorted(r.status_code for r in flood) == [200, 200, 429, 429, 429, 429]
    refused = next(r for r in flood if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "max_parallel_requests"
    assert [r.status_code for r in other] == [200, 200, 200]  # no cap of its own
    # Every slot came back: two at once are served again.
    assert [r.status_code for r in asyncio.run(_chats(servers.gateway, ["sk-flood"] * 2))] == [
        200,
        200,
    ]


def test_a_client_that_leaves_gives_its_slot_back(servers: Servers) -> None:
    with pytest.raises(httpx.TimeoutException):
        asyncio.run(_chats(servers.gateway, ["sk-flood"] * 2, timeout=0.2))
    # The gateway hears of the disconnects a moment later; a slot never given back would
    # refuse one of every pair from then on.
    deadline = time.monotonic() + 5
    while [r.status_code for r in asyncio.run(_chats(servers.gateway, ["sk-flood"] * 2))] != [
        200,
        200,
    ]:
        assert time.monotonic() < deadline, "a slot was not given back"


def test_the_keys_file_takes_one_positive_cap_per_tenant() -> None:
    assert (
        parse_api_keys({"k": {"tenant": "t", "max_parallel_requests": 3}})[
            "k"
        ].max_parallel_requests
        == 3
    )
    for bad in (0, -1, True, "4", 1.5):
        with pytest.raises(ValueError, match="max_parallel_requests"):
            parse_api_keys({"k": {"tenant": "t", "max_parallel_requests": bad}})
    two = {"a": {"tenant": "t", "max_parallel_requests": 2}, "b": {"tenant": "t"}}
    with pytest.raises(ValueError, match="one cap per tenant"):
        parse_api_keys(two)
