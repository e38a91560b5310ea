"""One real tiny-random replica under uvicorn, driven with the official openai client.

One replica process and one Redis for the whole module (see conftest.py). The last test
restarts Redis, so it stays last.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis

from router.protocol import (
    REPLICAS_SET,
    BlockEvent,
    KeySpace,
    ReplicaInfo,
    decode_snapshot,
    events_stream_key,
    replica_info_key,
    short_key,
    snapshot_key,
)
from tests.conftest import RedisServer, wait_until
from tests.replica.conftest import MODEL, ReplicaProcess

SYSTEM = (
    "You are a careful assistant for a logistics company. Answer in one short sentence, "
    "cite the policy section you used, and never invent tracking numbers or dates. "
) * 3


def _chat(client: openai.OpenAI, question: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=kwargs.pop("max_tokens", 8),
        temperature=kwargs.pop("temperature", 0.0),
        **kwargs,
    )


def _replica_id(replica: ReplicaProcess) -> str:
    return f"127.0.0.1:{replica.port}"


def _events(client: redis.Redis, replica_id: str) -> list[BlockEvent]:
    entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(events_stream_key(replica_id))  # type: ignore[assignment]
    return [BlockEvent.decode(fields) for _, fields in entries]


def test_tools_on_a_template_that_ignores_them(replica: ReplicaProcess) -> None:
    """tiny-random's own template never reads ``tools``: they are ignored as vLLM ignores
    them, the replica warns once; without --tool-call-parser a tool choice that needs one
    is a 400 naming the flag. (Its own prompt: later tests expect SYSTEM uncached.)"""
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages: Any = [{"role": "user", "content": "tools ignored by this template"}]
    client = replica.client()
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    for _ in range(2):
        out = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, tools=tools, tool_choice="none"
        )
        assert out.usage is not None and plain.usage is not None
        assert out.usage.prompt_tokens == plain.usage.prompt_tokens
    assert replica.log_path.read_text().count("never reads `tools`") == 1
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        client.chat.completions.create(model=MODEL, messages=messages, tools=tools)


def test_models_and_health(replica: ReplicaProcess) -> None:
    ids = [m.id for m in replica.client().models.list().data]
    assert ids == [MODEL]
    health = replica.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_chat_repeated_prompt_reports_cached_tokens(replica: ReplicaProcess) -> None:
    client = replica.client()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where?"}],
        max_tokens=6,
        temperature=0.0,
        extra_headers={"x-request-id": "req-abc-123"},
    )
    assert raw.headers["x-request-id"] == "req-abc-123"
    first = raw.parse()
    assert first.object == "chat.completion"
    assert first.id.startswith("chatcmpl-")
    assert first.model == MODEL
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage is not None and first.usage.prompt_tokens > 64
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    second = _chat(client, "Where?", max_tokens=6)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 64
    assert cached < second.usage.prompt_tokens  # at least one prompt token is computed
    # Greedy output is the same with and without the cache.
    assert second.choices[0].message.content == first.choices[0].message.content

    # Without x-request-id the server makes one up.
    generated = client.models.with_raw_response.list().headers.get("x-request-id")
    assert generated and generated != "req-abc-123"


def test_answer_ids_are_made_of_the_requests_name_as_vllms(replica: ReplicaProcess) -> None:
    """vLLM's answer id is ``chatcmpl-`` (``cmpl-``) and the ``x-request-id`` header,
    else the body's ``request_id``; the replica's were random, so behind a gateway an
    answer's id was not its log line's."""
    client = replica.client()
    one: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    chat = {**one, "messages": [{"role": "user", "content": "Name?"}]}
    by_header = client.chat.completions.create(**chat, extra_headers={"x-request-id": "h-1"})
    assert by_header.id == "chatcmpl-h-1"
    by_body = client.chat.completions.create(**chat, extra_body={"request_id": "b-2"})
    assert by_body.id == "chatcmpl-b-2"
    both = client.chat.completions.create(
        **chat, extra_body={"request_id": "b-3"}, extra_headers={"x-request-id": "h-3"}
    )
    assert both.id == "chatcmpl-h-3"  # the header first, as vLLM
    # A header the replica refused (a space in it) names nothing: the body's does.
    bad = client.chat.completions.create(
        **chat, extra_body={"request_id": "b-4"}, extra_headers={"x-request-id": "a b"}
    )
    assert bad.id == "chatcmpl-b-4"
    first, second = (client.chat.completions.create(**chat).id for _ in range(2))
    assert first != second and first.startswith("chatcmpl-")
    batch = client.completions.create(
        **one, prompt=["one", "two"], extra_body={"request_id": "batch-5"}
    )
    assert batch.id == "cmpl-batch-5"
    stream = client.completions.create(
        **one, prompt="one", stream=True, extra_headers={"x-request-id": "s-6"}
    )
    assert {chunk.id for chunk in stream} == {"cmpl-s-6"}


def test_two_requests_named_alike_are_two_requests(replica: ReplicaProcess) -> None:
    """A client may name two requests alike (one ``x-request-id`` for a whole session):
    the answers share the name, the engine runs them apart. Named by their answer's id,
    the second took the first's place in the engine."""
    client = replica.async_client(timeout=30)  # a clobbered request never ends
    same = {"x-request-id": "session-7"}

    async def both() -> list[Any]:
        return list(
            await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"Count to {n}."}],
                        max_tokens=24,
                        temperature=0.0,
                        extra_headers=same,
                    )
                    for n in (3, 9)
                )
            )
        )

    answers = asyncio.run(both())
    alone = [
        replica.client()
        .chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count to {n}."}],
            max_tokens=24,
            temperature=0.0,
        )
        .choices[0]
        .message.content
        for n in (3, 9)
    ]
    assert [a.id for a in answers] == ["chatcmpl-session-7"] * 2
    assert [a.choices[0].message.content for a in answers] == alone
    wait_until(lambda: replica.cache_stats()["pinned_blocks"] == 0, what="no pinned blocks")


