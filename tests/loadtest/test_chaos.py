"""The chaos benchmark's client side: how an answer is judged, and what is sent.

(The scenarios themselves start clusters and run for minutes: benchmarks/chaos.py, with
results in docs/BENCHMARKS.md.)"""

from __future__ import annotations

import json
import random

import pytest

from loadtest.chaos_load import Outcome, RequestSpec, Tally, _read_body, _read_stream
from loadtest.chaos_requests import honest, hostile_catalogue, mixed
from loadtest.chaos_row import Row

USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 2,
    "prompt_tokens_details": {"cached_tokens": 32},
}


def _outcome(stream: bool = True) -> Outcome:
    return Outcome("ok", "", 0.0, 0.0, stream, None)


def _sse(*events: object) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def _named(*events: tuple[str, object]) -> str:
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)


RESPONSE_USAGE = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}}


@pytest.mark.parametrize(
    ("text", "kind", "saw"),
    [
        (
            _sse({"choices": []}, {"choices": [], "usage": USAGE}, "[DONE]"),
            "ok",
            "stream to [DONE]",
        ),
        (
            _sse({"choices": []}, {"error": {"message": "replica gone"}}, "[DONE]"),
            "failed",
            "stream: error event then [DONE]",
        ),
        (
            _sse({"choices": []}, {"error": {"message": "replica gone"}}),
            "failed",
            "stream: error event without [DONE]",
        ),
        (_sse({"choices": []}), "failed", "stream: cut without [DONE]"),
        ("", "failed", "stream: cut without [DONE]"),
        # A Responses stream: named events, ended by its last one (no [DONE]).
        (
            _named(
                ("response.created", {}),
                ("response.output_text.delta", {"delta": "x"}),
                ("response.completed", {"response": {"usage": RESPONSE_USAGE}}),
            ),
            "ok",
            "responses stream to its last event",
        ),
        (
            _named(("response.created", {}), ("error", {"message": "replica gone"})),
            "failed",
            "responses stream: error event",
        ),
        (_named(("response.created", {})), "failed", "responses stream: cut before its last event"),
    ],
)
def test_a_stream_is_ok_only_when_it_ends_whole_with_no_error_event(
    text: str, kind: str, saw: str
) -> None:
    out = _outcome()
    _read_stream(text, out)
    assert (out.kind, out.saw) == (kind, saw)
    if kind == "ok":
        assert (out.prompt_tokens, out.cached_tokens) == (40, 32)


def test_a_plain_answer_needs_choices() -> None:
    out = _outcome(stream=False)
    _read_body(json.dumps({"choices": [{"text": "x"}], "usage": USAGE}).encode(), out)
    assert (out.kind, out.cached_tokens) == ("ok", 32)
    for body in (b"{}", b"not json", b'{"choices": []}'):
        out = _outcome(stream=False)
        _read_body(body, out)
        assert out.kind == "failed"


def test_tally_counts_windows_and_what_clients_saw() -> None:
    outcomes = [
        Outcome("ok", "HTTP 200", 1.0, 0.2, False, None, "r0", 100, 50),
        Outcome("ok", "HTTP 200", 6.0, 0.2, False, None, "r1", 100, 100),
        Outcome("failed", "connection refused", 6.5, 0.0, False, None),
        Outcome("failed", "connection refused", 6.6, 0.0, False, None),
        Outcome("hung", "no answer within 60 s", 7.0, 60.0, True, None),
        Outcome("disconnected", "client left", 7.5, 99.0, True, None),
        Outcome("ok", "HTTP 400 invalid_value", 8.0, 0.1, False, "seed 2**64"),
    ]
    tally = Tally(outcomes, started=100.0)
    assert tally.row() == {
        "sent": 7,
        "succeeded": 3,
        "failed": 2,
        "hung": 1,
        "disconnected": 1,
        "client saw": "2× connection refused; 1× no answer within 60 s; 1× client left; "
        "1× HTTP 400 invalid_value",
    }
    assert tally.hit_rate() == pytest.approx(0.75)
    assert tally.hit_rate(5.0) == 1.0 and tally.hit_rate(9.0) is None
    assert tally.max_latency_s() == 60.0  # an abandoned request is not a slow one
    assert tally.since_start(103.5) == 3.5


def test_hostile_bodies_are_what_their_names_say() -> None:
    catalogue = {name: (path, body) for name, path, body in hostile_catalogue("m")}
    assert len(catalogue) == len(hostile_catalogue("m"))
    with pytest.raises(UnicodeDecodeError):
        catalogue["not UTF-8"][1].decode()
    with pytest.raises(json.JSONDecodeError):
        json.loads(catalogue["not JSON"][1])
    assert b"[" * 1_000 + b"]" * 1_000 in catalogue["JSON 1,000 deep"][1]
    assert b"9" * 5_000 in catalogue["5,000-digit integer"][1]
    assert json.loads(catalogue["seed 2**64"][1])["seed"] == 2**64
    surrogate = json.loads(catalogue["lone surrogate in cache_salt"][1])["cache_salt"]
    assert surrogate == "\ud800"


def test_request_mixes_are_seeded_and_keep_their_shares() -> None:
    make = mixed("m", hostile_share=0.2, disconnect_share=0.3)
    specs = [make(random.Random(7)) for _ in range(3)]
    assert specs[0] == specs[1] == specs[2]  # the same seed, the same request
    rng = random.Random(0)
    drawn: list[RequestSpec] = [make(rng) for _ in range(2_000)]
    hostile = sum(s.hostile is not None for s in drawn) / len(drawn)
    abandoned = sum(s.disconnect_after_s is not None for s in drawn) / len(drawn)
    assert hostile == pytest.approx(0.2, abs=0.03) and abandoned == pytest.approx(0.3, abs=0.03)
    turn = honest("m", stream_share=1.0, responses_share=0.0)(random.Random(1))
    body = json.loads(turn.body)
    assert turn.stream and body["stream"] and body["stream_options"] == {"include_usage": True}
    turns = [honest("m", responses_share=0.25)(rng) for _ in range(2_000)]
    responses = [json.loads(t.body) for t in turns if t.path == "/v1/responses"]
    assert len(responses) / len(turns) == pytest.approx(0.25, abs=0.03)
    assert {r["store"] for r in responses} == {True, False}
    assert {r["stream"] for r in responses} == {True, False}
    assert all(r["instructions"].startswith("You are the support") for r in responses)


def test_a_whole_response_needs_output_and_an_ending_status() -> None:
    out = _outcome(stream=False)
    body = {"object": "response", "status": "completed", "output": [{}], "usage": RESPONSE_USAGE}
    _read_body(json.dumps(body).encode(), out)
    assert (out.kind, out.prompt_tokens, out.cached_tokens) == ("ok", 40, 32)
    for bad in ({**body, "status": "failed"}, {**body, "output": []}):
        out = _outcome(stream=False)
        _read_body(json.dumps(bad).encode(), out)
        assert out.kind == "failed"


def test_a_row_is_one_markdown_line_and_fails_on_any_broken_check() -> None:
    outcomes = [Outcome("failed", "stream: cut\n\ndata: x | y", 1.0, 0.1, True, None)]
    row = Row.of("kill", Tally(outcomes, started=0.0))
    row.check(True, "hung: 0")
    row.check(False, "streams cut: 1, 0 ended error+[DONE]")
    line = row.markdown()
    assert "\n" not in line and line.count("|") == 9
    assert line.endswith("| FAIL: streams cut: 1, 0 ended error+[DONE] |")
    assert row.seen == {"stream: cut\n\ndata: x | y": 1}
