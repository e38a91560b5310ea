"""``--root-path``, as vLLM's: the gateway and the replica behind a proxy that routes by
path (``https://host/llm/v1/...``) and forwards the prefix. Without it every request so
routed was a 404 from the gateway, and a replica reached at ``http://host/r0`` never
became healthy."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from prefixgate.procs import free_port
from prefixgate.root_path import RootPath, root_prefix
from tests.gateway.conftest import Server, start, start_gateway

pytestmark = pytest.mark.timeout(180)


def test_root_prefix_normalises_and_refuses_what_no_path_carries() -> None:
    assert root_prefix("") == "" and root_prefix("/") == ""
    assert root_prefix("/llm") == root_prefix("llm/") == root_prefix(" /llm/ ") == "/llm"
    assert root_prefix("/team/llama-3") == "/team/llama-3"
    for bad in ("/a?b", "/a#b", "/a b", "/a//b", "/a/../b", "/%2e", "/a\\b", "/a\x00"):
        with pytest.raises(ValueError, match="root-path"):
            root_prefix(bad)


def test_paths_under_the_prefix_are_served_as_the_apps_own() -> None:
    seen: list[tuple[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((scope.get("path", scope["type"]), scope.get("raw_path")))

    wrapped = RootPath(app, "/llm")  # type: ignore[arg-type]
    for path in ("/llm/v1/models", "/llm", "/llm/", "/v1/models", "/llmx/v1", "/x/llm/v1"):
        scope = {"type": "http", "path": path, "raw_path": path.encode()}
        asyncio.run(wrapped(scope, None, None))  # type: ignore[arg-type]
    assert [p for p, _ in seen] == ["/v1/models", "/", "/", "/v1/models", "/llmx/v1", "/x/llm/v1"]
    assert seen[0][1] == b"/v1/models"
    asyncio.run(wrapped({"type": "lifespan"}, None, None))  # type: ignore[arg-type]
    assert seen[-1] == ("lifespan", None)  # passed through as it came


@pytest.fixture(scope="module")
def behind_proxies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """A replica served under /r0, reached by the gateway at that path; the gateway
    served under /llm."""
    root: Path = tmp_path_factory.mktemp("root-path")
    port = free_port()
    args = ["-m", "prefixgate", "replica", "--model", "tiny-random", "--port", str(port)]
    replica = start([*args, "--root-path", "/r0"], port, root, "replica", health="/r0/health")
    try:
        url = f"{replica.url}/r0"
        gateway = start_gateway(root, "gateway", [url], "--root-path", "/llm/")
        try:
            yield gateway, replica
        finally:
            gateway.stop()
    finally:
        replica.stop()


def test_a_client_calls_the_gateway_under_its_prefix(behind_proxies: tuple[Server, Server]) -> None:
    gateway, _ = behind_proxies
    client = openai.OpenAI(base_url=gateway.url + "/llm/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny-random"]
    messages: Any = [{"role": "user", "content": "hello under a prefix"}]
    answer = client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=3)
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    stream = client.chat.completions.create(
        model="tiny-random", messages=messages, max_tokens=3, stream=True
    )
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1
    # A proxy that strips the prefix: the same server at its own paths.
    assert httpx.get(gateway.url + "/v1/models").status_code == 200
    assert httpx.get(gateway.url + "/llm/ready").status_code == 200
    missing = httpx.get(gateway.url + "/llmx/v1/models")
    assert missing.status_code == 404


def test_a_replica_under_a_prefix_is_probed_and_routed_there(
    behind_proxies: tuple[Server, Server],
) -> None:
    gateway, replica = behind_proxies
    stats = httpx.get(gateway.url + "/router/stats").json()["replicas"]
    assert [v["healthy"] for v in stats.values()] == [True]
    assert httpx.get(replica.url + "/r0/v1/models").json()["data"][0]["id"] == "tiny-random"
    completion = httpx.post(
        gateway.url + "/llm/v1/completions",
        json={"model": "tiny-random", "prompt": "under two prefixes", "max_tokens": 2},
        timeout=60,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 2
