"""Agents through a real gateway and two real tiny-random replicas (tool-aware template,
Hermes tool-call parser, scripted token draw: tests/support/scripted_replica.py), driven
by the official openai client: a full tool loop on one replica with cached tokens, the
gateway's keys with tools equal to the replica's, tool choices and structured output
refused clearly."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionFunctionToolParam
from openai.types.responses import FunctionToolParam

from gateway.auth import OPEN_TENANT
from prefixgate.chat_input import chat_input
from prefixgate.procs import free_port
from prefixgate.tokenizer import ChatTokenizer
from prefixgate.wire import ChatCompletionRequest
from router.protocol import BlockEvent, KeySpace, events_stream_key, short_key
from tests.conftest import RedisServer, wait_until
from tests.gateway.conftest import Server, start, start_gateway, write_api_keys
from tests.support.scripted_replica import ANSWER

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny-random"
TEMPLATE = Path(__file__).parents[1] / "support" / "tool_template.jinja"
WEATHER: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {"name": "now", "parameters": {}},
}


def start_scripted(root: Path, name: str, redis_url: str, replica_id: str) -> Server:
    port = free_port()
    args = [
        "-m", "tests.support.scripted_replica", "--model", MODEL, "--port", str(port),
        "--num-blocks", "512", "--redis-url", redis_url, "--replica-id", replica_id,
        "--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes",
    ]  # fmt: skip
    return start(args, port, root, name)


class Cluster:
    def __init__(self, root: Path, redis_url: str) -> None:
        self.replicas = [start_scripted(root, f"r{i}", redis_url, f"r{i}") for i in range(2)]
        self.gateway = start_gateway(
            root,
            "gw",
            [r.url for r in self.replicas],
            "--redis-url",
            redis_url,
            "--chat-template",
            f"{MODEL}={TEMPLATE}",
        )

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key="x", max_retries=0)

    def stop(self) -> None:
        for server in [self.gateway, *self.replicas]:
            server.stop()


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("agents"), module_redis.url)
    yield c
    c.stop()


def _cached(usage: Any) -> int:
    details = usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def test_chat_tool_loop_stays_on_one_replica_and_hits_its_cache(cluster: Cluster) -> None:
    c = cluster.client()
    messages: list[Any] = [
        {"role": "system", "content": f"You are a weather agent. Session {time.time()}."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    first = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=64
    )
    call_turn = first.parse()
    choice = call_turn.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert choice.message.content is None

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "sunny"}'},
    ]
    second = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=64
    )
    answer = second.parse()
    assert answer.choices[0].message.content == ANSWER
    assert answer.choices[0].finish_reason == "stop"
    assert not answer.choices[0].message.tool_calls
    replica = first.headers["x-prefixgate-replica"]
    assert second.headers["x-prefixgate-replica"] == replica
    assert answer.usage is not None and call_turn.usage is not None
    # the whole first prompt (tools, system, question) came from the cache, bar a partial block
    assert _cached(answer.usage) >= call_turn.usage.prompt_tokens - 16 > 0


def test_streamed_tool_calls_arrive_as_delta_tool_calls(cluster: Cluster) -> None:
    stream = cluster.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "weather please, streamed"}],
        tools=[WEATHER],
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, names, arguments, ids, finish = "", "", "", set(), None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tool_call in delta.tool_calls or []:
            assert tool_call.index == 0
            if tool_call.id:
                ids.add(tool_call.id)
            assert tool_call.function is not None
            names += tool_call.function.name or ""
            arguments += tool_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert names == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert len(ids) == 1


def test_gateway_keys_with_tools_equal_the_replica_keys(
    cluster: Cluster, module_redis: RedisServer
) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"keys with tools {time.time()}"}],
        "tools": [WEATHER],
    }
    raw = cluster.client().chat.completions.with_raw_response.create(**body, max_tokens=1)
    replica = raw.headers["x-prefixgate-replica"]
    tokenizer = ChatTokenizer.for_model(MODEL)
    tokenizer.set_chat_template(TEMPLATE.read_text())
    ids = tokenizer.encode_input(chat_input(ChatCompletionRequest.model_validate(body)))
    expected = [short_key(k) for k in KeySpace(MODEL, 16, "").keys(ids)]
    without_tools = tokenizer.encode_chat(body["messages"])
    assert len(ids) > len(without_tools) + 50  # the definitions are in the prompt
    matched = raw.headers["x-prefixgate-route"].split("matched=")[1].split(";")[0]
    assert matched.endswith(f"/{len(expected)}")
    r = redis.Redis.from_url(module_redis.url)

    def stored() -> set[bytes]:
        keys: set[bytes] = set()
        for _, fields in r.xrange(events_stream_key(replica)) or []:
            event = BlockEvent.decode(fields)  # type: ignore[arg-type]
            if event.type == "stored":
                keys.update(event.keys)
        return keys

    wait_until(lambda: set(expected) <= stored(), what=f"{replica} storing the gateway's keys")


def test_choices_that_cannot_be_honoured_are_400s(cluster: Cluster) -> None:
    c = cluster.client()
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        c.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="`tools` must be set"):
        c.chat.completions.create(model=MODEL, messages=messages, tool_choice="auto")
    with pytest.raises(openai.BadRequestError, match=r"json_schema\.schema must be"):
        c.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format={"type": "json_schema", "json_schema": {"name": "no-schema"}},  # type: ignore[typeddict-item]
        )
    plain = c.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=64
    )
    # tool choice none: the call the model writes stays text
    assert plain.choices[0].finish_reason == "stop"
    assert "<tool_call>" in (plain.choices[0].message.content or "")


RESPONSES_TOOL: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}


def test_responses_tool_loop_stays_on_the_replica_that_stored_it(
    cluster: Cluster, module_redis: RedisServer
) -> None:
    c = cluster.client()
    instructions = f"You are a weather agent. Session {time.time()}."
    first = c.responses.with_raw_response.create(
        model=MODEL,
        instructions=instructions,
        input="What is the weather in Paris?",
        tools=[RESPONSES_TOOL],
        max_output_tokens=64,
    )
    called = first.parse()
    replica = first.headers["x-prefixgate-replica"]
    assert called.status == "completed" and called.id.startswith("resp_")
    (item,) = called.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == {"city": "Paris"}
    shared: Any = redis.Redis.from_url(module_redis.url).get(f"prefixgate:response:{called.id}")
    assert shared is not None and json.loads(shared)["replica_id"] == replica

    second = c.responses.with_raw_response.create(
        model=MODEL,
        instructions=instructions,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "21 C"}],
        tools=[RESPONSES_TOOL],
        max_output_tokens=64,
    )
    answer = second.parse()
    assert second.headers["x-prefixgate-replica"] == replica
    assert second.headers["x-prefixgate-route"].startswith("response_affinity")
    assert "matched=" in first.headers["x-prefixgate-route"]
    metrics = httpx.get(cluster.gateway.url + "/metrics", timeout=10).text
    assert 'endpoint="responses"' in metrics
    assert answer.output_text == ANSWER and answer.previous_response_id == called.id
    assert answer.usage is not None and called.usage is not None
    cached = answer.usage.input_tokens_details.cached_tokens
    assert cached >= called.usage.input_tokens - 16 > 0

    fetched = c.responses.retrieve(answer.id)
    assert fetched.id == answer.id and fetched.output_text == ANSWER
    with pytest.raises(openai.BadRequestError, match="only background responses"):
        c.responses.cancel(answer.id)
    c.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        c.responses.retrieve(answer.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        c.responses.create(model=MODEL, previous_response_id=answer.id, input="and now?")
    with pytest.raises(openai.NotFoundError, match="not found"):
        c.responses.create(model=MODEL, previous_response_id="resp_unknown", input="hi")


def test_a_response_whose_replica_is_gone_is_a_404(
    cluster: Cluster, module_redis: RedisServer
) -> None:
    """Another gateway recorded it on a replica this one no longer has: never an answer
    from a different replica."""
    record = {"replica_id": "r-gone", "conversation": "agent-1", "tenant": OPEN_TENANT.name}
    redis.Redis.from_url(module_redis.url).set(
        "prefixgate:response:resp_elsewhere", json.dumps(record), ex=60
    )
    c = cluster.client()
    with pytest.raises(openai.NotFoundError, match="r-gone, which is gone"):
        c.responses.create(model=MODEL, previous_response_id="resp_elsewhere", input="hi")
    with pytest.raises(openai.NotFoundError, match="r-gone"):
        c.responses.retrieve("resp_elsewhere")


def test_streamed_responses_events(cluster: Cluster) -> None:
    c = cluster.client()
    kinds: list[str] = []
    arguments, text = "", ""
    completed: Any = None
    events: Any = c.responses.create(
        model=MODEL, input="weather, streamed", tools=[RESPONSES_TOOL], stream=True
    )
    for event in events:
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        if event.type == "response.completed":
            completed = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert json.loads(arguments) == {"city": "Paris"}
    assert completed.output[0].type == "function_call"
    assert completed.usage.input_tokens > 0
    events = c.responses.create(model=MODEL, input="say hello", stream=True)
    for event in events:
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            completed = event.response
    assert text == completed.output_text == "Hello from the script."
    follow = c.responses.create(
        model=MODEL, previous_response_id=completed.id, input="again", max_output_tokens=4
    )
    assert follow.status == "incomplete"  # four tokens of the answer: max_output_tokens
    assert follow.usage is not None and follow.usage.input_tokens_details.cached_tokens > 0


def test_a_tenant_cannot_reach_another_tenants_responses(
    cluster: Cluster, module_redis: RedisServer, tmp_path: Path
) -> None:
    keys = write_api_keys(tmp_path / "keys.json")
    urls = [r.url for r in cluster.replicas]
    keyed = start_gateway(
        tmp_path, "gw-keyed", urls, "--redis-url", module_redis.url, "--api-keys", str(keys),
        "--chat-template", str(TEMPLATE),
    )  # fmt: skip
    try:

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0)

        mine = client("sk-alpha").responses.create(model=MODEL, input="private", store=True)
        shared: Any = redis.Redis.from_url(module_redis.url).get(f"prefixgate:response:{mine.id}")
        assert json.loads(shared)["conversation"] == f"alpha\x00{mine.id}"  # tenant-scoped
        assert client("sk-alpha").responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            client("sk-beta").responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            client("sk-beta").responses.create(
                model=MODEL, previous_response_id=mine.id, input="and?"
            )
        with pytest.raises(openai.NotFoundError):  # the open gateway is another tenant
            cluster.client().responses.retrieve(mine.id)
    finally:
        keyed.stop()


@pytest.mark.parametrize(
    "body",
    [
        {
            "model": MODEL,
            "input": [{"type": "message", "role": "user", "content": [{"type": "x"}]}],
        },
        {"model": MODEL, "input": [{"type": "function_call", "name": 3}]},
        {"model": MODEL, "input": [{"type": "reasoning"}]},
        {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]},
        {
            "model": MODEL,
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": "x"}],
        },
        {
            "model": MODEL,
            "input": "hi",
            "tool_choice": {"type": "function"},
            "tools": [RESPONSES_TOOL],
        },
        {"model": MODEL, "input": "hi", "max_output_tokens": 0},
        {"model": MODEL, "input": 5},
        {"model": "nope", "input": "hi"},
        {"model": MODEL, "input": "hi", "previous_response_id": ""},
    ],
)
def test_bad_responses_requests_are_4xx(cluster: Cluster, body: dict[str, Any]) -> None:
    for url in (cluster.gateway.url, cluster.replicas[0].url):
        r = httpx.post(url + "/v1/responses", json=body, timeout=30)
        assert 400 <= r.status_code < 500, (url, r.status_code, r.text)
        assert isinstance(r.json()["error"]["message"], str)


# Anthropic's Messages API on the built-in replica, through the gateway, driven by the
# official anthropic client (Claude Code's traffic).
ANTHROPIC_WEATHER: Any = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": WEATHER["function"]["parameters"],
}


def _prompt_tokens(usage: Any) -> int:
    """Anthropic's three parts of a prompt, added up."""
    parts = (usage.cache_read_input_tokens, usage.cache_creation_input_tokens)
    return int(usage.input_tokens + sum(part or 0 for part in parts))


