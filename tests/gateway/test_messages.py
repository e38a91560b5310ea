"""Anthropic's Messages API through the gateway (gateway/messages.py): an agent's steps,
which resend its system prompt, tools and history, stay on the replica that holds them;
streams pass through as they came; ``x-api-key`` is a key; a salted tenant is refused.
The gateway answered 404 to ``/v1/messages`` before."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.messages_hooks import MessagesScanner
from prefixgate.wire import OpenAIError
from prefixgate.wire_messages import to_chat
from tests.conftest import wait_until
from tests.gateway.conftest import Server, start_gateway, start_stub, write_api_keys

pytestmark = pytest.mark.timeout(120)

MODEL = "claude-local"
SYSTEM = "You are a coding agent. Read files before editing them; run the tests after. " * 8
TOOLS = [
    {
        "name": name,
        "description": f"{name} a file of the repository",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for name in ("read", "edit", "run")
]


class Servers:
    def __init__(self, root: Path) -> None:
        self.stubs = [start_stub(root, f"stub-{i}", "--model", MODEL) for i in range(2)]
        urls = [s.url for s in self.stubs]
        self.open = start_gateway(root, "open", urls)
        keys = str(write_api_keys(root / "keys.json"))
        self.keyed = start_gateway(root, "keyed", urls, "--api-keys", keys)
        self.broken_stub = start_stub(root, "broken", "--model", MODEL, "--break-after", "2")
        self.broken = start_gateway(root, "broken-gw", [self.broken_stub.url])

    def stop(self) -> None:
        for server in (self.open, self.keyed, self.broken, self.broken_stub, *self.stubs):
            server.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("messages"))
    yield s
    s.stop()


def _step(history: list[dict[str, Any]], n: int, **extra: Any) -> dict[str, Any]:
    """An agent's request at step ``n``: Claude Code's billing block changes every time."""
    system = [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2; cch={n:05x};"},
        {"type": "text", "text": SYSTEM},
    ]
    return {"model": MODEL, "max_tokens": 64, "system": system, "tools": TOOLS,
            "messages": history, **extra}  # fmt: skip


def _post(gateway: Server, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/messages", json=body, headers=headers, timeout=30)


def test_an_agents_steps_stay_with_their_prefix(servers: Servers) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    replicas, reasons = [], []
    for n in range(6):
        answer = _post(servers.open, _step(history, n))
        assert answer.status_code == 200, answer.text
        assert answer.json()["content"][0]["text"] == "tok0 tok1"
        replicas.append(answer.headers["x-prefixgate-replica"])
        reasons.append(answer.headers["x-prefixgate-route"])
        call = {"type": "tool_use", "id": f"toolu_{n}", "name": "read", "input": {"path": "a.py"}}
        history += [
            {"role": "assistant", "content": [{"type": "text", "text": "Reading."}, call]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": "x = 1\n" * 20},
            ]},
        ]  # fmt: skip
    assert len(set(replicas)) == 1, replicas
    assert all(r.startswith("prefix_match") for r in reasons[1:]), reasons


def test_a_stream_passes_through_whole(servers: Servers) -> None:
    """It ends at message_stop, with no [DONE]: the proxy took every finished Messages
    stream for one the replica broke off, and appended an error event."""
    body = _step([{"role": "user", "content": "hi"}], 0, stream=True)
    with httpx.stream("POST", servers.open.url + "/v1/messages", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        request_id = r.headers["x-request-id"]
        text = r.read().decode()
    assert text.startswith("event: message_start")
    assert text.endswith('event: message_stop\ndata: {"type": "message_stop"}\n\n'), text

    def logged() -> str | None:  # the access line is written once the exchange is over
        lines = servers.open.log_text().splitlines()
        return next((x for x in lines if request_id in x and "access " in x), None)

    line = wait_until(logged, 10, "the access log line")
    assert line is not None
    access = json.loads(line.split("access ", 1)[1])
    assert access["status"] == 200 and access["cached_tokens"] == 5, access


def test_a_broken_stream_ends_with_anthropics_error_event(servers: Servers) -> None:
    body = _step([{"role": "user", "content": "hi"}], 0, stream=True)
    url = servers.broken.url + "/v1/messages"
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        text = r.read().decode()
    assert "event: content_block_delta" not in text  # broken after two events
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    error = json.loads(last.split("data: ", 1)[1])
    assert error["type"] == "error" and "incomplete" in error["error"]["message"]


def test_the_scanner_reads_anthropics_events() -> None:
    scanner = MessagesScanner()
    start = {"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 7}}}
    scanner.feed(f"event: message_start\ndata: {json.dumps(start)}\n\nevent: ping\n".encode())
    assert not scanner.output and scanner.cached_tokens == 7
    scanner.feed(b'data: {}\n\nevent: content_block_delta\ndata: {"type": "x"}\n\n')
    assert scanner.output and not scanner.done
    scanner.feed(b'event: message_stop\ndata: {"type": "message_stop"}\n\n')
    assert scanner.done


def test_keys_and_tenants(servers: Servers) -> None:
    body = _step([{"role": "user", "content": "hi"}], 0)
    assert _post(servers.keyed, body).status_code == 401
    shared = _post(servers.keyed, body, **{"x-api-key": "sk-shared"})
    assert shared.status_code == 200, shared.text
    salted = _post(servers.keyed, body, **{"x-api-key": "sk-alpha"})
    assert salted.status_code == 403
    assert salted.json() == {  # the gateway's own errors on this API are Anthropic's shape
        "type": "error",
        "error": {"type": "permission_error", "message": salted.json()["error"]["message"]},
    }
    assert "cache salt" in salted.json()["error"]["message"]
    # Counting tokens shares no cache: any tenant may.
    counted = httpx.post(
        servers.keyed.url + "/v1/messages/count_tokens",
        json={"model": MODEL, "messages": body["messages"]},
        headers={"x-api-key": "sk-alpha"},
        timeout=30,
    )
    assert counted.status_code == 200 and counted.json() == {"input_tokens": 1}


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "max_tokens": 8},
        {"model": MODEL, "max_tokens": 8, "messages": "hi"},
        {"model": MODEL, "max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]},
        {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": 5}]},
        {"model": MODEL, "max_tokens": 8, "messages": [], "system": 5},
        {"model": MODEL, "max_tokens": 8, "messages": [], "tools": "x"},
        {"model": 5, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    ],
)
def test_bad_bodies_are_400(servers: Servers, body: dict[str, Any]) -> None:
    answer = _post(servers.open, body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_read_as_vllm_reads_it() -> None:
    call = {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "A"}],
    }
    chat = to_chat(
        {
            "model": "m",
            "system": [{"type": "text", "text": "x-anthropic-billing-header: 1"},
                       {"type": "text", "text": "Be brief."}],
            "tools": [TOOLS[0]],
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "text", "text": "ok"}, call]},
                {"role": "user", "content": [result, {"type": "text", "text": "next"}]},
            ],
        }
    )  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "read", "arguments": '{"path": "a"}'}},
        ]},
        {"role": "tool", "tool_call_id": "t1", "content": "A"},
        {"role": "user", "content": "next"},
    ]  # fmt: skip
    assert chat["tools"][0]["function"]["parameters"] == TOOLS[0]["input_schema"]
    assert "strict" not in chat["tools"][0]["function"]  # only when set, as vLLM dumps it
    strict = to_chat({"model": "m", "messages": [], "tools": [{**TOOLS[0], "strict": True}]})
    assert strict["tools"][0]["function"]["strict"] is True
    with pytest.raises(OpenAIError):
        to_chat({"model": "m", "messages": [{"role": "user", "content": {"a": 1}}]})
