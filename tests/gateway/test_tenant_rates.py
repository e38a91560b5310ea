"""A tenant's ``rpm_limit`` and ``tpm_limit`` (gateway/auth.py, gateway/tenant_rates.py):
its requests and tokens per minute, a 429 that says when to retry past them, shared by
the gateways that share a Redis. Without them a key meant for a trial could use the
whole cluster all day."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.auth import parse_api_keys
from gateway.messages_hooks import MessagesScanner
from gateway.responses_hooks import ResponsesScanner
from gateway.tenant_rates import Limits, TenantRates, duration
from gateway.usage import SSEScanner, usage_in
from tests.conftest import RedisServer
from tests.gateway.conftest import start_gateway, start_stub

pytestmark = pytest.mark.timeout(180)

MODEL = "rate-model"
KEYS = {
    "sk-trial": {"tenant": "trial", "rpm_limit": 3},
    "sk-tokens": {"tenant": "tokens", "tpm_limit": 120},
    "sk-burst": {"tenant": "burst", "rpm_limit": 30},
    "sk-shared": {"tenant": "shared", "rpm_limit": 4},
    "sk-free": {"tenant": "free"},
    "sk-count": {"tenant": "count"},
}
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _header(verdict_headers: tuple[tuple[bytes, bytes], ...], name: str) -> str:
    return dict(verdict_headers)[name.encode()].decode()


def test_requests_pass_one_minutes_worth_then_at_the_limits_rate() -> None:
    clock = Clock()
    rates = TenantRates(limits={"t": Limits(rpm=3)}, monotonic=clock)
    verdicts = [asyncio.run(rates.admit("t")) for _ in range(4)]
    assert [v.admitted for v in verdicts] == [True, True, True, False]
    assert [_header(v.headers, "x-ratelimit-remaining-requests") for v in verdicts] == [
        "2",
        "1",
        "0",
        "0",
    ]
    refused = verdicts[-1]
    assert refused.refused_by == "requests"
    assert refused.wait_s == pytest.approx(20.0)  # one request refills in 60 s / 3
    assert _header(refused.headers, "retry-after") == "20"
    assert _header(refused.headers, "retry-after-ms") == "20000"
    clock.now += 19.9
    assert not asyncio.run(rates.admit("t")).admitted
    clock.now += 0.2
    assert asyncio.run(rates.admit("t")).admitted
    clock.now += 3600  # refilled to the limit, not past it
    assert [asyncio.run(rates.admit("t")).admitted for _ in range(4)] == [True] * 3 + [False]


def test_tokens_are_charged_after_the_answer_down_to_one_minutes_debt() -> None:
    clock = Clock()
    rates = TenantRates(limits={"t": Limits(tpm=600)}, monotonic=clock)
    first = asyncio.run(rates.admit("t"))
    assert first.admitted and _header(first.headers, "x-ratelimit-remaining-tokens") == "600"
    rates.charge("t", 1000)  # one answer used more than the minute's tokens
    refused = asyncio.run(rates.admit("t"))
    assert not refused.admitted and refused.refused_by == "tokens"
    assert refused.wait_s == pytest.approx((1 + 400) * 60 / 600)  # until one token is back
    rates.charge("t", 10**9)  # a debt of at most one minute's tokens
    assert asyncio.run(rates.admit("t")).wait_s == pytest.approx(601 * 60 / 600)
    clock.now += 60.2
    assert asyncio.run(rates.admit("t")).admitted
    rates.charge("free", 10**9)  # a tenant without limits: nothing to charge
    assert rates.local.keys() == {"t"}


def test_both_limits_refuse_on_the_one_that_is_spent() -> None:
    clock = Clock()
    rates = TenantRates(limits={"t": Limits(rpm=100, tpm=100)}, monotonic=clock)
    assert asyncio.run(rates.admit("t")).admitted
    rates.charge("t", 150)
    refused = asyncio.run(rates.admit("t"))
    assert (refused.admitted, refused.refused_by) == (False, "tokens")
    assert _header(refused.headers, "x-ratelimit-remaining-requests") == "99"
    assert _header(refused.headers, "x-ratelimit-reset-tokens") == "1m30s"


def test_a_limit_given_later_starts_full() -> None:
    """The keys file may give a tenant a limit it did not have (gateway/keys_file.py)."""
    clock = Clock()
    rates = TenantRates(limits={"t": Limits(tpm=100)}, monotonic=clock)
    assert all(asyncio.run(rates.admit("t")).admitted for _ in range(5))
    rates.limits = {"t": Limits(rpm=3, tpm=100)}
    assert [asyncio.run(rates.admit("t")).admitted for _ in range(4)] == [True] * 3 + [False]


def test_reset_times_read_as_openais() -> None:
    assert [duration(s) for s in (0.0, 0.02, 1.5, 59.0, 90.0, 360.0)] == [
        "0ms",
        "20ms",
        "1.5s",
        "59s",
        "1m30s",
        "6m0s",
    ]


def test_the_keys_file_takes_positive_limits_one_per_tenant() -> None:
    tenant = parse_api_keys({"k": {"tenant": "t", "rpm_limit": 5, "tpm_limit": 900}})["k"]
    assert (tenant.rpm_limit, tenant.tpm_limit) == (5, 900)
    for name in ("rpm_limit", "tpm_limit"):
        for bad in (0, -1, True, "4", 1.5, 10**15 + 1, 10**400):
            with pytest.raises(ValueError, match=name):
                parse_api_keys({"k": {"tenant": "t", name: bad}})
        two = {"a": {"tenant": "t", name: 2}, "b": {"tenant": "t", name: 3}}
        with pytest.raises(ValueError, match="one limit per tenant"):
            parse_api_keys(two)


def test_answers_say_the_tokens_they_used() -> None:
    chat = {
        "choices": [],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }
    assert usage_in(json.dumps(chat).encode()) == (7, 3)
    assert usage_in(b'{"usage": {"input_tokens": 9, "output_tokens": 4}}') == (9, 4)
    assert usage_in(b'{"usage": {"prompt_tokens": 5, "total_tokens": 5}}') == (5, 0)  # embeddings
    assert usage_in(b'{"usage": {"total_tokens": 6}}') == (6, 0)
    # Only the usage is read: a "usage" in the text is escaped, and the last key wins.
    text = {"choices": [{"text": 'say "usage": {"prompt_tokens": 99}'}], "usage": chat["usage"]}
    assert usage_in(json.dumps(text).encode()) == (7, 3)
    for none in (
        b'{"usage": null}',
        b"[]",
        b'{"usage": {"total_tokens": -1}}',
        b'{"usage": {"prompt_tokens": true}}',
        b'{"usage": {"prompt_tokens": 3',
        b'{"usage" {}}',
    ):
        assert usage_in(none) is None

    stream = SSEScanner()
    stream.feed(b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n')
    stream.feed(b'data: {"choices":[{"delta":{"content":"b"}}],"usage":null}\n\n')
    assert (stream.outputs, stream.usage) == (2, None)  # no usage: estimated from these
    stream.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3,"total_tokens":5,')
    stream.feed(b'"completion_tokens":2}}\n\ndata: [DONE]\n\n')
    assert (stream.outputs, stream.usage) == (2, (3, 2))

    messages = MessagesScanner()
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 8, "output_tokens": 1}}}
    delta = {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 5}}
    for kind, data in (("message_start", start), ("message_delta", delta)):
        messages.feed(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
    assert messages.usage == (8, 5)

    responses = ResponsesScanner()
    usage = {"input_tokens": 15, "output_tokens": 6, "total_tokens": 21}
    done = {"type": "response.completed", "response": {"id": "r", "usage": usage}}
    responses.feed(f"event: response.completed\ndata: {json.dumps(done)}\n\n".encode())
    assert responses.usage == (15, 6)


def test_gateways_sharing_a_redis_share_the_buckets(redis_server: RedisServer) -> None:
    async def run() -> None:
        limits = {"t": Limits(rpm=4, tpm=100)}
        first = TenantRates(redis_server.url, limits=dict(limits))
        second = TenantRates(redis_server.url, limits=dict(limits))
        try:
            verdicts = await asyncio.gather(
                *(gateway.admit("t") for gateway in (first, second) * 3)
            )
            assert sorted(v.admitted for v in verdicts) == [False] * 2 + [True] * 4
            first.charge("t", 500)  # tokens used at one gateway hold the tenant at both
            await asyncio.gather(*first.charges)
            refused = await second.admit("t")
            assert (refused.admitted, refused.refused_by) == (False, "tokens")
            assert refused.wait_s == pytest.approx(101 * 60 / 100, abs=1)
            assert not first.local and not second.local  # all kept in Redis
            # A limit given later starts full in Redis too.
            first.limits = {"u": Limits(tpm=100)}
            assert all([(await first.admit("u")).admitted for _ in range(5)])
            first.limits = {"u": Limits(rpm=2, tpm=100)}
            later = [(await first.admit("u")).admitted for _ in range(3)]
            assert later == [True, True, False]
            redis_server.stop()  # Redis gone: each gateway goes on with buckets of its own
            assert (await second.admit("t")).admitted
            assert second.local.keys() == {"t"}
        finally:
            await first.aclose()
            await second.aclose()

    asyncio.run(run())


class Servers:
    def __init__(self, root: Path) -> None:
        self.stub = start_stub(root, "stub", "--model", MODEL)
        keys = root / "keys.json"
        keys.write_text(json.dumps(KEYS))
        self.gateway = start_gateway(root, "keyed", [self.stub.url], "--api-keys", str(keys))

    def client(self, key: str, retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=key, max_retries=retries)

    def stop(self) -> None:
        self.gateway.stop()
        self.stub.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("tenant-rates"))
    yield s
    s.stop()


def test_a_tenant_past_its_rpm_gets_429_with_when_to_retry(servers: Servers) -> None:
    client = servers.client("sk-trial")
    remaining = []
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT)
        remaining.append(raw.headers["x-ratelimit-remaining-requests"])
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert remaining == ["2", "1", "0"]
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT)
    assert refused.value.code == "rpm_limit"
    assert 18 <= int(refused.value.response.headers["retry-after"]) <= 20
    # Another tenant, and a tenant without limits, are not held back.
    free = servers.client("sk-free").chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
    )
    assert "x-ratelimit-limit-requests" not in free.headers


def test_the_openai_clients_own_retry_waits_as_told_and_passes(servers: Servers) -> None:
    """30 a minute: after the burst of 30, the 31st waits the 2 s the 429 names
    (``retry-after-ms``), in the client's own retry, and is answered."""
    client = servers.client("sk-burst", retries=2)
    for _ in range(30):
        client.chat.completions.create(model=MODEL, messages=CHAT)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT)
    assert raw.retries_taken >= 1
    assert raw.http_response.status_code == 200


