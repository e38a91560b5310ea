"""The gateway in front of stub OpenAI servers (foreign backends: no events, a model the
gateway cannot tokenize): pass-through, headers, tenants, every failure path."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.auth import derived_salt
from prefixgate.procs import free_port
from tests.conftest import wait_until
from tests.gateway.conftest import Server, start_gateway, start_stub, write_api_keys

pytestmark = pytest.mark.timeout(120)


class Stack:
    def __init__(self, root: Path) -> None:
        self.a = start_stub(root, "a", "--model", "foreign-llm")
        self.b = start_stub(root, "b", "--model", "foreign-llm")
        self.flaky_bad = start_stub(
            root, "flaky-bad", "--model", "flaky-llm", "--fail-status", "500"
        )
        self.flaky_ok = start_stub(root, "flaky-ok", "--model", "flaky-llm")
        self.text_fail = start_stub(
            root,
            "text-fail",
            "--model",
            "text-fail",
            "--fail-status",
            "503",
            "--fail-body",
            "upstream exploded",
        )
        self.broken = start_stub(root, "broken", "--model", "broken-llm", "--break-after", "2")
        self.slow = start_stub(root, "slow", "--model", "slow-llm", "--delay-ms", "20000")
        self.dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
        self.stubs = [
            self.a, self.b, self.flaky_bad, self.flaky_ok, self.text_fail, self.broken, self.slow
        ]  # fmt: skip
        urls = [s.url for s in self.stubs] + [self.dead]
        keys = write_api_keys(root / "keys.json")
        self.gw = start_gateway(
            root, "gateway", urls, "--api-keys", str(keys), "--model", "dead-llm"
        )
        # Open mode, slow probes (retries are then seen, not pre-empted by the breaker).
        # ``gone`` answers the gateway's first probe and is stopped by the test that
        # needs a refused connection (a replica never probed healthy takes no traffic).
        self.gone = start_stub(root, "gone", "--model", "foreign-llm")
        self.c = start_stub(root, "c", "--model", "foreign-llm")
        self.open_gw = start_gateway(
            root, "open-gateway", [self.gone.url, self.c.url], "--model", "foreign-llm",
            "--probe-interval-s", "60", "--max-body-mb", "0.01",
        )  # fmt: skip

    def stop(self) -> None:
        for server in [self.gw, self.open_gw, *self.stubs, self.c, self.gone]:
            server.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("gw-stub"))
    yield s
    s.stop()


def client(stack: Stack, key: str = "sk-alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gw.url + "/v1", api_key=key, max_retries=0)


def last_request(server: Server) -> dict:
    return httpx.get(server.url + "/stub/requests").json()[-1]


CHAT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "hello from the gateway tests"}
]


def test_chat_and_completions_pass_through(stack: Stack) -> None:
    c = client(stack)
    chat = c.chat.completions.create(model="foreign-llm", messages=CHAT, max_tokens=4)
    assert chat.choices[0].message.content == "tok0 tok1 tok2 tok3 "
    text = c.completions.create(model="foreign-llm", prompt="once upon a time", max_tokens=4)
    assert text.choices[0].text == "tok0 tok1 tok2 tok3 "
    assert text.usage is not None and text.usage.prompt_tokens_details is not None
    stream = c.chat.completions.create(
        model="foreign-llm", messages=CHAT, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == (
        "tok0 tok1 tok2 tok3 "
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_async_streaming_completion(stack: Stack) -> None:
    async def run() -> str:
        c = openai.AsyncOpenAI(base_url=stack.gw.url + "/v1", api_key="sk-beta", max_retries=0)
        stream = await c.completions.create(model="foreign-llm", prompt="abc", stream=True)
        parts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        await c.close()
        return "".join(parts)

    assert asyncio.run(run()) == "tok0 tok1 tok2 tok3 "


def test_headers_and_request_id(stack: Stack) -> None:
    c = client(stack)
    raw = c.chat.completions.with_raw_response.create(
        model="foreign-llm", messages=CHAT, extra_headers={"x-request-id": "req-given-1"}
    )
    assert raw.headers["x-request-id"] == "req-given-1"
    replica = raw.headers["x-prefixgate-replica"]
    assert replica in {stack.a.url.split("//")[1], stack.b.url.split("//")[1]}
    assert "matched=" in raw.headers["x-prefixgate-route"]
    server = stack.a if replica == stack.a.url.split("//")[1] else stack.b
    assert last_request(server)["headers"]["x-request-id"] == "req-given-1"
    generated = c.chat.completions.with_raw_response.create(model="foreign-llm", messages=CHAT)
    assert len(generated.headers["x-request-id"]) >= 16


def test_unknown_fields_and_tenant_salt_are_forwarded(stack: Stack) -> None:
    raw = client(stack, "sk-alpha").chat.completions.with_raw_response.create(
        model="foreign-llm",
        messages=CHAT,
        extra_body={"vendor_field": {"x": [1, 2]}, "cache_salt": "chosen-by-client"},
    )
    served = stack.a if raw.headers["x-prefixgate-replica"] in stack.a.url else stack.b
    seen = last_request(served)
    assert seen["body"]["vendor_field"] == {"x": [1, 2]}
    assert seen["body"]["cache_salt"] == derived_salt("alpha")  # the client cannot pick it
    assert "authorization" not in seen["headers"]  # the gateway's key stays here
    raw = client(stack, "sk-shared").chat.completions.with_raw_response.create(
        model="foreign-llm", messages=CHAT, extra_body={"cache_salt": derived_salt("alpha")}
    )
    served = stack.a if raw.headers["x-prefixgate-replica"] in stack.a.url else stack.b
    assert "cache_salt" not in last_request(served)["body"]  # shared namespace: no salt


def test_auth_required_when_keys_are_configured(stack: Stack) -> None:
    for headers in ({}, {"authorization": "Bearer sk-wrong"}):
        r = httpx.post(
            stack.gw.url + "/v1/chat/completions",
            json={"model": "foreign-llm", "messages": CHAT},
            headers=headers,
        )
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(stack, "sk-wrong").models.list()


def test_shared_prefix_is_known_at_once_without_events(stack: Stack) -> None:
    # The stubs publish no block events: only the gateway's optimistic inserts can tell
    # it who holds the prefix. Every request after the first finds it (prefix_match on
    # the holder, or spill when the cost model predicts the other sooner).
    prefix = "You are a careful assistant. " * 40
    c = client(stack, "sk-beta")
    routes = [
        c.completions.with_raw_response.create(
            model="foreign-llm", prompt=prefix + f"question {i}"
        ).headers
        for i in range(6)
    ]
    reasons = [r["x-prefixgate-route"].split(";")[0].split(" ")[0] for r in routes[1:]]
    assert set(reasons) <= {"prefix_match", "spill"}, reasons
    assert "prefix_match" in reasons, reasons


def test_5xx_before_first_byte_is_retried_on_another_replica(stack: Stack) -> None:
    c = client(stack)
    for i in range(12):
        out = c.completions.create(model="flaky-llm", prompt=f"retry me {i}")
        assert out.choices[0].text == "tok0 tok1 tok2 tok3 "
    metrics = httpx.get(stack.gw.url + "/metrics").text
    assert "prefixgate_gateway_retries_total" in metrics
    retries = [
        ln for ln in metrics.splitlines() if ln.startswith("prefixgate_gateway_retries_total")
    ]
    assert float(retries[0].split()[-1]) >= 1


def test_upstream_error_body_is_wrapped_and_status_kept(stack: Stack) -> None:
    r = httpx.post(
        stack.gw.url + "/v1/completions",
        json={"model": "text-fail", "prompt": "x"},
        headers={"authorization": "Bearer sk-alpha"},
    )
    assert r.status_code == 503
    error = r.json()["error"]
    assert "upstream exploded" in error["message"] and error["type"] == "server_error"


def test_failure_mid_stream_ends_with_an_error_event(stack: Stack) -> None:
    with httpx.stream(
        "POST",
        stack.gw.url + "/v1/completions",
        json={"model": "broken-llm", "prompt": "x", "stream": True},
        headers={"authorization": "Bearer sk-alpha"},
    ) as r:
        events = [e for e in r.read().decode().split("\n\n") if e.strip()]
    assert r.status_code == 200
    assert len(events) == 4 and events[-1] == "data: [DONE]"  # two chunks, the error, [DONE]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "upstream_error"
    stream = client(stack).completions.create(model="broken-llm", prompt="x", stream=True)
    with pytest.raises(openai.APIError):
        list(stream)


def test_unknown_model_is_404(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client(stack).chat.completions.create(model="no-such-model", messages=CHAT)
    assert err.value.code == "model_not_found"
    names = {m.id for m in client(stack).models.list()}
    assert {"foreign-llm", "flaky-llm"} <= names and "dead-llm" not in names


def test_no_healthy_replica_is_503_with_retry_after(stack: Stack) -> None:
    """dead-llm's only replica never answered a probe: it takes no traffic at all."""
    for _ in range(3):
        r = httpx.post(
            stack.gw.url + "/v1/completions",
            json={"model": "dead-llm", "prompt": "x"},
            headers={"authorization": "Bearer sk-alpha"},
        )
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "no_healthy_replica"