def _anthropic(cluster: Cluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.gateway.url, api_key="x", max_retries=0)


def test_messages_tool_loop_stays_on_one_replica_and_hits_its_cache(cluster: Cluster) -> None:
    c = _anthropic(cluster)
    system = f"You are a weather agent. Session {time.time()}."
    question: Any = {"role": "user", "content": "What is the weather in Paris?"}
    first = c.messages.with_raw_response.create(
        model=MODEL, system=system, messages=[question], tools=[ANTHROPIC_WEATHER],
        max_tokens=64, metadata={"user_id": "claude-session-1"},
    )  # fmt: skip
    called = first.parse()
    replica = first.headers["x-prefixgate-replica"]
    assert called.type == "message" and called.role == "assistant"
    assert called.stop_reason == "tool_use" and called.stop_sequence is None
    (call,) = called.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "Paris"}
    assert called.usage.input_tokens > 0 and called.usage.output_tokens > 0
    whole_first = _prompt_tokens(called.usage)
    read, written = called.usage.cache_read_input_tokens, called.usage.cache_creation_input_tokens
    assert written == whole_first // 16 * 16 - (read or 0) > 0  # the full blocks not read

    result: Any = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}],
    }
    history: Any = [question, {"role": "assistant", "content": called.content}, result]
    second = c.messages.with_raw_response.create(
        model=MODEL, system=system, messages=history, tools=[ANTHROPIC_WEATHER],
        max_tokens=64, metadata={"user_id": "claude-session-1"},
    )  # fmt: skip
    answer = second.parse()
    assert second.headers["x-prefixgate-replica"] == replica
    assert answer.stop_reason == "end_turn"
    assert [block.type for block in answer.content] == ["text"]
    assert answer.content[0].text == ANSWER  # type: ignore[union-attr]
    # The whole first prompt was cached, less at most its last partial block.
    cached = answer.usage.cache_read_input_tokens or 0
    assert cached >= whole_first - 16 > 0
    counted = c.messages.count_tokens(
        model=MODEL, system=system, messages=history, tools=[ANTHROPIC_WEATHER]
    )
    assert counted.input_tokens == _prompt_tokens(answer.usage)
    metrics = httpx.get(cluster.gateway.url + "/metrics", timeout=10).text
    assert 'endpoint="messages"' in metrics


