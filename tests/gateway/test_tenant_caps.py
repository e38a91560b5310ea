"""A tenant's ``max_parallel_requests`` (gateway/auth.py): its requests in flight at once
at a gateway, a 429 past it (gateway/handler.py ``forward_watched``). Without it one
tenant's flood filled every replica's queue ahead of every other tenant's requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.auth import parse_api_keys
from gateway.tenant_caps import STALE_S
from tests.conftest import RedisServer
from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = pytest.mark.timeout(180)

MODEL = "cap-model"
KEYS = {
    "sk-flood": {"tenant": "flood", "max_parallel_requests": 2},
    "sk-flood-2": {"tenant": "flood", "max_parallel_requests": 2},
    "sk-other": {"tenant": "other"},
    "sk-ops": {"tenant": "ops", "admin": True},
}
ADMIN = {"authorization": "Bearer sk-ops"}


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
    with pytest.raises(ValueError, match="one limit per tenant"):
        parse_api_keys(two)


def _seen(gateway: Server, where: str) -> int:
    """The flood tenant's requests in flight as ``gateway`` counts them ("here", or
    "others": the other gateways', as last read from Redis)."""
    stats = httpx.get(gateway.url + "/router/stats", headers=ADMIN).json()
    return int(stats["tenant_caps"]["flood"][where])


def _wait_seen(gateway: Server, where: str, count: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while _seen(gateway, where) != count:
        assert time.monotonic() < deadline, f"{gateway.url} never saw {where} = {count}"
        time.sleep(0.05)  # polling the gateway's view


def _hold(gateway: Server, key: str, n: int) -> list[threading.Thread]:
    """``n`` chats of ``key`` through ``gateway`` on threads of their own (they end with
    the stub's delay, or with the gateway)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"authorization": f"Bearer {key}"}

    def post() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)

    threads = [threading.Thread(target=post) for _ in range(n)]
    for thread in threads:
        thread.start()
    return threads


def test_gateways_sharing_a_redis_share_the_cap(tmp_path: Path, redis_server: RedisServer) -> None:
    """Two gateways, one Redis: the tenant's two slots taken at one are refused at the
    other; given back when those finish, and when the gateway holding them is killed
    (its count goes stale: STALE_S)."""
    stub = start_stub(tmp_path, "slow", "--model", MODEL, "--delay-ms", "3000")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    flags = ("--api-keys", str(keys), "--redis-url", redis_server.url)
    first = start_gateway(tmp_path, "first", [stub.url], *flags)
    second = start_gateway(tmp_path, "second", [stub.url], *flags)
    try:

        async def at_once() -> list[int]:  # three at each gateway, in the same moment
            both = await asyncio.gather(
                _chats(first, ["sk-flood"] * 3), _chats(second, ["sk-flood-2"] * 3)
            )
            return sorted(r.status_code for answers in both for r in answers)

        # Decided in Redis, not on a count read moments ago: two in all, not two each.
        assert asyncio.run(at_once()) == [200, 200, 429, 429, 429, 429]
        _wait_seen(first, "here", 0, within_s=3)
        held = _hold(first, "sk-flood", 2)
        _wait_seen(second, "others", 2, within_s=2.5)  # before the held two finish
        (refused,) = asyncio.run(_chats(second, ["sk-flood-2"]))
        assert refused.status_code == 429
        for thread in held:
            thread.join()
        _wait_seen(second, "others", 0, within_s=3)  # finished: given back at the next sync
        assert [r.status_code for r in asyncio.run(_chats(second, ["sk-flood"] * 2))] == [200] * 2

        _wait_seen(first, "others", 0, within_s=3)  # the second's two: given back too
        held = _hold(first, "sk-flood", 2)
        _wait_seen(second, "others", 2, within_s=2.5)
        first.proc.kill()  # its count stays in Redis until it goes stale
        first.proc.wait()
        assert asyncio.run(_chats(second, ["sk-flood"]))[0].status_code == 429
        _wait_seen(second, "others", 0, within_s=STALE_S + 3)
        assert asyncio.run(_chats(second, ["sk-flood"]))[0].status_code == 200
        for thread in held:
            thread.join()
    finally:
        second.stop()
        first.stop()
        stub.stop()
