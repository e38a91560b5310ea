"""A request's id upstream (gateway/handler.py ``upstream_request_id``): vLLM names a
request by its ``x-request-id`` header, else by the body's ``request_id`` (its answer's
``chatcmpl-ID``, the id an abort takes). The gateway sent its own id as the header when
the client sent none, so a body's id never reached the engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import StubCluster, stub_cluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StubCluster]:
    with stub_cluster(tmp_path_factory.mktemp("request-ids"), "m") as cluster:
        yield cluster


@pytest.mark.parametrize(
    ("body_id", "header", "sent"),
    [
        ("trace-42", None, "trace-42"),  # the body's id, sent as the header vLLM reads first
        ("trace-42", "from-header", "from-header"),  # the client's header wins
        (None, "from-header", "from-header"),
        ("has a space", None, None),  # no header can carry it: none goes, the body rules
    ],
)
def test_a_chats_body_request_id_is_not_replaced_by_the_gateways(
    stubs: StubCluster, body_id: str | None, header: str | None, sent: str | None
) -> None:
    content = f"{body_id} {header}"  # each case's own body, to find what the stub got
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": content}]}
    if body_id is not None:
        body["request_id"] = body_id
    headers = {"x-request-id": header} if header is not None else {}
    answer = httpx.post(
        stubs.gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
    )
    assert answer.status_code == 200
    [seen] = [r for r in stubs.received("/v1/chat/completions") if r["body"] == body]
    assert seen["headers"].get("x-request-id") == sent
    if sent is not None:
        assert answer.headers["x-request-id"] == sent


def test_without_either_the_gateways_own_id_goes_and_comes_back(stubs: StubCluster) -> None:
    body = {"model": "m", "prompt": "no id at all"}
    answer = httpx.post(stubs.gateway.url + "/v1/completions", json=body, timeout=30)
    [seen] = [r for r in stubs.received("/v1/completions") if r["body"] == body]
    assert seen["headers"]["x-request-id"] == answer.headers["x-request-id"]
    assert len(answer.headers["x-request-id"]) == 32


def test_an_embeddings_body_request_id_is_sent_too(stubs: StubCluster) -> None:
    body = {"model": "m", "input": "embed me", "request_id": "batch-3-item-9"}
    answer = httpx.post(stubs.gateway.url + "/v1/embeddings", json=body, timeout=30)
    assert answer.status_code == 200
    [seen] = [r for r in stubs.received("/v1/embeddings") if r["body"] == body]
    assert seen["headers"]["x-request-id"] == "batch-3-item-9"
