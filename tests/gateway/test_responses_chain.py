"""A chain of responses is one conversation for routing (gateway/responses.py,
"Conversation key"), through a real Redis, two real gateways and two real tiny-random
replicas (tests/support/scripted_replica.py), driven by the official openai client: every
turn's record carries the chain's key whichever gateway served it, an explicit key on a
follow-up wins and is carried on, ``user`` does not outrank the chain, and a chain whose
replica is gone stays a 404 although its key is known."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from gateway.auth import OPEN_TENANT
from tests.conftest import RedisServer
from tests.gateway.conftest import Server, start_gateway
from tests.gateway.test_agents import MODEL, TEMPLATE, Cluster

pytestmark = pytest.mark.timeout(240)


class TwoGateways(Cluster):
    def __init__(self, root: Path, redis_url: str) -> None:
        super().__init__(root, redis_url)
        self.other: Server = start_gateway(
            root,
            "gw2",
            [r.url for r in self.replicas],
            "--redis-url",
            redis_url,
            "--chat-template",
            f"{MODEL}={TEMPLATE}",
        )

    def clients(self) -> tuple[openai.OpenAI, openai.OpenAI]:
        other = openai.OpenAI(base_url=self.other.url + "/v1", api_key="x", max_retries=0)
        return self.client(), other

    def stop(self) -> None:
        self.other.stop()
        super().stop()


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[TwoGateways]:
    c = TwoGateways(tmp_path_factory.mktemp("chain"), module_redis.url)
    yield c
    c.stop()


def record(redis_url: str, response_id: str) -> dict[str, Any]:
    raw: Any = redis.Redis.from_url(redis_url).get(f"prefixgate:response:{response_id}")
    assert raw is not None, f"no record for {response_id}"
    parsed: dict[str, Any] = json.loads(raw)
    return parsed


def test_every_turn_carries_its_chains_key_through_every_gateway(
    cluster: TwoGateways, module_redis: RedisServer
) -> None:
    one, two = cluster.clients()
    key = f"agent\n{time.time()}\x00"  # a client's own string: any character
    root = one.responses.create(model=MODEL, input="say hello", prompt_cache_key=key)
    assert record(module_redis.url, root.id)["conversation"] == key
    # through the other gateway, no key: the chain's
    second = two.responses.create(model=MODEL, previous_response_id=root.id, input="again")
    assert record(module_redis.url, second.id) == {
        "replica_id": record(module_redis.url, root.id)["replica_id"],
        "conversation": key,
        "tenant": OPEN_TENANT.name,
    }
    # a follow-up's ``user`` does not outrank the chain
    third = one.responses.create(
        model=MODEL, previous_response_id=second.id, input="more", user="someone-else"
    )
    assert record(module_redis.url, third.id)["conversation"] == key
    # an explicit key wins, as it does for chats, and the chain carries it on
    fourth = two.responses.create(
        model=MODEL,
        previous_response_id=third.id,
        input="and more",
        extra_headers={"X-Conversation-Id": "renamed"},
    )
    assert record(module_redis.url, fourth.id)["conversation"] == "renamed"
    fifth = one.responses.create(model=MODEL, previous_response_id=fourth.id, input="last")
    assert record(module_redis.url, fifth.id)["conversation"] == "renamed"
    assert fifth.usage is not None and fifth.usage.input_tokens_details.cached_tokens > 0


def test_a_chain_without_a_key_is_named_by_its_first_response(
    cluster: TwoGateways, module_redis: RedisServer
) -> None:
    one, two = cluster.clients()
    root = two.responses.create(model=MODEL, input=f"say hello {time.time()}")
    assert record(module_redis.url, root.id)["conversation"] == root.id
    turn = root
    for client in (one, two):
        turn = client.responses.create(model=MODEL, previous_response_id=turn.id, input="on")
        assert record(module_redis.url, turn.id)["conversation"] == root.id
    # a first turn with only ``user`` is that user's conversation, as a chat would be
    user = f"user-{time.time()}"
    mine = one.responses.create(model=MODEL, input="hello", user=user)
    assert record(module_redis.url, mine.id)["conversation"] == user


def test_a_known_chain_on_a_gone_replica_is_still_a_404(
    cluster: TwoGateways, module_redis: RedisServer
) -> None:
    """The record names the chain's key, but no replica but the gone one holds the
    history: never a turn routed elsewhere by the key."""
    one, _ = cluster.clients()
    root = one.responses.create(model=MODEL, input="hello", prompt_cache_key="known-chain")
    gone = {**record(module_redis.url, root.id), "replica_id": "r-gone"}
    r = redis.Redis.from_url(module_redis.url)
    r.set("prefixgate:response:resp_on_gone", json.dumps(gone), ex=60)
    with pytest.raises(openai.NotFoundError, match="r-gone, which is gone"):
        one.responses.create(
            model=MODEL,
            previous_response_id="resp_on_gone",
            input="hi",
            prompt_cache_key="known-chain",
        )
    r.set("prefixgate:response:resp_garbled", "r0\nchain\ndefault", ex=60)  # not a record
    with pytest.raises(openai.NotFoundError, match="not found"):
        one.responses.create(model=MODEL, previous_response_id="resp_garbled", input="hi")


def test_concurrent_whole_answers_each_keep_their_own_status(
    cluster: TwoGateways, module_redis: RedisServer
) -> None:
    """Non-streamed responses at once: each one's id is recorded in Redis (an await)
    before it is sent, while its pooled connection already carries the next answer;
    each client still gets its own 200 (the next answer's head read 0 here: a crash)."""
    one, _ = cluster.clients()

    def ask(i: int) -> str:
        return one.responses.create(
            model=MODEL, input=f"n{i} {time.time()}", max_output_tokens=2
        ).id

    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(ask, range(96)))
    assert len(set(ids)) == 96
    assert all(record(module_redis.url, i)["conversation"] == i for i in ids)