def test_claude_codes_beta_messages_and_billing_block(cluster: Cluster) -> None:
    """Claude Code calls ``/v1/messages?beta=true`` with a system prompt behind a billing
    block whose hash changes with every request: two steps still share their cached
    prefix on one replica."""
    c = _anthropic(cluster)
    system = f"You are Claude Code. Session {time.time()}. " * 8
    steps = []
    for n in range(2):
        billing = f"x-anthropic-billing-header: cc_version=2.1.3; cch={n:05x};"
        raw = c.messages.with_raw_response.create(
            model=MODEL,
            system=[{"type": "text", "text": billing}, {"type": "text", "text": system}],
            messages=[{"role": "user", "content": f"step {n}"}],
            max_tokens=4,
            extra_query={"beta": "true"},
        )
        assert raw.http_request.url.params.get("beta") == "true"
        steps.append((raw.headers["x-prefixgate-replica"], raw.parse().usage))
    (first, _), (second, usage) = steps
    assert second == first
    assert (usage.cache_read_input_tokens or 0) >= 64  # of a system prompt of ~100 tokens


def test_streamed_messages_events(cluster: Cluster) -> None:
    c = _anthropic(cluster)
    kinds: list[str] = []
    with c.messages.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "weather, streamed"}],
        tools=[ANTHROPIC_WEATHER],
        max_tokens=64,
    ) as stream:
        kinds = [event.type for event in stream]
        called = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert called.stop_reason == "tool_use"
    (call,) = called.content
    assert call.type == "tool_use" and call.input == {"city": "Paris"}

    # Stopped by a stop sequence, streamed: the text before it, and which one it was.
    with c.messages.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "say hello"}],
        max_tokens=64,
        stop_sequences=["nothing", "script"],
    ) as stream:
        text = "".join(stream.text_stream)
        stopped = stream.get_final_message()
    assert text == "Hello from the " == stopped.content[0].text  # type: ignore[union-attr]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "script")
    assert stopped.usage.output_tokens > 0
    assert (stopped.usage.cache_read_input_tokens or 0) >= 0

    cut = c.messages.create(
        model=MODEL, messages=[{"role": "user", "content": "say hello"}], max_tokens=2
    )
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_bad_messages_requests_are_anthropic_errors(cluster: Cluster) -> None:
    c = _anthropic(cluster)
    with pytest.raises(anthropic.NotFoundError) as found:
        c.messages.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    # The gateway's own errors on the Messages API are Anthropic's shape too.
    body: Any = found.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "nope" in body["error"]["message"]
    counted = httpx.post(
        cluster.gateway.url + "/v1/messages/count_tokens", json={"model": "nope"}, timeout=30
    )
    assert counted.status_code == 404 and counted.json()["error"]["type"] == "not_found_error"
    for bad in (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
         "tool_choice": {"type": "tool"}, "tools": [ANTHROPIC_WEATHER]},
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
         "stop_sequences": "x"},
        {"model": MODEL, "messages": "hi", "max_tokens": 4},
    ):  # fmt: skip
        for url in (cluster.gateway.url, cluster.replicas[0].url):
            r = httpx.post(url + "/v1/messages", json=bad, timeout=30)
            assert r.status_code == 400, (url, r.text)
            assert r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "invalid_request_error"