def test_cache_salt_isolates_tenants(replica: ReplicaProcess) -> None:
    client = replica.client()
    _chat(client, "Salted?", extra_body={"cache_salt": "tenant-a"})
    other = _chat(client, "Salted?", extra_body={"cache_salt": "tenant-b"})
    same = _chat(client, "Salted?", extra_body={"cache_salt": "tenant-a"})
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert same.usage is not None and same.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert (same.usage.prompt_tokens_details.cached_tokens or 0) >= 64


def test_async_streaming_matches_non_streaming(replica: ReplicaProcess) -> None:
    expected = _chat(replica.client(), "Stream it", max_tokens=12).choices[0].message.content

    async def stream() -> tuple[str, list[Any]]:
        client = replica.async_client()
        chunks = []
        async for chunk in await client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Stream it"},
            ],
            max_tokens=12,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"unknown_field_is_ignored": True},
        ):
            chunks.append(chunk)
        await client.close()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks

    text, chunks = asyncio.run(stream())
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 12 or finishes[-1] == "stop"
    assert last.usage.prompt_tokens_details is not None
    assert (last.usage.prompt_tokens_details.cached_tokens or 0) >= 64


def test_raw_sse_ends_with_done(replica: ReplicaProcess) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", replica.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_completions_token_ids_n_seed_and_stop(replica: ReplicaProcess) -> None:
    client = replica.client()
    prompt = list(range(1000, 1040))
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert greedy.object == "text_completion"
    text = greedy.choices[0].text
    assert greedy.usage is not None and greedy.usage.prompt_tokens == 40

    # A stop string taken from the middle of the greedy text cuts the output before it.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        cut = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert stop not in cut.choices[0].text
        assert text.startswith(cut.choices[0].text)
        # Which stop string ended it, as vLLM reports it (whole and streamed).
        assert cut.choices[0].model_extra == {"stop_reason": stop}
        chunks = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=True
        )
        reasons = [(c.choices[0].finish_reason, c.choices[0].model_extra) for c in chunks]
        assert reasons[-1] == ("stop", {"stop_reason": stop})
        assert all(extra == {"stop_reason": None} for _, extra in reasons[:-1])
    assert greedy.choices[0].model_extra == {"stop_reason": None}
    # A requested stop token id is the stop_reason (an int, as vLLM reports it).
    forced = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
        extra_body={"logit_bias": {"1234": 100}, "stop_token_ids": [1234]},
    )  # fmt: skip
    assert forced.choices[0].finish_reason == "stop"
    assert forced.choices[0].model_extra == {"stop_reason": 1234}

    sampled = [
        client.completions.create(
            model=MODEL, prompt="The weather", max_tokens=10, temperature=1.0, seed=7, n=2
        )
        for _ in range(2)
    ]
    assert [c.index for c in sampled[0].choices] == [0, 1]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]

    echo = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, echo=True)
    assert echo.choices[0].text.startswith("Echo me")
    # A batch, as vLLM answers it: prompt i's n choices at i*n on, usage summed.
    prompts = [prompt, list(range(2000, 2030))]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, n=2)
        for p in prompts
    ]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [c.text for a in alone for c in a.choices]
    assert batch.usage is not None and batch.usage.prompt_tokens == 70
    assert batch.usage.completion_tokens == 24
    # Streamed: each choice's pieces at its batch index, one usage chunk for the batch.
    texts = ["", "", "", ""]
    usage = None
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in batch.choices]
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (70, 24)
    with pytest.raises(openai.BadRequestError, match="more than this replica queues"):
        client.completions.create(model=MODEL, prompt=[[7]] * 257, max_tokens=1)  # 256 queue


