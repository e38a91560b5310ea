"""Hostile sampling fields against a real replica: a 400 that names the field, never a
dead engine. After each, the same replica serves the next request and holds no pins."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from prefixgate.procs import stop_process
from prefixgate.wire import is_error_body
from tests.conftest import wait_until
from tests.replica.conftest import MODEL, ReplicaProcess, start_replica

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    rep = start_replica(tmp_path_factory.mktemp("replica-hostile"))
    yield rep
    stop_process(rep.proc)


def _still_serving(replica: ReplicaProcess) -> None:
    """The engine is alive, serves the next request and no block stays pinned."""
    assert replica.get("/health").status_code == 200, replica.log_tail()
    out = replica.client(timeout=30).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    wait_until(lambda: replica.cache_stats()["pinned_blocks"] == 0, what="no pinned blocks")


def _bad_request(replica: ReplicaProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    raw = json.dumps(body).encode()  # NaN and Infinity as Python's json writes them
    headers = {"content-type": "application/json"}
    resp = httpx.post(replica.url + path, content=raw, headers=headers, timeout=30)
    assert resp.status_code == 400, (resp.status_code, resp.text)
    payload = resp.json()
    assert is_error_body(payload), payload
    error: dict[str, Any] = payload["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_seed_outside_int64_is_a_400_and_the_engine_goes_on(replica: ReplicaProcess) -> None:
    for seed in (2**64, 2**63, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as info:
            replica.client(timeout=30).chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=3, seed=seed
            )
        assert info.value.param == "seed", info.value.message
    _still_serving(replica)
    # The edges of int64 are valid seeds, with every choice's seed + index too.
    for seed in (2**63 - 1, -(2**63)):
        out = replica.client(timeout=30).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=3, seed=seed, n=2
        )
        assert len(out.choices) == 2
    _still_serving(replica)


def test_a_tiny_temperature_is_greedy(replica: ReplicaProcess) -> None:
    client = replica.client(timeout=30)
    greedy = client.completions.create(
        model=MODEL,
        prompt="The quick brown",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    for temperature in (1e-40, 5e-324, 1e-6):
        out = client.completions.create(
            model=MODEL,
            prompt="The quick brown",
            max_tokens=8,
            temperature=temperature,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == greedy.choices[0].text
    _still_serving(replica)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 1.5),
        ("top_p", 0.0),
        ("top_k", -2),
        ("top_k", 10**12),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.5),  # the replica's limits, wider on vLLM: checked here
        ("n", 17),
        ("stop_token_ids", list(range(100, 400))),
        ("logit_bias", {str(t): 1 for t in range(100, 401)}),
        ("logit_bias", {"100": 101}),
        ("logit_bias", {"not-a-token": 1}),
        ("logit_bias", {"99999999": 1}),
        ("stop", ["x"] * 17),
        ("stop", "x" * 1025),
        ("stop", ""),
        ("stop_token_ids", [2**32]),
        ("stop_token_ids", [99_999_999]),
        ("max_tokens", 2**70),
        ("n", 10**6),
        ("temperature", float("nan")),
        ("top_p", float("nan")),
        ("presence_penalty", float("inf")),
        ("logit_bias", {"5": float("nan")}),
    ],
)
def test_sampling_field_out_of_range_is_a_400(
    replica: ReplicaProcess, field: str, value: Any
) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, field: value}
    error = _bad_request(replica, "/v1/chat/completions", body)
    assert error["param"] is not None and error["param"].startswith(field), error
    _still_serving(replica)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_beam_search", True),
        ("bad_words", ["the"]),
        ("truncate_prompt_tokens", 5),
        ("chat_template", "{{ messages }}"),
        ("echo", True),
    ],
)
def test_vllm_fields_it_cannot_honour_are_a_400_not_ignored(
    replica: ReplicaProcess, field: str, value: Any
) -> None:
    """vLLM honours these; this replica cannot, and answering as if it had (it used to:
    a 200 for a request's ``chat_template``, which it ignored) is worse than saying so."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, field: value}
    error = _bad_request(replica, "/v1/chat/completions", body)
    assert error["param"] == field, error
    _still_serving(replica)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt_embeds": "AAAAAA=="},  # in place of a prompt
        {"prompt": "tides", "prompt_embeds": ["AAAAAA=="]},  # as well
    ],
)
def test_prompt_embeddings_are_a_400_naming_them(
    replica: ReplicaProcess, body: dict[str, Any]
) -> None:
    error = _bad_request(replica, "/v1/completions", {"model": MODEL, "max_tokens": 2, **body})
    assert error["param"] == "prompt_embeds", error
    _still_serving(replica)


def test_vllm_sampling_extras_are_checked_and_neutral_values_pass(replica: ReplicaProcess) -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
    ]
    for extra, param in bad:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra}
        assert _bad_request(replica, "/v1/chat/completions", body)["param"] == param
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "min_tokens": 3}
    assert (
        "min_tokens must be less than or equal"
        in _bad_request(replica, "/v1/chat/completions", body)["message"]
    )
    neutral: dict[str, Any] = {
        "structured_outputs": None,
        "use_beam_search": False,
        "bad_words": [],
        "echo": False,
        "min_p": 0.0,
        "min_tokens": 0,
        "skip_special_tokens": True,
        "priority": 0,
    }
    answer = httpx.post(
        replica.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 2, **neutral},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    _still_serving(replica)


@pytest.mark.parametrize("prompt", [[1, 2**32], [1, -1], [[5, 2**40]], [1, 10**30]])
def test_completion_token_ids_outside_the_vocabulary_are_a_400(
    replica: ReplicaProcess, prompt: list[Any]
) -> None:
    error = _bad_request(replica, "/v1/completions", {"model": MODEL, "prompt": prompt})
    assert error["param"] is not None and error["param"].startswith("prompt"), error
    _still_serving(replica)


def test_logit_bias_and_penalties_are_applied(replica: ReplicaProcess) -> None:
    client = replica.client(timeout=30)

    def complete(**extra: Any) -> str:
        out = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, **extra
        )
        return out.choices[0].text

    plain = complete()
    biased = complete(logit_bias={"1000": 100})
    assert biased != plain and biased == complete(logit_bias={"1000": 100})
    assert complete(frequency_penalty=2.0) != plain or complete(presence_penalty=-2.0) != plain
    _still_serving(replica)
