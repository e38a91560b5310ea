"""SGLang's native ``POST /generate`` through the gateway (gateway/generate.py): samples of
one prompt, sent as token ids as reinforcement-learning rollouts send them, go where that
prompt went; text prompts are keyed too; streams pass through. The gateway answered 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.generate import first_prompt
from tests.gateway.conftest import Server, start_gateway, start_stub, write_api_keys

pytestmark = pytest.mark.timeout(120)

PROMPT_IDS = list(range(1000, 1200))  # 200 token ids: 12 blocks of 16


class Servers:
    def __init__(self, root: Path) -> None:
        self.stubs = [start_stub(root, f"stub-{i}") for i in range(2)]
        urls = [s.url for s in self.stubs]
        self.open = start_gateway(root, "open", urls)
        keys = str(write_api_keys(root / "keys.json"))
        self.keyed = start_gateway(root, "keyed", urls, "--api-keys", keys)

    def stop(self) -> None:
        for server in (self.open, self.keyed, *self.stubs):
            server.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("generate"))
    yield s
    s.stop()


def _post(gateway: Server, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(gateway.url + "/generate", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    "prompt",
    [
        {"input_ids": PROMPT_IDS},
        {"text": "Solve the following problem step by step and show your work. " * 8},
    ],
)
def test_samples_of_one_prompt_go_where_it_went(servers: Servers, prompt: dict[str, Any]) -> None:
    replicas, reasons = [], []
    for seed in range(6):  # a group of samples, as a GRPO rollout sends them
        body = {**prompt, "sampling_params": {"temperature": 1.0, "seed": seed}}
        answer = _post(servers.open, body)
        assert answer.status_code == 200 and answer.json()["text"] == "tok0 tok1"
        replicas.append(answer.headers["x-prefixgate-replica"])
        reasons.append(answer.headers["x-prefixgate-route"])
    assert len(set(replicas)) == 1, replicas
    assert all(r.startswith("prefix_match") for r in reasons[1:]), reasons


def test_a_stream_passes_through(servers: Servers) -> None:
    body = {"input_ids": PROMPT_IDS, "stream": True}
    with httpx.stream("POST", servers.open.url + "/generate", json=body, timeout=30) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert text.count("data: ") == 3 and text.endswith("data: [DONE]\n\n")


def test_only_shared_tenants_in_keyed_mode(servers: Servers) -> None:
    body = {"input_ids": PROMPT_IDS}
    shared = _post(servers.keyed, body, authorization="Bearer sk-shared")
    assert shared.status_code == 200, shared.text
    salted = _post(servers.keyed, body, authorization="Bearer sk-alpha")
    assert salted.status_code == 403 and salted.json()["error"]["code"] == "no_cache_salt"


def test_the_prompt_keyed_is_the_first() -> None:
    assert first_prompt({"input_ids": [[5, 6], [7]]}) == [5, 6]
    assert first_prompt({"input_ids": [5, 6], "text": "x"}) == [5, 6]
    assert first_prompt({"text": ["a", "b"]}) == "a"
    assert first_prompt({"input_ids": [5, True]}) is None  # not ids: the replica judges
    assert first_prompt({"input_ids": [-1]}) is None and first_prompt({}) is None
