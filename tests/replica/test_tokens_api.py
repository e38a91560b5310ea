"""vLLM's token-in/token-out API on a real tiny-random replica, driven with httpx (the
openai client has no method for it): ``/inference/v1/generate`` whole and streamed, in
both output modes, checked token for token against ``/v1/completions`` with the same
token-id prompt, in vLLM's shapes; the refusals; and ``/inference/v1/abort_requests``."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from prefixgate.procs import stop_process
from replica.handle import RequestHandle
from replica.tokens_api import InFlight
from tests.conftest import wait_until
from tests.replica.conftest import MODEL, ReplicaProcess, start_replica

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
PROMPT = list(range(1000, 1040))
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
LONG = {"max_tokens": 3500, "ignore_eos": True}  # seconds of decoding on the CPU
NUM_BLOCKS = 600  # 9,600 tokens: more than the 8,192 of the context, so it can be reached
FREED_WITHIN_S = 5.0

# vLLM 0.32's keys, in its order (tests/replica samples: /tmp/vllm-generate-samples.txt).
WHOLE_KEYS = [
    *("request_id", "model", "created", "usage", "prompt_logprobs"),
    *("prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders", "metrics"),
    *("kv_transfer_params", "ec_transfer_params", "output_mode", "choices"),
]
CHOICE_KEYS = [
    *("index", "finish_reason", "stop_reason", "token_ids"),
    *("routed_experts", "sampling_mask", "weight_versions", "logprobs"),
]
MODES = ["tokens", "text"]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    rep = start_replica(tmp_path_factory.mktemp("tokens"), "--num-blocks", str(NUM_BLOCKS))
    yield rep
    stop_process(rep.proc)


def _post(
    replica: ReplicaProcess, path: str, body: dict[str, Any], **headers: str
) -> httpx.Response:
    return httpx.post(replica.url + path, json=body, headers=headers, timeout=120)


def _generate(replica: ReplicaProcess, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    resp = _post(replica, GENERATE, body, **headers)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def _stream(replica: ReplicaProcess, body: dict[str, Any], **headers: str) -> list[dict[str, Any]]:
    """A streamed answer's chunks; it must end with ``[DONE]``."""
    with httpx.stream(
        "POST", replica.url + GENERATE, json={**body, "stream": True}, headers=headers, timeout=120
    ) as resp:
        assert resp.status_code == 200, resp.read()
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _completion(replica: ReplicaProcess, prompt: list[int], **params: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "return_token_ids": True, **params}
    resp = _post(replica, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def _choice_keys(mode: str) -> list[str]:
    return CHOICE_KEYS if mode == "tokens" else [*CHOICE_KEYS[:-1], "text", "logprobs"]


def _joined(chunks: list[dict[str, Any]], index: int = 0) -> tuple[list[int], str, list[Any]]:
    """One choice's token ids, text and log probability items over a stream's chunks."""
    ids: list[int] = []
    text = ""
    items: list[Any] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] == index:
                ids += choice["token_ids"]
                text += choice.get("text", "")
                items += (choice["logprobs"] or {"content": []})["content"]
    return ids, text, items


@pytest.mark.parametrize("mode", MODES)
def test_whole_answer_is_the_completions_in_vllms_shape(replica: ReplicaProcess, mode: str) -> None:
    answer = _generate(
        replica,
        {"token_ids": PROMPT, "sampling_params": GREEDY, "output_mode": mode, "priority": 3},
    )
    expected = _completion(replica, PROMPT, **GREEDY)
    assert list(answer) == WHOLE_KEYS
    assert answer["model"] == MODEL and answer["output_mode"] == mode
    assert re.fullmatch(r"generate-tokens-[0-9a-f]{16}", answer["request_id"])
    (choice,) = answer["choices"]
    assert list(choice) == _choice_keys(mode)
    want = expected["choices"][0]
    assert choice["token_ids"] == want["token_ids"] and len(want["token_ids"]) == 12
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    if mode == "text":
        assert choice["text"] == want["text"]
    assert choice["logprobs"] is None and answer["prompt_token_ids"] is None
    use = answer["usage"]
    assert list(use) == [
        *("prompt_tokens", "total_tokens", "completion_tokens"),
        *("prompt_tokens_details", "completion_tokens_details"),
    ]
    assert (use["prompt_tokens"], use["completion_tokens"]) == (len(PROMPT), 12)
    assert use["total_tokens"] == len(PROMPT) + 12
    assert set(use["prompt_tokens_details"]) == {
        "cached_tokens",
        "created_cache_tokens",
        "multimodal_tokens",
    }