def test_tokens_used_are_charged_streamed_or_not(servers: Servers) -> None:
    """tpm 120: a refill of two tokens a second. The stub's answers use 8 prompt tokens
    and 4 generated ones (4 content chunks when streamed), and say so in their usage,
    except a stream that was not asked for it: then the gateway counts."""
    client = servers.client("sk-tokens")

    def remaining() -> int:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=CHAT,
        )
        return int(raw.headers["x-ratelimit-remaining-tokens"])

    before = remaining()  # then charged 12
    after = remaining()
    assert before - 12 <= after <= before - 12 + 4  # refilled 2 a second
    with client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        stream=True,
        stream_options={"include_usage": True},
    ) as stream:
        assert sum(1 for _ in stream) == 5  # 4 chunks and the usage
    reported = remaining()
    assert after - 24 <= reported <= after - 24 + 4
    with client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        stream=True,
    ) as stream:
        assert sum(1 for _ in stream) == 4
    counted = remaining()
    assert counted <= reported - 12 - 4 + 4  # its 4 events and its prompt, as counted here
    with pytest.raises(openai.RateLimitError) as refused:  # spent: refused until one is back
        for _ in range(counted // 12 + 2):
            remaining()
    assert refused.value.code == "tpm_limit"
    assert refused.value.response.headers["x-ratelimit-remaining-tokens"] == "0"


def _tenant_series(gateway_url: str, tenant: str) -> dict[str, float]:
    text = httpx.get(gateway_url + "/metrics", timeout=10).text
    series = {}
    for line in text.splitlines():
        if line.startswith("prefixgate_gateway_tenant_") and f'tenant="{tenant}"' in line:
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series


def test_each_tenants_use_is_counted_in_the_metrics(servers: Servers) -> None:
    """A tenant without limits too: its requests and tokens, for chargeback."""
    client = servers.client("sk-count")
    client.chat.completions.create(model=MODEL, messages=CHAT)  # usage: 8 in, 4 out
    with client.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}
    ) as stream:
        assert sum(1 for _ in stream) == 5  # the same, said in its last event
    with client.chat.completions.create(model=MODEL, messages=CHAT, stream=True) as stream:
        assert sum(1 for _ in stream) == 4  # no usage: 4 output events, the prompt counted
    series = _tenant_series(servers.gateway.url, "count")
    requests = 'prefixgate_gateway_tenant_requests_total{status="200",tenant="count"}'
    assert series[requests] == 3
    assert series['prefixgate_gateway_tenant_tokens_total{kind="output",tenant="count"}'] == 12
    counted = series['prefixgate_gateway_tenant_tokens_total{kind="input",tenant="count"}'] - 16
    assert 1 <= counted <= 64  # the gateway's count of a two-letter chat's prompt


def test_gateways_sharing_a_redis_share_the_rpm(tmp_path: Path, redis_server: RedisServer) -> None:
    stub = start_stub(tmp_path, "stub", "--model", MODEL)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    flags = ("--api-keys", str(keys), "--redis-url", redis_server.url)
    gateways = [start_gateway(tmp_path, name, [stub.url], *flags) for name in ("first", "second")]
    try:

        async def at_once() -> list[int]:  # three at each gateway, in the same moment
            async with httpx.AsyncClient(timeout=30) as client:
                answers = await asyncio.gather(
                    *(
                        client.post(
                            gateway.url + "/v1/chat/completions",
                            json={"model": MODEL, "messages": CHAT},
                            headers={"authorization": "Bearer sk-shared"},
                        )
                        for gateway in gateways * 3
                    )
                )
            return sorted(r.status_code for r in answers)

        assert asyncio.run(at_once()) == [200] * 4 + [429] * 2  # four in all, not four each
    finally:
        for gateway in gateways:
            gateway.stop()
        stub.stop()