def test_cache_stats_and_metrics(replica: ReplicaProcess) -> None:
    _chat(replica.client(), "Metrics?")
    stats = replica.cache_stats()
    for field in ("queries", "hits", "misses", "hit_rate", "evictions", "total_blocks"):
        assert field in stats
    assert stats["total_blocks"] == 256
    assert stats["free_blocks"] + stats["used_blocks"] == 256
    assert stats["pinned_blocks"] == 0
    assert stats["queries"] > 0 and stats["hits"] > 0
    assert replica.metric("prefixgate:prompt_tokens_total") > 0
    assert replica.metric("prefixgate:generation_tokens_total") > 0
    assert replica.metric("prefixgate:prefix_cache_hits_total") > 0
    assert replica.metric("prefixgate:prefix_cache_queries_total") >= replica.metric(
        "prefixgate:prefix_cache_hits_total"
    )
    assert replica.metric("prefixgate:request_success_total") > 0
    assert replica.metric("prefixgate:time_to_first_token_seconds_count") > 0
    assert replica.metric("prefixgate:inter_token_latency_seconds_count") > 0
    assert replica.metric("prefixgate:e2e_request_latency_seconds_count") > 0
    assert replica.metric("prefixgate:num_requests_running") == 0
    assert 0 < replica.metric("prefixgate:kv_cache_usage_perc") <= 1


def test_registry_events_and_snapshot_in_redis(
    replica: ReplicaProcess, module_redis: RedisServer
) -> None:
    client = redis.Redis.from_url(module_redis.url)
    rid = _replica_id(replica)
    assert client.sismember(REPLICAS_SET, rid)
    info = ReplicaInfo.decode(client.get(replica_info_key(rid)))  # type: ignore[arg-type]
    assert (info.url, info.model, info.block_size) == (replica.url, MODEL, 16)
    assert info.load.total_blocks == 256
    assert client.pttl(replica_info_key(rid)) > 0  # expires unless refreshed

    prompt = list(range(2000, 2000 + 16 * 5 + 3))  # five full blocks and a partial tail
    replica.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    expected = [short_key(k) for k in KeySpace(MODEL, 16).keys(prompt)]

    def stored() -> set[bytes]:
        return {k for e in _events(client, rid) if e.type == "stored" for k in e.keys}

    wait_until(
        lambda: set(expected) <= stored(),
        timeout_s=15,
        what="stored events for the prompt's blocks",
    )
    events = _events(client, rid)
    assert [e.seq for e in events] == list(range(events[0].seq, events[0].seq + len(events)))
    # The chain arrives parents first: each expected key's parent is the key before it.
    parents: dict[bytes, bytes | None] = {}
    for e in events:
        if e.type == "stored":
            prev = e.parent
            for k in e.keys:
                parents[k] = prev
                prev = k
    assert parents[expected[0]] is None
    assert all(parents[expected[i]] == expected[i - 1] for i in range(1, len(expected)))

    def snapshot_has_prompt() -> bool:
        raw = client.get(snapshot_key(rid))
        if raw is None:
            return False
        snap = decode_snapshot(raw)  # type: ignore[arg-type]
        return set(expected) <= {b.key for b in snap.blocks}

    wait_until(snapshot_has_prompt, timeout_s=20, what="snapshot holding the prompt")