@pytest.mark.parametrize("mode", MODES)
def test_streamed_answer_is_the_completions_in_vllms_chunks(
    replica: ReplicaProcess, mode: str
) -> None:
    prompt = PROMPT[:30]
    chunks = _stream(
        replica,
        {
            "token_ids": prompt,
            "sampling_params": GREEDY,
            "output_mode": mode,
            "stream_options": {"include_usage": True},
        },
    )
    want = _completion(replica, prompt, **GREEDY)["choices"][0]
    *deltas, usage = chunks
    ids, text, _ = _joined(deltas)
    assert ids == want["token_ids"]
    assert [len(c["choices"][0]["token_ids"]) for c in deltas] == [1] * 12
    if mode == "text":
        assert text == want["text"]
    for chunk in deltas:
        assert list(chunk) == ["request_id", "usage", "output_mode", "choices"]
        assert chunk["usage"] is None and chunk["output_mode"] == mode
        assert list(chunk["choices"][0]) == _choice_keys(mode)
        assert chunk["request_id"] == chunks[0]["request_id"]
    assert [c["choices"][0]["finish_reason"] for c in deltas] == [None] * 11 + ["length"]
    assert usage["choices"] == [] and usage["request_id"] == chunks[0]["request_id"]
    use = usage["usage"]
    assert (use["prompt_tokens"], use["completion_tokens"], use["total_tokens"]) == (30, 12, 42)
    assert list(use["prompt_tokens_details"]) == ["cached_tokens"]


