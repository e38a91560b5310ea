"""Images, audio and files in front of an engine that takes them (a vision model's vLLM).

The gateway refused every chat, Responses and Messages request with an image (400 "send
text parts") before any engine saw it, although vLLM serves vision models. Now it routes
them: keyed exactly up to the first image, by the chat's own bytes from there
(gateway/routing.py, ``media_split``), so the same chat's next turn goes where the last
one went. Two stub backends stand for the engines; the official client sends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import StubCluster, stub_cluster

pytestmark = pytest.mark.timeout(120)

MODEL = "stub-model"
PIXEL = (  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
SYSTEM = "You describe pictures for people who cannot see them. " * 30


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[StubCluster]:
    with stub_cluster(tmp_path, MODEL) as running:
        yield running


def _image(data: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def test_a_chat_with_an_image_reaches_the_engine_and_its_next_turn_the_same_one(
    cluster: StubCluster,
) -> None:
    gateway = cluster.gateway
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    look = [{"type": "text", "text": "What is in this picture?"}, _image(PIXEL * 50)]
    chat: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": look}]
    replicas = []
    for turn in range(3):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=chat)
        replicas.append(raw.headers["x-prefixgate-replica"])
        route = raw.headers["x-prefixgate-route"]
        if turn:  # all of the last turn's blocks, the image's among them
            assert route.startswith("prefix_match"), route
        chat += [
            {"role": "assistant", "content": raw.parse().choices[0].message.content},
            {"role": "user", "content": f"And the colours, {turn}?"},
        ]
    assert len(set(replicas)) == 1, replicas
    forwarded = cluster.received("/v1/chat/completions")
    assert len(forwarded) == 3
    assert forwarded[0]["body"]["messages"][1]["content"] == look  # passed on as sent


def test_images_through_the_responses_and_messages_apis(
    cluster: StubCluster,
) -> None:
    gateway = cluster.gateway
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    items: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is in this picture?"},
                {"type": "input_image", "image_url": f"data:image/png;base64,{PIXEL}"},
            ],
        },
        # What the Agents SDK sends back of a reasoning model's last turn.
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "A pixel."}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "A pixel."}]},
        {"role": "user", "content": "Which colour?"},
    ]
    answer = client.responses.create(
        model=MODEL,
        instructions=SYSTEM,
        store=False,
        input=items,
        tools=[{"type": "web_search_preview"}],  # the engine's built-in tool
    )
    assert answer.output_text == "tok0 tok1"
    assert len(cluster.received("/v1/responses")) == 1
    message = httpx.post(
        gateway.url + "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this picture?"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": PIXEL},
                        },
                    ],
                }
            ],
        },
        timeout=30,
    )
    assert message.status_code == 200, message.text
    assert len(cluster.received("/v1/messages")) == 1
