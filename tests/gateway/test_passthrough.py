"""The engines' other model endpoints through the gateway (gateway/passthrough.py), and
the built-in replica's ``/tokenize`` and ``/detokenize`` (replica/tokenize_api.py).

A vLLM client counts tokens with ``/tokenize`` and embeds with ``/v1/embeddings`` on the
base URL of its chats; the gateway answered 404 to both, and the built-in replica had
neither tokenizing endpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import start_gateway, start_replica, start_stub

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-random"
MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Which colour is the sky on a clear day?"},
]


class Servers:
    def __init__(self, root: Path) -> None:
        self.replica = start_replica(root, "replica")
        self.stub = start_stub(root, "stub", "--model", "embedder")
        self.gateway = start_gateway(root, "gateway", [self.replica.url, self.stub.url])
        self.single = start_gateway(root, "single", [self.replica.url])

    def stop(self) -> None:
        for server in (self.single, self.gateway, self.stub, self.replica):
            server.stop()

    def post(self, path: str, body: Any, base: str | None = None) -> httpx.Response:
        return httpx.post((base or self.gateway.url) + path, json=body, timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("passthrough"))
    yield s
    s.stop()


def test_tokenize_counts_what_a_chat_is_charged(servers: Servers) -> None:
    through = servers.post("/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert through.status_code == 200, through.text
    counted = through.json()
    client = openai.OpenAI(base_url=servers.gateway.url + "/v1", api_key="-", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and counted["count"] == chat.usage.prompt_tokens
    assert counted["count"] == len(counted["tokens"]) and counted["max_model_len"] > 0
    direct = servers.post("/tokenize", {"model": MODEL, "messages": MESSAGES}, servers.replica.url)
    assert direct.json() == counted


def test_tokenize_a_prompt_and_back(servers: Servers) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    body = {"model": MODEL, "prompt": text, "return_token_strs": True}
    tokens = servers.post("/tokenize", body).json()
    assert len(tokens["token_strs"]) == tokens["count"] > 0
    back = servers.post("/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert back.status_code == 200 and text in back.json()["prompt"]
    # One model behind the gateway: a body may leave it out, as vLLM's may.
    bare = servers.post("/tokenize", {"prompt": text}, servers.single.url)
    assert bare.status_code == 200 and bare.json()["tokens"] == tokens["tokens"]


def test_tokenizer_info_through_a_gateway_of_one_model(servers: Servers) -> None:
    """lm-evaluation-harness tokenizes through the server when ``GET /tokenizer_info``
    (with an ``eos_token``) and ``/tokenize`` answer; the gateway answered 404, so the
    harness fell back to loading the tokenizer by the model's name. A gateway in front
    of several models cannot tell whose: a 400."""
    direct = httpx.get(servers.replica.url + "/tokenizer_info", timeout=30)
    assert direct.status_code == 200 and direct.json()["eos_token"]
    assert direct.json()["model_max_length"] > 0
    through = httpx.get(servers.single.url + "/tokenizer_info", timeout=30)
    assert through.status_code == 200 and through.json() == direct.json()
    assert through.headers["x-prefixgate-replica"]
    several = httpx.get(servers.gateway.url + "/tokenizer_info", timeout=30)
    assert several.status_code == 400 and several.json()["error"]["code"] == "missing_model"
    posted = httpx.post(servers.single.url + "/tokenizer_info", json={}, timeout=30)
    assert posted.status_code == 405 and posted.headers["allow"] == "GET"
    eos = servers.post("/tokenize", {"prompt": direct.json()["eos_token"]}, servers.single.url)
    assert eos.status_code == 200 and len(eos.json()["tokens"]) == 1


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/tokenize", {"model": MODEL}, 400, "invalid_value"),  # neither prompt nor messages
        ("/tokenize", {"model": MODEL, "prompt": "a", "messages": MESSAGES}, 400, "invalid_value"),
        ("/detokenize", {"model": MODEL, "tokens": [10**9]}, 400, "invalid_value"),
        ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "invalid_value"),
        ("/tokenize", {"model": "nobody-serves-it", "prompt": "a"}, 404, "model_not_found"),
        ("/tokenize", {"model": 7, "prompt": "a"}, 400, "invalid_value"),
        ("/tokenize", [1, 2], 400, "invalid_json"),
        ("/tokenize", {"prompt": "a"}, 400, "missing_model"),  # two models: which one?
    ],
)
def test_bad_requests_get_openai_errors(
    servers: Servers, path: str, body: Any, status: int, code: str
) -> None:
    answer = servers.post(path, body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code


def test_embeddings_reach_the_replica_serving_the_model(servers: Servers) -> None:
    client = openai.OpenAI(base_url=servers.gateway.url + "/v1", api_key="-", max_retries=0)
    result = client.embeddings.create(model="embedder", input=["one", "three"])
    assert [d.embedding[0] for d in result.data] == [3.0, 5.0]
    # The other replica (a model without embeddings) answers its own 404, as vLLM would.
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=MODEL, input="one")


def test_only_post(servers: Servers) -> None:
    answer = httpx.get(servers.gateway.url + "/tokenize")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