def test_reset_prefix_cache_empties_the_cache_and_publishes_cleared(
    replica: ReplicaProcess, module_redis: RedisServer
) -> None:
    client = replica.client()
    _chat(client, "Before the reset?")
    assert replica.cache_stats()["cached_blocks"] > 0
    reset = httpx.post(replica.url + "/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200, reset.text
    body = reset.json()
    assert body["freed_blocks"] > 0 and isinstance(body["seq"], int)
    stats = replica.cache_stats()
    assert stats["cached_blocks"] == 0 and stats["free_blocks"] == stats["total_blocks"]
    rid = _replica_id(replica)
    redis_client = redis.Redis.from_url(module_redis.url)

    def cleared() -> bool:
        return any(e.type == "cleared" and e.seq <= body["seq"] for e in _events(redis_client, rid))

    wait_until(cleared, timeout_s=15, what="the cleared event in the replica's stream")
    again = _chat(client, "Before the reset?")
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # nothing survived it
    assert _chat(client, "Before the reset?").usage.prompt_tokens_details.cached_tokens > 0


# A long answer each API is still writing when its client leaves: 3,500 tokens, 12 s or
# more here (greedy on tiny-random runs to the limit; the Messages and Responses APIs have
# no ignore_eos). Its blocks must be free within a fraction of that.
STORY = "Tell me a long story about a gateway."
LONG_ANSWERS: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": list(range(3000, 3100)), "ignore_eos": True, "max_tokens": 3500},
    "/v1/messages": {
        "messages": [{"role": "user", "content": STORY}],
        "temperature": 0,
        "max_tokens": 3500,
    },
    "/v1/responses": {"input": STORY, "temperature": 0, "max_output_tokens": 3500},
}
FREED_WITHIN_S = 5.0


