"""Log probabilities over HTTP, as vLLM answers them, driven with the official openai
client: chats and completions, whole and streamed, a completion's echo scoring its
prompt (what lm-evaluation-harness's loglikelihood tasks send), and the refusals; and
the token ids vLLM returns on request (``return_token_ids``)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.replica.conftest import MODEL, ReplicaProcess, tool_replica

CHAT: Any = [{"role": "user", "content": "Say something about the sea, briefly."}]
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "tide",
            "description": "Tide times for a port",
            "parameters": {"type": "object", "properties": {"port": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    """A tiny-random replica that parses tool calls (for the tool-parsed stream)."""
    yield from tool_replica(tmp_path_factory.mktemp("logprobs"))


def _content(logprobs: Any) -> list[Any]:
    return [] if logprobs is None or logprobs.content is None else list(logprobs.content)


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, abs_tol=1e-4)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_logprobs_whole_and_streamed(replica: ReplicaProcess, tools: Any) -> None:
    """One item per generated token with its k alternatives, the greedy token the first
    of them; a stream's chunks carry the same items in order (with tools too, where the
    text goes through the tool-call parser)."""
    client = replica.client(timeout=60)
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    whole = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        **extra,
    )
    items = _content(whole.choices[0].logprobs)
    assert whole.usage is not None and len(items) == whole.usage.completion_tokens == 12
    for item in items:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token
        assert _close(item.top_logprobs[0].logprob, item.logprob)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.bytes == list(item.token.encode())
    if not tools:
        assert "".join(i.token for i in items) == whole.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        **extra,
    )
    streamed = [i for chunk in stream for c in chunk.choices for i in _content(c.logprobs)]
    assert [i.token for i in streamed] == [i.token for i in items]
    assert all(_close(a.logprob, b.logprob) for a, b in zip(streamed, items, strict=True))


def test_completion_logprobs_and_an_echo_of_the_prompt(replica: ReplicaProcess) -> None:
    """A completion's tokens with their offsets and alternatives; the same prompt as
    token ids with ``echo`` (lm-evaluation-harness's loglikelihood request: a batch of
    id lists, one token, logprobs 1) scores every prompt token but the first, then the
    same generated tokens with the same values."""
    client = replica.client(timeout=60)
    prompt = "The harbour master checked the tide tables"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    ids = httpx.post(f"{replica.url}/tokenize", json={"model": MODEL, "prompt": prompt})
    prompt_ids = ids.json()["tokens"]
    n = len(prompt_ids)
    scored = client.completions.create(
        model=MODEL,
        prompt=[prompt_ids, prompt_ids[:-2]],
        max_tokens=5,
        temperature=0,
        logprobs=1,
        echo=True,
    )
    full, short = scored.choices
    assert full.logprobs is not None and full.logprobs.token_logprobs is not None
    assert full.text == prompt + out.choices[0].text
    values = full.logprobs.token_logprobs
    assert len(values) == n + 5 and values[0] is None
    assert full.logprobs.top_logprobs is not None and full.logprobs.top_logprobs[0] is None
    assert full.logprobs.tokens is not None and full.logprobs.tokens[n:] == lp.tokens
    assert all(_close(a, b) for a, b in zip(values[n:], lp.token_logprobs, strict=True))
    assert short.logprobs is not None and short.logprobs.token_logprobs is not None
    assert short.logprobs.token_logprobs[: n - 2] == values[: n - 2]
    raw = (full.model_extra or {}).get("prompt_logprobs")
    assert raw is not None and raw[0] is None and len(raw) == n
    for position in range(1, n):
        mine = raw[position][str(prompt_ids[position])]
        assert _close(mine["logprob"], values[position]) and mine["rank"] >= 1


def test_a_streamed_echo_carries_the_prompts_scores_with_its_first_token(
    replica: ReplicaProcess,
) -> None:
    client = replica.client(timeout=60)
    kwargs: Any = {
        "model": MODEL,
        "prompt": "Fog over the estuary again",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
    }
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [
        c for chunk in client.completions.create(stream=True, **kwargs) for c in chunk.choices
    ]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[0].text.startswith(kwargs["prompt"])
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    for c in chunks:
        if c.logprobs is not None:
            tokens += c.logprobs.tokens or []
            offsets += c.logprobs.text_offset or []
            values += c.logprobs.token_logprobs or []
    assert whole.logprobs is not None
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values[0] is None
    assert all(
        _close(a, b) for a, b in zip(values, whole.logprobs.token_logprobs or [], strict=True)
    )


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bad_logprobs_fields_are_a_400_naming_them(
    replica: ReplicaProcess, path: str, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, **extra}
    body |= {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    resp = httpx.post(replica.url + path, json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_chat_prompt_logprobs_are_vllms_field(replica: ReplicaProcess) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}
    out = httpx.post(replica.url + "/v1/chat/completions", json=body, timeout=30).json()
    raw = out["prompt_logprobs"]
    assert raw[0] is None and len(raw) == out["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in raw[1:])  # 0 alternatives: the token alone
    assert out["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_an_echo_of_no_tokens_answers_the_prompt_scored(
    replica: ReplicaProcess, stream: bool
) -> None:
    """``max_tokens`` 0 with ``echo`` (OpenAI's legacy way to score a text, which vLLM
    keeps): the answer is the prompt, its tokens scored, and nothing generated shows; the
    one token generated is counted, as vLLM counts it. Without ``echo`` it is a 400."""
    prompt = "Gulls circled the trawler"
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 0,
        "echo": True,
        "logprobs": 0,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
    answer = httpx.post(replica.url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    if stream:
        events = [
            json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")
        ]
        choices = [c for e in events for c in e["choices"]]
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        finish = choices[-1]["finish_reason"]
        usage = events[-1]["usage"]
    else:
        whole = answer.json()
        choice = whole["choices"][0]
        text, tokens, finish = choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]
        usage = whole["usage"]
    assert text == prompt and finish == "length"
    assert "".join(tokens) == prompt and len(tokens) == usage["prompt_tokens"]
    assert usage["completion_tokens"] == 1
    refused = httpx.post(
        replica.url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 0},
        timeout=30,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_responses_api_logprobs_when_included(replica: ReplicaProcess) -> None:
    """The Responses API gives the output text's log probabilities when ``include`` names
    ``message.output_text.logprobs``, with ``top_logprobs`` alternatives (vLLM's rule),
    whole and in each text delta; not otherwise (the replica ignored both before)."""
    client = replica.client(timeout=60)
    kwargs: Any = {
        "model": MODEL,
        "input": "Describe a lighthouse.",
        "max_output_tokens": 8,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    whole = client.responses.create(**kwargs)
    part = whole.output[0].content[0]  # type: ignore[union-attr]
    assert whole.usage is not None and len(part.logprobs) == whole.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text
    streamed: list[Any] = []
    for event in client.responses.create(stream=True, **kwargs):
        if event.type == "response.output_text.delta":
            streamed += event.logprobs or []
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    plain = client.responses.create(**{**kwargs, "include": []})
    assert not getattr(plain.output[0].content[0], "logprobs", None)  # type: ignore[union-attr]
    bad = httpx.post(replica.url + "/v1/responses", json={**kwargs, "top_logprobs": 21}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_return_token_ids_whole_and_streamed(replica: ReplicaProcess, path: str) -> None:
    """vLLM's ``return_token_ids`` (agents and RL frameworks trace the exact tokens): the
    prompt's ids and each choice's, whole and streamed (the stream's chunks add up to the
    whole answer's ids; the prompt's go with the first chunk). With
    ``return_tokens_as_token_ids``, log probabilities name tokens ``token_id:N``."""
    chat = "chat" in path
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    body |= {"messages": CHAT} if chat else {"prompt": "Harbour lights at dusk"}
    body |= {"return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": True}
    if not chat:
        body["logprobs"] = 1
    whole = httpx.post(replica.url + path, json=body, timeout=60).json()
    choice = whole["choices"][0]
    prompt_ids = whole["prompt_token_ids"] if chat else choice["prompt_token_ids"]
    assert len(prompt_ids) == whole["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 6
    named = (
        [i["token"] for i in choice["logprobs"]["content"]]
        if chat
        else choice["logprobs"]["tokens"]
    )
    assert named == [f"token_id:{t}" for t in choice["token_ids"]]
    answer = httpx.post(replica.url + path, json=body | {"stream": True}, timeout=60)
    chunks = [
        json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")
    ]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert streamed == choice["token_ids"]
    first = chunks[0] if chat else chunks[0]["choices"][0]
    assert first["prompt_token_ids"] == prompt_ids
