"""A batch of completion prompts (``prompt`` a list), as vLLM and SGLang take it and
evaluation harnesses send it (lm-evaluation-harness batches its loglikelihood requests).
The gateway refused every batch (400 "batched prompts are not supported") before any
engine saw it. Now it is keyed by its first prompt and goes on as sent; the next batch
that shares the first prompt's prefix goes to the same engine. Two stub engines."""

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
SHOTS = "Question: what is two and two?\nAnswer: four.\n\n" * 20


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[StubCluster]:
    with stub_cluster(tmp_path, MODEL) as running:
        yield running


@pytest.mark.parametrize("as_ids", [False, True])
def test_a_batch_of_prompts_reaches_an_engine_and_the_next_batch_the_same_one(
    cluster: StubCluster, as_ids: bool
) -> None:
    gateway = cluster.gateway
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    replicas = []
    for batch in range(3):
        texts = [f"{SHOTS}Question: {batch}-{i}?\nAnswer:" for i in range(4)]
        ids = [[1000 + ord(c) % 500 for c in text] for text in texts]
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=ids if as_ids else texts, max_tokens=1
        )
        replicas.append(raw.headers["x-prefixgate-replica"])
        if batch:
            assert raw.headers["x-prefixgate-route"].startswith("prefix_match")
    assert len(set(replicas)) == 1, replicas
    sent = [r["body"]["prompt"] for r in cluster.received("/v1/completions")]
    assert len(sent) == 3 and all(len(p) == 4 for p in sent)  # passed on whole


def test_a_batch_with_an_empty_or_out_of_range_prompt_is_a_400(
    cluster: StubCluster,
) -> None:
    gateway = cluster.gateway
    for prompt in ([[5, 6], []], [[5], [-1]], []):
        answer = httpx.post(
            gateway.url + "/v1/completions", json={"model": MODEL, "prompt": prompt}, timeout=30
        )
        assert answer.status_code == 400, prompt
        assert answer.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    "scoring",
    [{"echo": True, "logprobs": 1}, {"prompt_logprobs": 0}],
    ids=["echo-logprobs", "prompt-logprobs"],
)
def test_a_batch_that_scores_its_prompts_is_routed_as_computed_whole(
    cluster: StubCluster, scoring: dict[str, object]
) -> None:
    """lm-evaluation-harness's loglikelihood requests ask for the prompt's log
    probabilities, for which vLLM computes the whole prompt whatever its cache holds. So
    the gateway prices them with nothing cached: no prefix match, however warm the
    prefix is; the same batch without them goes by its prefix. Passed on as sent."""
    client = openai.OpenAI(base_url=cluster.gateway.url + "/v1", api_key="x", max_retries=0)
    texts = [f"{SHOTS}Question: scored-{i}?\nAnswer:" for i in range(4)]
    for _ in range(2):
        plain = client.completions.with_raw_response.create(model=MODEL, prompt=texts, max_tokens=1)
    assert plain.headers["x-prefixgate-route"].startswith("prefix_match")
    scored = client.completions.with_raw_response.create(
        model=MODEL, prompt=texts, max_tokens=1, extra_body=scoring
    )
    route = scored.headers["x-prefixgate-route"]
    assert route.startswith("no_match") and "matched=0/0" in route, route
    sent = [r["body"] for r in cluster.received("/v1/completions")]
    assert sum(all(b.get(k) == v for k, v in scoring.items()) for b in sent) == 1


def test_what_an_engine_may_accept_passes_the_gateway(cluster: StubCluster) -> None:
    """The gateway refused ``max_tokens`` 0 with ``echo`` (vLLM's way to score a prompt
    alone) and more than 20 log probabilities (vLLM's ``--max-logprobs`` may allow them):
    limits that are the engine's to set. Both now reach the engine as sent; ``max_tokens``
    0 without ``echo`` is still a 400, as vLLM answers it."""
    body = {"model": MODEL, "prompt": "tides", "max_tokens": 0, "echo": True, "logprobs": 50}
    answer = httpx.post(cluster.gateway.url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    sent = [r["body"] for r in cluster.received("/v1/completions")]
    assert [b for b in sent if b.get("logprobs") == 50] == [body]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True}
    for extra in ({"top_logprobs": 50}, {"top_logprobs": -1}):
        answer = httpx.post(
            cluster.gateway.url + "/v1/chat/completions", json=chat | extra, timeout=30
        )
        assert answer.status_code == 200, answer.text
    refused = httpx.post(
        cluster.gateway.url + "/v1/completions",
        json={"model": MODEL, "prompt": "tides", "max_tokens": 0},
        timeout=30,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_the_engines_own_limits_are_not_the_gateways(cluster: StubCluster) -> None:
    """The gateway refused what vLLM 0.32 answers (checked against it): more than 16
    choices, a stop string over 1,024 characters, over 256 stop token ids, over 300
    biased tokens or a bias over 100, a repetition penalty over 2. Those were the built-in
    replica's limits; the replica still answers them with a 400 of its own."""
    chat: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for extra in (
        {"n": 20},
        {"stop": ["z" * 2000]},
        {"stop_token_ids": list(range(100, 400))},
        {"logit_bias": {str(t): 1 for t in range(100, 500)}},
        {"logit_bias": {"100": 150}},
        {"repetition_penalty": 3.0},
    ):
        answer = httpx.post(
            cluster.gateway.url + "/v1/chat/completions", json=chat | extra, timeout=30
        )
        assert answer.status_code == 200, (extra, answer.text)
    for extra in ({"n": 0}, {"stop": [""]}, {"repetition_penalty": 0}):
        answer = httpx.post(
            cluster.gateway.url + "/v1/chat/completions", json=chat | extra, timeout=30
        )
        assert answer.status_code == 400, extra  # what no engine takes


def test_prompt_embeddings_reach_the_engine(cluster: StubCluster) -> None:
    """vLLM takes ``prompt_embeds`` (base64 tensors, ``--enable-prompt-embeds``) in place
    of a prompt; the gateway answered ``prompt: Field required``. Now they pass, routed by
    load (nothing to key); neither is still vLLM's 400."""
    for embeds in ("AAAAAA==", ["AAAAAA==", "AAAAAB=="]):
        body = {"model": MODEL, "prompt_embeds": embeds, "max_tokens": 2}
        answer = httpx.post(cluster.gateway.url + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert "matched=0/0" in answer.headers["x-prefixgate-route"]
        assert body in [r["body"] for r in cluster.received("/v1/completions")]
    empties: list[dict[str, Any]] = [{}, {"prompt_embeds": []}, {"prompt_embeds": None}]
    for empty in empties:
        body = {"model": MODEL, "max_tokens": 2, **empty}
        answer = httpx.post(cluster.gateway.url + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