def test_continuous_usage_counts_each_choice_so_far(replica: ReplicaProcess) -> None:
    chunks = _stream(
        replica,
        {
            "token_ids": PROMPT,
            "sampling_params": {**GREEDY, "max_tokens": 3},
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]
    assert chunks[0]["usage"]["total_tokens"] == len(PROMPT) + 1


def test_two_seeded_choices_whole_and_streamed(replica: ReplicaProcess) -> None:
    sampling = {"temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 6, "ignore_eos": True}
    body = {"token_ids": PROMPT, "sampling_params": sampling, "output_mode": "text"}
    first, again = _generate(replica, body), _generate(replica, body)
    want = _completion(replica, PROMPT, **sampling)["choices"]
    got = [(c["index"], c["token_ids"], c["text"]) for c in first["choices"]]
    assert got == [(c["index"], c["token_ids"], c["text"]) for c in want]
    assert got[0][1] != got[1][1]  # each choice draws on its own
    assert again["choices"] == first["choices"]
    assert first["usage"]["completion_tokens"] == 12
    chunks = _stream(replica, body)
    for index in (0, 1):
        ids, text, _ = _joined(chunks, index)
        assert (ids, text) == (got[index][1], got[index][2])


def test_tokens_mode_logprobs_by_id(replica: ReplicaProcess) -> None:
    sampling = {**GREEDY, "logprobs": 2}
    answer = _generate(replica, {"token_ids": PROMPT, "sampling_params": sampling})
    want = _completion(replica, PROMPT, **sampling)["choices"][0]["logprobs"]
    (choice,) = answer["choices"]
    items = choice["logprobs"]["content"]
    assert [i["token_id"] for i in items] == choice["token_ids"]
    for item, value in zip(items, want["token_logprobs"], strict=True):
        assert list(item) == ["token_id", "logprob", "rank", "top_logprobs"]
        assert math.isclose(item["logprob"], value, abs_tol=1e-4)
        assert item["rank"] == 1  # greedy: the likeliest
        first, second = item["top_logprobs"]  # the sampled token first, then the next
        assert first == {"token_id": item["token_id"], "logprob": item["logprob"], "rank": 1}
        assert second["rank"] == 2 and second["logprob"] <= first["logprob"]
    streamed = _joined(_stream(replica, {"token_ids": PROMPT, "sampling_params": sampling}))[2]
    assert streamed == items
    # 0 asks for the sampled token's alone (vLLM's max(k, 1) entries).
    zero = _generate(replica, {"token_ids": PROMPT, "sampling_params": {**GREEDY, "logprobs": 0}})
    assert [len(i["top_logprobs"]) for i in zero["choices"][0]["logprobs"]["content"]] == [1] * 12


def test_text_mode_logprobs_are_chat_shaped(replica: ReplicaProcess) -> None:
    sampling = {**GREEDY, "logprobs": 1}
    body = {"token_ids": PROMPT, "sampling_params": sampling, "output_mode": "text"}
    (choice,) = _generate(replica, body)["choices"]
    tokens = _generate(replica, {**body, "output_mode": "tokens"})["choices"][0]["logprobs"]
    items = choice["logprobs"]["content"]
    assert len(items) == 12
    for item, by_id in zip(items, tokens["content"], strict=True):
        assert list(item) == ["token", "logprob", "bytes", "top_logprobs"]
        assert math.isclose(item["logprob"], by_id["logprob"], abs_tol=1e-4)
        assert item["bytes"] == list(item["token"].encode())
        assert item["top_logprobs"] == [{k: item[k] for k in ("token", "logprob", "bytes")}]
    assert _joined(_stream(replica, body))[2] == items


@pytest.mark.parametrize("mode", MODES)
def test_a_stop_token_id_is_the_stop_reason(replica: ReplicaProcess, mode: str) -> None:
    greedy = _generate(replica, {"token_ids": PROMPT, "sampling_params": GREEDY})
    ids = greedy["choices"][0]["token_ids"]
    stop_id = ids[len(ids) // 2]  # it ends the answer where it first comes
    sampling = {**GREEDY, "stop_token_ids": [stop_id]}
    body = {"token_ids": PROMPT, "sampling_params": sampling, "output_mode": mode}
    (choice,) = _generate(replica, body)["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    assert choice["token_ids"] == ids[: ids.index(stop_id) + 1]  # the stop token is kept
    last = _stream(replica, body)[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop_id)


@pytest.mark.parametrize("mode", MODES)
def test_a_stop_string_is_the_stop_reason(replica: ReplicaProcess, mode: str) -> None:
    text = _completion(replica, PROMPT, **GREEDY)["choices"][0]["text"]
    stop = text[len(text) // 2 :][:3]
    sampling = {**GREEDY, "stop": [stop]}
    want = _completion(replica, PROMPT, **sampling)["choices"][0]
    body = {"token_ids": PROMPT, "sampling_params": sampling, "output_mode": mode}
    (choice,) = _generate(replica, body)["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["token_ids"] == want["token_ids"]
    if mode == "text":
        assert choice["text"] == want["text"] == text[: text.index(stop)]
    chunks = _stream(replica, body)
    assert _joined(chunks)[0] == want["token_ids"]
    assert chunks[-1]["choices"][0]["stop_reason"] == stop


def test_request_id_from_the_header_before_the_body(replica: ReplicaProcess) -> None:
    body = {"token_ids": PROMPT, "sampling_params": {**GREEDY, "max_tokens": 2}}
    header = _generate(replica, {**body, "request_id": "from-body"}, **{"x-request-id": "hdr-7"})
    assert header["request_id"] == "generate-tokens-hdr-7"
    assert _generate(replica, {**body, "request_id": "b-1"})["request_id"] == "generate-tokens-b-1"
    # A header the replica cannot take (a space) is replaced: the body's id is used.
    bad = _generate(replica, {**body, "request_id": "b-2"}, **{"x-request-id": "a b"})
    assert bad["request_id"] == "generate-tokens-b-2"
    chunks = _stream(replica, {**body, "request_id": "s-1"}, **{"x-request-id": "hdr-8"})
    assert {c["request_id"] for c in chunks} == {"generate-tokens-hdr-8"}


def test_return_token_ids_gives_the_prompt(replica: ReplicaProcess) -> None:
    body = {"token_ids": PROMPT, "sampling_params": {**GREEDY, "max_tokens": 3}}
    assert _generate(replica, {**body, "return_token_ids": True})["prompt_token_ids"] == PROMPT
    chunks = _stream(replica, {**body, "return_token_ids": True, "output_mode": "text"})
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert list(chunks[0]) == ["request_id", "usage", "prompt_token_ids", "output_mode", "choices"]
    assert all("prompt_token_ids" not in c for c in chunks[1:]) and len(chunks) == 3


def test_cache_salt_separates_cached_prefixes(replica: ReplicaProcess) -> None:
    prompt = list(range(5000, 5064))  # four blocks no other test sends

    def cached(salt: str) -> int:
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1}, "cache_salt": salt}
        return int(_generate(replica, body)["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 48
    assert cached("tenant-b") == 0


def test_max_tokens_is_cut_to_the_context_and_absent_runs_to_it(
    replica: ReplicaProcess,
) -> None:
    context = int(replica.get("/v1/models").json()["data"][0]["max_model_len"])
    prompt = [(7 * i) % 40000 + 100 for i in range(context - 5)]
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 5000, "ignore_eos": True}}
    # /v1/completions refuses it; vLLM's generate cuts it to what is left.
    refused = _post(
        replica, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5000}
    )
    assert refused.status_code == 400
    for sampling in ({"max_tokens": 5000}, {}):
        answer = _generate(replica, {**body, "sampling_params": {**sampling, "ignore_eos": True}})
        (choice,) = answer["choices"]
        assert (choice["finish_reason"], len(choice["token_ids"])) == ("length", 5)


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"token_ids": []}, 400, "token_ids"),
        ({"token_ids": [1, -2]}, 400, "token_ids.1"),
        ({"token_ids": [1, 10**8]}, 400, "token_ids"),
        ({"token_ids": [1, "2"]}, 400, "token_ids.1"),
        ({"sampling_params": None}, 400, "sampling_params"),
        ({"model": "nope"}, 404, "model"),
        ({"output_mode": "text", "sampling_params": {"detokenize": False}}, 400, "body"),
        ({"sampling_params": {"detokenize": False, "stop": ["x"]}}, 400, "stop"),
        ({"features": {"mm_hashes": {}, "mm_placeholders": {}}}, 400, "features"),
        ({"content_parts": [{"type": "image_url", "url": "x"}]}, 400, "content_parts"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, 400, "kv_transfer_params"),
        ({"ec_transfer_params": {}}, 400, "ec_transfer_params"),
        ({"cache_salt": ""}, 400, "cache_salt"),
        ({"output_mode": "bytes"}, 400, "output_mode"),
        ({"sampling_params": {"max_tokens": 0}}, 400, "max_tokens"),
        ({"sampling_params": {"n": 17}}, 400, "n"),
        ({"sampling_params": {"bad_words": ["x"]}}, 400, "bad_words"),
        ({"sampling_params": {"extra_args": {"k": 1}}}, 400, "sampling_params.extra_args"),
        ({"sampling_params": {"logprobs": 21}}, 400, "logprobs"),
        ({"sampling_params": {"prompt_logprobs": 1}, "stream": True}, 400, "prompt_logprobs"),
    ],
)
def test_refusals_are_openai_errors(
    replica: ReplicaProcess, change: dict[str, Any], status: int, param: str
) -> None:
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}, **change}
    if body["sampling_params"] is None:
        del body["sampling_params"]
    resp = _post(replica, GENERATE, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"]


def test_unknown_fields_are_ignored_and_null_ones_are_absent(replica: ReplicaProcess) -> None:
    body = {
        "token_ids": PROMPT,
        "sampling_params": {**GREEDY, "output_kind": 2, "no_such_param": 1},
        **dict.fromkeys(("features", "kv_transfer_params", "token_offsets", "model")),
        "no_such_field": {"x": 1},
        "token_offsets": [[0, 1]] * len(PROMPT),  # a render step's: taken, as vLLM takes them
    }
    want = _completion(replica, PROMPT, **GREEDY)["choices"][0]["token_ids"]
    assert _generate(replica, body)["choices"][0]["token_ids"] == want


def test_prompt_logprobs_in_a_whole_answer(replica: ReplicaProcess) -> None:
    body = {"token_ids": PROMPT[:5], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}}
    scores = _generate(replica, body)["prompt_logprobs"]
    assert scores[0] is None and len(scores) == 5
    for token_id, entries in zip(PROMPT[1:5], scores[1:], strict=True):
        assert str(token_id) in entries  # its own token, then the likeliest
        assert set(entries[str(token_id)]) == {"logprob", "rank", "decoded_token"}