@pytest.mark.parametrize("path", LONG_ANSWERS)
def test_streaming_disconnect_frees_blocks(replica: ReplicaProcess, path: str) -> None:
    body = {"model": MODEL, "stream": True, **LONG_ANSWERS[path]}
    with httpx.stream("POST", replica.url + path, json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert replica.cache_stats()["pinned_blocks"] > 0
    wait_until(
        lambda: replica.cache_stats()["pinned_blocks"] == 0,
        timeout_s=FREED_WITHIN_S,
        what="no pinned blocks",
    )
    assert replica.metric("prefixgate:num_requests_running") == 0


@pytest.mark.parametrize("path", LONG_ANSWERS)
def test_non_streaming_disconnect_frees_blocks(replica: ReplicaProcess, path: str) -> None:
    body = {"model": MODEL, **LONG_ANSWERS[path]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(replica.url + path, json=body, timeout=httpx.Timeout(1.0))
    wait_until(
        lambda: replica.cache_stats()["pinned_blocks"] == 0,
        timeout_s=FREED_WITHIN_S,
        what="no pinned blocks",
    )
    assert replica.metric("prefixgate:num_requests_running") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_whose_client_leaves_frees_every_prompts_blocks(
    replica: ReplicaProcess, stream: bool
) -> None:
    body = {**LONG_ANSWERS["/v1/completions"], "model": MODEL, "stream": stream}
    body["prompt"] = [list(range(3000, 3100)), list(range(4000, 4100))]
    if stream:
        with httpx.stream("POST", replica.url + "/v1/completions", json=body, timeout=30) as r:
            seen = set()
            lines = r.iter_lines()  # held: a dropped iterator closes the stream
            for line in lines:  # until both prompts are decoding
                if line.startswith("data: {"):
                    seen.add(json.loads(line[6:])["choices"][0]["index"])
                if seen == {0, 1}:
                    break
            wait_until(
                lambda: replica.cache_stats()["pinned_blocks"] > 0,
                timeout_s=FREED_WITHIN_S,
                what="the batch's blocks pinned (the stats are as of the engine's last step)",
            )
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(replica.url + "/v1/completions", json=body, timeout=httpx.Timeout(1.0))
    wait_until(
        lambda: replica.cache_stats()["pinned_blocks"] == 0,
        timeout_s=FREED_WITHIN_S,
        what="no pinned blocks",
    )
    assert replica.metric("prefixgate:num_requests_running") == 0


def test_redis_restart_mid_run_loses_no_request(
    replica: ReplicaProcess, module_redis: RedisServer
) -> None:
    client = replica.client()

    def one(i: int) -> int:
        out = _chat(client, f"Question {i}?", max_tokens=4)
        return len(out.choices)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(one, i) for i in range(6)]
        module_redis.stop()
        futures += [pool.submit(one, i) for i in range(6, 12)]
        wait_until(
            lambda: replica.cache_stats()["publisher"]["connected"] is False,
            timeout_s=15,
            what="outage",
        )
        module_redis.start()
        futures += [pool.submit(one, i) for i in range(12, 16)]
        assert [f.result(timeout=60) for f in futures] == [1] * 16

    # Back: a fresh snapshot that folds in every event so far, and the registry record.
    rclient = redis.Redis.from_url(module_redis.url)
    rid = _replica_id(replica)

    def resynced() -> bool:
        raw = rclient.get(snapshot_key(rid))
        seq = replica.cache_stats()["publisher"]["seq"]
        return raw is not None and decode_snapshot(raw).seq == seq  # type: ignore[arg-type]

    wait_until(resynced, timeout_s=20, what="fresh snapshot after the Redis restart")
    wait_until(
        lambda: rclient.exists(replica_info_key(rid)) == 1,
        timeout_s=15,
        what="registry record back",
    )
    assert replica.cache_stats()["publisher"]["outages"] == 1
    assert "unreachable" in replica.log_tail(200_000)


def test_cli_flags_come_from_env_and_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from replica.cli import build_parser

    monkeypatch.setenv("PREFIXGATE_KV_CACHE_MB", "512")
    monkeypatch.setenv("PREFIXGATE_MODEL", "tiny-random")
    monkeypatch.setenv("PREFIXGATE_PORT", "9000")
    args = build_parser().parse_args(["--port", "9100"])
    assert (args.kv_cache_mb, args.model, args.port) == (512, "tiny-random", 9100)
    assert args.host == "127.0.0.1" and args.block_size == 16 and args.redis_url is None


def test_messages_api_on_a_replica_without_a_tool_parser(replica: ReplicaProcess) -> None:
    """Anthropic's Messages API as vLLM serves it, with the official client: an answer,
    its usage, and counts that equal the chat's (tools included, parser or none)."""
    c = anthropic.Anthropic(base_url=replica.url, api_key="x", max_retries=0)
    user: Any = {"role": "user", "content": "What is the weather in Paris?"}
    tool: Any = {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    answer = c.messages.create(model=MODEL, system="Be brief.", messages=[user], max_tokens=3)
    assert answer.type == "message" and answer.model == MODEL
    assert answer.stop_reason in ("max_tokens", "end_turn") and answer.content[0].type == "text"
    assert answer.usage.output_tokens == 3 or answer.stop_reason == "end_turn"
    parts = (answer.usage.cache_read_input_tokens, answer.usage.cache_creation_input_tokens)
    prompt = answer.usage.input_tokens + sum(part or 0 for part in parts)
    assert (
        c.messages.count_tokens(model=MODEL, system="Be brief.", messages=[user]).input_tokens
        == prompt
    )

    chat: Any = {"role": "system", "content": "Be brief."}
    function = {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool["description"],
            "parameters": tool["input_schema"],
        },
    }
    tokenized = httpx.post(
        replica.url + "/tokenize",
        json={"model": MODEL, "messages": [chat, user], "tools": [function]},
        timeout=30,
    ).json()
    counted = c.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[user], tools=[tool]
    )
    assert counted.input_tokens == tokenized["count"]  # (this template leaves tools out)
    management = (counted.model_extra or {}).get("context_management")  # as vLLM answers
    assert management == {"original_input_tokens": tokenized["count"]}
    # Tools ask for an answer parsed for calls (tool_choice auto), which needs the parser.
    with pytest.raises(anthropic.BadRequestError, match="--tool-call-parser"):
        c.messages.create(model=MODEL, messages=[user], tools=[tool], max_tokens=3)