def test_open_mode_retries_a_refused_connection(stack: Stack) -> None:
    stack.gone.stop()  # probed healthy at the start, refused from now on
    c = openai.OpenAI(base_url=stack.open_gw.url + "/v1", api_key="unused", max_retries=0)
    for i in range(8):
        out = c.completions.create(
            model="foreign-llm", prompt=f"open {i}", extra_body={"cache_salt": "mine"}
        )
        assert out.choices[0].text == "tok0 tok1 tok2 tok3 "
    assert last_request(stack.c)["body"]["cache_salt"] == "mine"  # open mode: the client's
    metrics = httpx.get(stack.open_gw.url + "/metrics").text
    assert 'kind="ConnectError"' in metrics or "ConnectTimeout" in metrics


def test_body_over_the_limit_is_413(stack: Stack) -> None:
    r = httpx.post(
        stack.open_gw.url + "/v1/completions",
        json={"model": "foreign-llm", "prompt": "x" * 20_000},
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_client_leaving_a_plain_request_cancels_it_upstream(stack: Stack) -> None:
    body = {"model": "slow-llm", "messages": CHAT}
    headers = {"Authorization": "Bearer sk-alpha"}
    with pytest.raises(httpx.ReadTimeout):  # the stub answers after 20 s
        httpx.post(stack.gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=1)
    replica = stack.slow.url.removeprefix("http://")
    gone = f'endpoint="chat",replica="{replica}",status="499"'
    idle = f'prefixgate_gateway_replica_in_flight{{replica="{replica}"}} 0.0'

    def left_and_idle() -> bool:
        metrics = httpx.get(stack.gw.url + "/metrics").text
        return gone in metrics and idle in metrics

    wait_until(left_and_idle, what="the request recorded as 499 and nothing in flight")


def test_health_ready_metrics(stack: Stack) -> None:
    assert httpx.get(stack.gw.url + "/health").status_code == 200
    ready = httpx.get(stack.gw.url + "/ready")
    assert ready.status_code == 200 and ready.json()["healthy_replicas"]
    n = len(ready.json()["healthy_replicas"])
    assert httpx.get(stack.gw.url + f"/ready?min_replicas={n}").status_code == 200
    not_yet = httpx.get(stack.gw.url + f"/ready?min_replicas={n + 1}")
    assert not_yet.status_code == 503 and not not_yet.json()["ready"]
    bad = httpx.get(stack.gw.url + "/ready?min_replicas=all")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_replicas"
    metrics = httpx.get(stack.gw.url + "/metrics").text
    for name in (
        "prefixgate_gateway_requests_total",
        "prefixgate_gateway_ttft_seconds_bucket",
        "prefixgate_gateway_request_seconds_bucket",
        "prefixgate_gateway_routing_decisions_total",
        "prefixgate_gateway_breaker_state",
        "prefixgate_gateway_predicted_cached_tokens_total",
    ):
        assert name in metrics, name
