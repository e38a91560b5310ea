"""The gateway in front of two real tiny-random replicas and a real Redis, driven by the
official openai client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from gateway.auth import derived_salt
from prefixgate.tokenizer import ChatTokenizer
from router.protocol import (
    REPLICAS_SET,
    ROUTED_CHANNEL,
    BlockEvent,
    KeySpace,
    events_stream_key,
    replica_info_key,
    short_key,
)
from tests.conftest import RedisServer, wait_until
from tests.gateway.conftest import Server, start_gateway, start_replica, write_api_keys

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny-random"
SYSTEM = "You are a helpful assistant who answers briefly. " * 6


class Cluster:
    def __init__(self, root: Path, redis_url: str) -> None:
        flags = ["--num-blocks", "256", "--redis-url", redis_url]
        self.ids = ["r0", "r1"]
        self.replicas = [
            start_replica(root, f"replica{i}", *flags, "--replica-id", rid)
            for i, rid in enumerate(self.ids)
        ]
        urls = [r.url for r in self.replicas]
        self.open_gw = start_gateway(root, "gw-open", urls, "--redis-url", redis_url)
        keys = write_api_keys(root / "keys.json")
        self.keyed_gw = start_gateway(
            root, "gw-keyed", urls, "--redis-url", redis_url, "--api-keys", str(keys)
        )

    def replica_by_header(self, value: str) -> Server:
        # Static by URL and registered in Redis as r0/r1: the gateway names each by its id.
        return self.replicas[self.ids.index(value)]

    def stop(self) -> None:
        for server in [self.open_gw, self.keyed_gw, *self.replicas]:
            server.stop()


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("gw-replicas"), module_redis.url)
    yield c
    c.stop()


def gw(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.open_gw.url + "/v1", api_key="x", max_retries=0)


def chat(question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_chat_completions_stop_and_max_tokens(cluster: Cluster) -> None:
    c = gw(cluster)
    out = c.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=5, seed=1)
    assert out.usage is not None and out.usage.completion_tokens <= 5
    text = c.completions.create(model=MODEL, prompt="The cache", max_tokens=6, temperature=0)
    assert text.choices[0].finish_reason in {"length", "stop"}
    full = text.choices[0].text
    if len(full) > 2:
        stop = full[1:3]
        cut = c.completions.create(
            model=MODEL, prompt="The cache", max_tokens=6, temperature=0, stop=[stop]
        )
        assert stop not in cut.choices[0].text
    stream = c.chat.completions.create(
        model=MODEL,
        messages=chat("stream please"),
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4


def test_repeated_conversation_hits_the_cache_on_the_same_replica(cluster: Cluster) -> None:
    c = gw(cluster)
    first = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat("repeat me"), max_tokens=2
    )
    second = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat("repeat me"), max_tokens=2
    )
    assert first.headers["x-prefixgate-replica"] == second.headers["x-prefixgate-replica"]
    assert "x-request-id" in second.headers
    usage = second.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= 16


def test_gateway_keys_equal_the_replica_keys(cluster: Cluster, module_redis: RedisServer) -> None:
    question = f"key check {time.time()}"
    raw = gw(cluster).chat.completions.with_raw_response.create(
        model=MODEL, messages=chat(question), max_tokens=1
    )
    replica = raw.headers["x-prefixgate-replica"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    tokens = ChatTokenizer.for_model(MODEL).encode_chat(messages, add_generation_prompt=True)
    expected = [short_key(k) for k in KeySpace(MODEL, 16, "").keys(tokens)]
    assert (
        raw.headers["x-prefixgate-route"]
        .split("matched=")[1]
        .split(";")[0]
        .endswith(f"/{len(expected)}")
    )
    r = redis.Redis.from_url(module_redis.url)

    def stored() -> set[bytes]:
        """The keys that the replica the gateway names has published as stored."""
        keys: set[bytes] = set()
        for _, fields in r.xrange(events_stream_key(replica)) or []:
            event = BlockEvent.decode(fields)  # type: ignore[arg-type]
            if event.type == "stored":
                keys.update(event.keys)
        return keys

    wait_until(lambda: set(expected) <= stored(), what=f"{replica} storing the gateway's keys")


def test_tenants_do_not_share_cached_prefixes(cluster: Cluster) -> None:
    def ask(key: str) -> openai.types.CompletionUsage:
        c = openai.OpenAI(base_url=cluster.keyed_gw.url + "/v1", api_key=key, max_retries=0)
        out = c.chat.completions.create(model=MODEL, messages=chat("tenant secret"), max_tokens=1)
        assert out.usage is not None
        return out.usage

    ask("sk-alpha")
    warm = ask("sk-alpha")
    assert (
        warm.prompt_tokens_details is not None
        and (warm.prompt_tokens_details.cached_tokens or 0) > 0
    )
    other = ask("sk-beta")
    assert other.prompt_tokens_details is not None
    assert other.prompt_tokens_details.cached_tokens == 0
    assert derived_salt("alpha") != derived_salt("beta")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=cluster.keyed_gw.url + "/v1", api_key="bad", max_retries=0
        ).chat.completions.create(model=MODEL, messages=chat("x"), max_tokens=1)


def test_client_disconnect_frees_the_replica_blocks(cluster: Cluster) -> None:
    body = {"model": MODEL, "messages": chat("long answer"), "max_tokens": 400, "stream": True}
    with httpx.stream("POST", cluster.open_gw.url + "/v1/chat/completions", json=body) as r:
        replica = cluster.replica_by_header(r.headers["x-prefixgate-replica"])
        # The first event is the role chunk, which the replica sends before its engine
        # admits the request; the third is a second generated token, made in a step that
        # began after the replica's stats counted the request's pinned blocks. (After the
        # role chunk alone "no pinned blocks" held before the request ran, and it could
        # run on into the next test: a request that finishes after a prefix cache reset
        # registers its blocks again.) A stream that ends sooner has finished.
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in zip(range(3), events, strict=False):
            pass
    # The replica notices at its next engine step; on a loaded 2-core box that can be slow.
    wait_until(
        lambda: httpx.get(replica.url + "/cache/stats").json()["pinned_blocks"] == 0,
        timeout_s=60,
        what="no pinned blocks on the replica",
    )


def test_reset_prefix_cache_resets_every_replica_and_every_gateway_view(
    cluster: Cluster,
) -> None:
    c = gw(cluster)
    for question in ("reset a", "reset b", "reset c", "reset a"):
        c.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=1)
    keyed = cluster.keyed_gw.url + "/reset_prefix_cache"
    denied = httpx.post(keyed)
    assert denied.status_code == 401 and "error" in denied.json()
    forbidden = httpx.post(keyed, headers={"authorization": "Bearer sk-alpha"})
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "forbidden"

    reset = httpx.post(cluster.open_gw.url + "/reset_prefix_cache", timeout=60)
    assert reset.status_code == 200, reset.text
    replicas = reset.json()["replicas"]
    assert sorted(replicas) == cluster.ids
    assert all(isinstance(r["seq"], int) and "warning" not in r for r in replicas.values())
    for server in cluster.replicas:
        assert httpx.get(server.url + "/cache/stats").json()["cached_blocks"] == 0
    # The resetting gateway has folded in both replicas' cleared events before answering.
    stats = httpx.get(cluster.open_gw.url + "/router/stats").json()
    for rid, view in stats["replicas"].items():
        assert view["blocks"] == 0 and view["last_seq"] >= replicas[rid]["seq"], stats

    # Another gateway learns it from the events (hints of the requests before the reset
    # may still reach it afterwards: those stay optimistic, and expire unconfirmed).
    def other_view() -> dict[str, dict[str, int]]:
        """The other gateway's replica views once it has folded in both cleared events
        (empty until then)."""
        other = httpx.get(
            cluster.keyed_gw.url + "/router/stats", headers={"authorization": "Bearer sk-ops"}
        ).json()["replicas"]
        caught_up = all(v["last_seq"] >= replicas[rid]["seq"] for rid, v in other.items())
        return other if caught_up else {}

    other = wait_until(other_view, what="the other gateway folding in the cleared events")
    assert all(v["blocks"] == v["optimistic_blocks"] for v in other.values()), other

    admin = httpx.post(keyed, headers={"authorization": "Bearer sk-ops"}, timeout=60)
    assert admin.status_code == 200, admin.text

    cold = c.chat.completions.create(model=MODEL, messages=chat("reset a"), max_tokens=1)
    warm = c.chat.completions.create(model=MODEL, messages=chat("reset a"), max_tokens=1)
    assert cold.usage is not None and cold.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    assert (warm.usage.prompt_tokens_details.cached_tokens or 0) > 0


def test_a_replica_killed_mid_run_fails_no_plain_request(cluster: Cluster) -> None:
    c = gw(cluster)
    victim = cluster.replicas[1]
    for i in range(6):
        if i == 2:
            victim.stop()
        out = c.completions.create(model=MODEL, prompt=f"survive {i}", max_tokens=2)
        assert out.choices


def test_unreadable_redis_data_neither_stops_nor_blinds_a_gateway(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A registry record and a hint no gateway can read (another version's, a bug's)
    are skipped: before, the record raised out of the gateway's start-up."""
    client = redis.Redis.from_url(redis_server.url)
    client.sadd(REPLICAS_SET, "junk")
    client.set(replica_info_key("junk"), b"\xff not a record")
    gateway = start_gateway(tmp_path, "gw", [], "--redis-url", redis_server.url, ready=False)
    replica = start_replica(
        tmp_path, "replica", "--num-blocks", "256", "--redis-url", redis_server.url,
        "--replica-id", "r0",
    )  # fmt: skip
    try:
        client.publish(ROUTED_CHANNEL, b'{"g": 1}')
        wait_until(
            lambda: httpx.get(gateway.url + "/ready").status_code == 200,
            what="the gateway finding r0 in the registry",
        )
        c = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        first, again = (
            c.chat.completions.create(model=MODEL, messages=chat("still here"), max_tokens=1)
            for _ in range(2)
        )
        assert first.choices and again.usage and again.usage.prompt_tokens_details
        assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 0
        stats = httpx.get(gateway.url + "/router/stats").json()
        assert list(stats["replicas"]) == ["r0"]
        assert stats["sync"]["connected"] and stats["sync"]["malformed"] >= 2, stats["sync"]
    finally:
        replica.stop()
        gateway.stop()
        client.close()
