"""vLLM's token-in, token-out API through the gateway (gateway/tokens_api.py): samples of
one token-id prompt go where it went and read it cached; an abort reaches the replica
that runs the request, through the gateway that routed it or another, and never another
tenant's; the body's ``request_id`` names a request upstream as it does at vLLM; the
scale-out split's render endpoints pass through. The gateway answered these 404, and sent
its own request id in place of the body's (tests/gateway/test_request_ids.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.tokens_api import keyed_head
from tests.gateway.conftest import (
    Server,
    start_gateway,
    start_replica,
    stub_cluster,
    write_api_keys,
)

pytestmark = pytest.mark.timeout(180)

PROMPT = list(range(1000, 1200))  # 200 token ids: 12 blocks of 16
LONG = 3000  # generated tokens: seconds of decoding on tiny-random, for an abort to land


class Servers:
    def __init__(self, root: Path) -> None:
        self.replicas = [start_replica(root, f"replica-{i}") for i in range(2)]
        urls = [r.url for r in self.replicas]
        self.open = start_gateway(root, "open", urls)
        self.other = start_gateway(root, "other", urls)  # a second gateway, same replicas
        keys = str(write_api_keys(root / "keys.json"))
        self.keyed = start_gateway(root, "keyed", urls, "--api-keys", keys)

    def stop(self) -> None:
        for server in (self.open, self.other, self.keyed, *self.replicas):
            server.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("tokens-api"))
    yield s
    s.stop()


def _generate(gateway: Server, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(
        gateway.url + "/inference/v1/generate", json=body, headers=headers, timeout=60
    )


def _abort(gateway: Server, ids: list[str], **headers: str) -> httpx.Response:
    url = gateway.url + "/inference/v1/abort_requests"
    return httpx.post(url, json={"request_ids": ids}, headers=headers, timeout=30)


def test_samples_of_one_prompt_go_where_it_went_and_read_it_cached(servers: Servers) -> None:
    replicas, cached = [], []
    for seed in range(5):  # a group of samples, as a GRPO rollout sends them
        body = {
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": seed},
        }
        answer = _generate(servers.open, body)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"][0]["token_ids"]) == 4
        replicas.append(answer.headers["x-prefixgate-replica"])
        cached.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(set(replicas)) == 1, replicas
    assert cached[0] == 0 and min(cached[1:]) >= 12 * 16, cached
    # A rollout's next turn: the same prefix and more goes there too, and reads it cached.
    turn = {"token_ids": [*PROMPT, *range(5, 40)], "sampling_params": {"max_tokens": 2}}
    answer = _generate(servers.open, turn)
    assert answer.headers["x-prefixgate-replica"] == replicas[0]
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 12 * 16
    assert "matched=12/" in answer.headers["x-prefixgate-route"]


def test_a_stream_passes_through_and_ends_where_the_replica_ended_it(servers: Servers) -> None:
    body = {
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 5, "temperature": 0},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", servers.open.url + "/inference/v1/generate", json=body, timeout=60
    ) as stream:
        assert stream.status_code == 200
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    whole = _generate(servers.open, {**body, "stream": False}).json()
    assert ids == whole["choices"][0]["token_ids"] and len(ids) == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_the_body_request_id_names_the_request_upstream(servers: Servers) -> None:
    body = {"token_ids": PROMPT[:40], "sampling_params": {"max_tokens": 1}}
    named = _generate(servers.open, {**body, "request_id": "rollout-7-sample-2"})
    assert named.json()["request_id"] == "generate-tokens-rollout-7-sample-2"
    assert named.headers["x-request-id"] == "rollout-7-sample-2"
    # The header still wins, as at vLLM.
    both = _generate(servers.open, {**body, "request_id": "body-id"}, **{"x-request-id": "hdr"})
    assert both.json()["request_id"] == "generate-tokens-hdr"


def _long_stream(gateway: Server, request_id: str, **headers: str) -> httpx.Response:
    body = {
        "token_ids": PROMPT,
        "request_id": request_id,
        "sampling_params": {"max_tokens": LONG, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    client = httpx.Client(timeout=120)
    request = client.build_request(
        "POST", gateway.url + "/inference/v1/generate", json=body, headers=headers
    )
    return client.send(request, stream=True)


class Running:
    """A token API stream read past its first tokens: it is running on a replica."""

    def __init__(self, stream: httpx.Response) -> None:
        self.stream = stream
        self.lines = stream.iter_lines()
        self.finish: str | None = None
        self.tokens = 0
        for line in self.lines:
            if self._read(line):
                return
        raise AssertionError("the stream ended before its first tokens")

    def _read(self, line: str) -> bool:
        if not line.startswith("data: {"):
            return False
        for choice in json.loads(line[6:])["choices"]:
            self.tokens += len(choice["token_ids"])
            self.finish = choice["finish_reason"] or self.finish
        return True

    def to_end(self) -> tuple[str | None, int]:
        """(the last finish reason, the tokens generated)."""
        for line in self.lines:
            self._read(line)
        self.stream.close()
        return self.finish, self.tokens


def test_an_abort_reaches_the_replica_running_the_request(servers: Servers) -> None:
    stream = _long_stream(servers.open, "to-abort")
    running = Running(stream)
    one = httpx.post(  # one id, not in a list: vLLM takes it so
        servers.open.url + "/inference/v1/abort_requests",
        json={"request_ids": "generate-tokens-to-abort"},
        timeout=30,
    )
    assert one.status_code == 200
    finish, count = running.to_end()
    assert finish == "abort" and count < LONG, (finish, count)


def test_an_abort_through_another_gateway_reaches_it_too(servers: Servers) -> None:
    stream = _long_stream(servers.open, "routed-elsewhere")
    running = Running(stream)
    # `other` never saw the request: open mode sends the id to every replica.
    assert _abort(servers.other, ["generate-tokens-routed-elsewhere"]).status_code == 200
    finish, count = running.to_end()
    assert finish == "abort" and count < LONG, (finish, count)


def test_a_tenant_cannot_abort_another_tenants_request(servers: Servers) -> None:
    alpha = {"authorization": "Bearer sk-alpha"}
    beta = {"authorization": "Bearer sk-beta"}
    stream = _long_stream(servers.keyed, "shared-name", **alpha)
    running = Running(stream)
    assert _abort(servers.keyed, ["generate-tokens-shared-name"], **beta).status_code == 200
    assert running.to_end() == ("length", LONG)
    # Its own tenant can.
    stream = _long_stream(servers.keyed, "shared-name", **alpha)
    running = Running(stream)
    assert _abort(servers.keyed, ["generate-tokens-shared-name"], **alpha).status_code == 200
    finish, count = running.to_end()
    assert finish == "abort" and count < LONG, (finish, count)


def test_keyed_tenants_do_not_share_a_prompts_cache(servers: Servers) -> None:
    prompt = list(range(3000, 3160))  # 10 blocks, sent by no other test
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1}, "cache_salt": "mine"}

    def cached(key: str) -> int:
        answer = _generate(servers.keyed, body, authorization=f"Bearer {key}")
        assert answer.status_code == 200, answer.text
        return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("sk-alpha") == 0
    assert cached("sk-beta") == 0  # the client's cache_salt is replaced by the tenant's
    assert cached("sk-alpha") >= 9 * 16  # (the last token is always computed)


def test_bad_requests_get_the_replicas_answer_or_the_gateways_400(servers: Servers) -> None:
    empty = _generate(servers.open, {"token_ids": [], "sampling_params": {}})
    assert empty.status_code == 400 and "token_ids" in empty.text
    unknown = _generate(servers.open, {"token_ids": [1], "sampling_params": {}, "model": "x"})
    assert unknown.status_code == 404
    abort = httpx.post(
        servers.open.url + "/inference/v1/abort_requests", json={"request_ids": [1]}, timeout=10
    )
    assert abort.status_code == 400 and abort.json()["error"]["param"] == "request_ids"
    get = httpx.get(servers.open.url + "/inference/v1/generate", timeout=10)
    assert get.status_code == 405


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with stub_cluster(tmp_path_factory.mktemp("tokens-api-stubs"), "m") as cluster:
        yield cluster


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/v1/messages/render",
        "/v1/responses/render",  # not a stored response's id
        "/v1/chat/completions/derender",
        "/v2/embed",  # Cohere's embed API, which vLLM serves too
    ],
)
def test_the_scale_out_endpoints_pass_through(stubs: Any, path: str) -> None:
    answer = httpx.post(stubs.gateway.url + path, json={"model": "m"}, timeout=30)
    assert answer.status_code == 404  # the stub's own answer: it has no such endpoint
    assert answer.headers.get("x-prefixgate-replica") is not None
    assert stubs.received(path), f"{path} did not reach a replica"


def test_a_multimodal_prompt_is_keyed_up_to_its_first_image() -> None:
    ids = list(range(100))
    image = {
        "mm_hashes": {"image": ["h1"]},
        "mm_placeholders": {"image": [{"offset": 40, "length": 20}]},
    }
    assert keyed_head({"token_ids": ids}) == ids
    assert keyed_head({"token_ids": ids, "features": image}) == ids[:40]
    two = {
        "mm_placeholders": {
            "image": [{"offset": 70, "length": 5}],
            "audio": [{"offset": 33, "length": 2}],
        }
    }
    assert keyed_head({"token_ids": ids, "features": two}) == ids[:33]
    # Media the engine resolves (where its tokens fall is not said), or placeholders that
    # are not: nothing keyed. Not ids: the replica's 400.
    assert keyed_head({"token_ids": ids, "content_parts": [{"type": "image_url"}]}) == []
    assert (
        keyed_head({"token_ids": ids, "features": {"mm_placeholders": {"image": [{"offset": -1}]}}})
        == []
    )
    assert keyed_head({"token_ids": ids, "features": {"mm_hashes": {}}}) == []
    assert keyed_head({"token_ids": [1, "2"]}) is None and keyed_head({}) is None


def test_an_images_blocks_are_not_taken_for_another_images(servers: Servers) -> None:
    prompt = list(range(5000, 5200))  # 12 blocks, an image's placeholder from id 64 on
    features = {
        "mm_hashes": {"image": ["a"]},
        "mm_placeholders": {"image": [{"offset": 64, "length": 100}]},
    }
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1}, "features": features}
    answer = _generate(servers.open, body)  # the built-in replica takes no images: a 400
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "features"
    assert "matched=0/4;" in answer.headers["x-prefixgate-route"]  # the 4 blocks before it