def _pinned(replica: ReplicaProcess) -> int:
    return int(replica.cache_stats()["pinned_blocks"])


def test_abort_ends_a_whole_answer_with_abort(replica: ReplicaProcess) -> None:
    body = {"token_ids": list(range(6000, 6050)), "sampling_params": LONG, "request_id": "w-1"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, replica, GENERATE, body)
        wait_until(lambda: _pinned(replica) > 0, timeout_s=30, what="the request running")
        resp = _post(replica, ABORT, {"request_ids": ["w-1", "generate-tokens-w-1", "nope"]})
        assert (resp.status_code, resp.content) == (200, b"")
        answer = pending.result(timeout=60)
    assert answer.status_code == 200
    (choice,) = answer.json()["choices"]
    assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 3500
    wait_until(lambda: _pinned(replica) == 0, timeout_s=FREED_WITHIN_S, what="no pinned blocks")


@pytest.mark.parametrize("mode", MODES)
def test_abort_ends_a_stream_with_an_abort_chunk(replica: ReplicaProcess, mode: str) -> None:
    body = {
        "token_ids": list(range(6100, 6150)),
        "sampling_params": LONG,
        "output_mode": mode,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-request-id": f"s-{mode}"}
    with httpx.stream("POST", replica.url + GENERATE, json=body, headers=headers, timeout=60) as r:
        lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines))
        assert first["request_id"] == f"generate-tokens-s-{mode}"
        assert _post(replica, ABORT, {"request_ids": [first["request_id"]]}).status_code == 200
        data = list(lines)
    assert data[-1] == "[DONE]"
    *deltas, usage = [json.loads(d) for d in data[:-1]]
    last = deltas[-1]["choices"][0]
    assert (last["finish_reason"], last["token_ids"]) == ("abort", [])
    assert all(d["choices"][0]["finish_reason"] is None for d in deltas[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] < 3500
    wait_until(lambda: _pinned(replica) == 0, timeout_s=FREED_WITHIN_S, what="no pinned blocks")


def test_abort_requests_needs_request_ids(replica: ReplicaProcess) -> None:
    resp = _post(replica, ABORT, {"ids": ["x"]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "request_ids"
    assert _post(replica, ABORT, {"request_ids": []}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_frees_its_blocks(replica: ReplicaProcess, stream: bool) -> None:
    body = {"token_ids": list(range(6200, 6250)), "sampling_params": LONG, "stream": stream}
    if stream:
        with httpx.stream("POST", replica.url + GENERATE, json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert _pinned(replica) > 0
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(replica.url + GENERATE, json=body, timeout=httpx.Timeout(1.0))
    wait_until(lambda: _pinned(replica) == 0, timeout_s=FREED_WITHIN_S, what="no pinned blocks")
    assert replica.metric("prefixgate:num_requests_running") == 0


# ---------------------------------------------------------------------------- in flight


class _Engine:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


class _Replica:
    def __init__(self) -> None:
        self.engine = _Engine()


def test_in_flight_aborts_every_request_of_an_id_and_forgets_each() -> None:
    in_flight = InFlight()
    a, b, c = RequestHandle("e-a", 1), RequestHandle("e-b", 1), RequestHandle("e-c", 1)
    in_flight.add("generate-tokens-x", "e-a", a)
    in_flight.add("generate-tokens-x", "e-b", b)  # a client's id, sent twice
    in_flight.add("generate-tokens-y", "e-c", c)
    rep: Any = _Replica()
    in_flight.abort(["generate-tokens-x", "x", "generate-tokens-z"], rep)
    assert sorted(rep.engine.cancelled) == ["e-a", "e-b"]
    in_flight.forget("generate-tokens-x", "e-a")
    in_flight.forget("generate-tokens-x", "e-a")  # twice: the stream's end and its task
    assert set(in_flight.handles) == {"generate-tokens-x", "generate-tokens-y"}
    in_flight.forget("generate-tokens-x", "e-b")
    in_flight.forget("generate-tokens-y", "e-c")
    assert in_flight.handles == {}
