"""Structured output on the built-in replica (replica/grammar.py), as vLLM serves it:
``response_format`` JSON and vLLM's ``structured_outputs``, by constrained decoding. The
replica answered every ``response_format`` JSON with a 400 and ignored
``structured_outputs`` (a 200 with free text) before."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from replica.engine import Engine, EngineConfig
from replica.grammar import Grammars, GrammarSpec, spec_from_fields
from replica.jobs import INLINE_BODY_BYTES, work_size
from replica.models import load_model
from replica.request import SamplingParams
from tests.replica.conftest import MODEL, ReplicaProcess, tool_replica

CHAT: Any = [{"role": "user", "content": "Answer the question about the harbour."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    """A tiny-random replica that parses tool calls (forced tool choices need it, as
    vLLM's need ``--tool-call-parser``)."""
    yield from tool_replica(tmp_path_factory.mktemp("structured"))


def _chat(replica: ReplicaProcess, stream: bool = False, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 0, **extra}
    return httpx.post(
        replica.url + "/v1/chat/completions", json=body | {"stream": stream}, timeout=60
    )


def _texts(answer: httpx.Response) -> list[str]:
    if not answer.headers["content-type"].startswith("text/event-stream"):
        return [c["message"]["content"] for c in answer.json()["choices"]]
    texts: dict[int, str] = {}
    for line in answer.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    return [texts[i] for i in sorted(texts)]


@pytest.mark.parametrize(
    ("constraint", "valid"),
    [
        ({"choice": ["north", "south", "east by west"]}, {"north", "south", "east by west"}),
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, re.compile(r"[0-9]{3}-[a-z]{2}")),
    ],
    ids=["choice", "regex"],
)
def test_structured_outputs_hold_whole_streamed_and_sampled(
    replica: ReplicaProcess, constraint: dict[str, Any], valid: Any
) -> None:
    """A random model's output still matches: greedy whole and streamed alike, and each
    of three sampled choices; finished by the grammar (``stop``), not the token limit."""

    def ok(text: str) -> bool:
        return text in valid if isinstance(valid, set) else valid.fullmatch(text) is not None

    whole = _chat(replica, structured_outputs=constraint)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["finish_reason"] == "stop"
    (text,) = _texts(whole)
    assert ok(text), text
    assert _texts(_chat(replica, stream=True, structured_outputs=constraint)) == [text]
    sampled = _chat(replica, structured_outputs=constraint, n=3, temperature=1.0, seed=5)
    assert all(ok(t) for t in _texts(sampled)), _texts(sampled)
    completion = httpx.post(
        replica.url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Code:",
            "max_tokens": 24,
            "structured_outputs": constraint,
        },
        timeout=60,
    )
    assert completion.status_code == 200 and ok(completion.json()["choices"][0]["text"])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format",
        ),
    ],
)
def test_a_constraint_that_cannot_hold_is_a_400(
    replica: ReplicaProcess, extra: dict[str, Any], param: str
) -> None:
    answer = _chat(replica, **extra)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert _chat(replica).status_code == 200  # and the replica serves on


def test_specs_from_request_fields() -> None:
    assert spec_from_fields(None, None) is None
    assert spec_from_fields({"type": "text"}, None) is None
    assert spec_from_fields({"type": "json_object"}, None) == GrammarSpec("json_object")
    schema = spec_from_fields({"type": "json_schema", "json_schema": {"schema": PERSON}}, None)
    assert schema == GrammarSpec("json_schema", json.dumps(PERSON))
    # vLLM's own field wins over response_format, as in vLLM; a schema may come as text.
    assert spec_from_fields({"type": "json_object"}, {"json": json.dumps(PERSON)}) == schema
    assert spec_from_fields(None, {"json_object": True}) == GrammarSpec("json_object")


@pytest.mark.slow
def test_json_constraints_on_smollm2_parse_as_asked() -> None:
    """A real model under ``response_format`` JSON: the text parses, as an object; under a
    schema, with the required keys of the required types, in the schema's order."""
    model = load_model("smollm2-135m", dtype="float32")
    tok = model.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Give a person's name and age as JSON."}])
    grammars = Grammars(tok.tokenizer, int(model.vocab_size), tok.eos_token_ids)
    engine = Engine(model, EngineConfig(num_blocks=64, check_invariants=True))
    engine.start()
    try:
        for spec in (GrammarSpec("json_object"), GrammarSpec("json_schema", json.dumps(PERSON))):
            params = SamplingParams(max_tokens=60, temperature=0.0, grammar=grammars.compile(spec))
            out = engine.generate(prompt, params).choices[0]
            assert out.finish_reason == "stop", out.text
            value = json.loads(out.text)
            assert isinstance(value, dict)
            if spec.kind == "json_schema":
                assert list(value) == ["name", "age"]
                assert isinstance(value["name"], str) and isinstance(value["age"], int)
        engine.run_until_idle(timeout=60)
        assert engine.cache.stats().pinned_blocks == 0
    finally:
        engine.stop(timeout=30)


PORTS: Any = [
    {
        "type": "function",
        "function": {
            "name": "tide",
            "parameters": {
                "type": "object",
                "properties": {"port": {"type": "string", "enum": ["Hull", "Leith"]}},
                "required": ["port"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "weather"}},
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    """SmolLM2 with the tool parser: a random model wanders in a JSON grammar's free
    whitespace (as vLLM's default grammar allows) and runs out of tokens."""
    yield from tool_replica(tmp_path_factory.mktemp("structured-smol"), "--model", "smollm2-135m")


@pytest.mark.slow
@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "tide"}}, "required"])
def test_forced_tool_choices_call_as_vllm_does(smol: ReplicaProcess, choice: Any) -> None:
    """A named function or ``required``: the answer is decoded under the calls' grammar
    (vLLM's schema) and comes back as calls, content "" (finish ``stop`` for a named
    function, ``tool_calls`` for ``required``, as OpenAI and vLLM answer); streamed, the
    calls come whole at the end. They were a 400 ("needs constrained decoding")."""
    extra = {"tools": PORTS, "tool_choice": choice, "max_tokens": 64, "model": "smollm2-135m"}
    whole = _chat(smol, **extra)
    assert whole.status_code == 200, whole.text
    answer = whole.json()["choices"][0]
    message = answer["message"]
    assert message["content"] == "" and message["tool_calls"], answer
    names = [c["function"]["name"] for c in message["tool_calls"]]
    for call in message["tool_calls"]:
        arguments = json.loads(call["function"]["arguments"])
        assert isinstance(arguments, dict)
        if call["function"]["name"] == "tide":
            assert arguments["port"] in ("Hull", "Leith")
    if choice == "required":
        assert answer["finish_reason"] == "tool_calls" and set(names) <= {"tide", "weather"}
    else:
        assert answer["finish_reason"] == "stop" and names == ["tide"]
    streamed = _chat(smol, stream=True, **extra)
    calls = [
        c
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
        for ch in json.loads(line[6:])["choices"]
        for c in ch["delta"].get("tool_calls") or []
    ]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]


@pytest.mark.slow
def test_a_forced_tool_choice_on_the_responses_api(smol: ReplicaProcess) -> None:
    """The Responses API's forced function: a function_call item, whole and streamed."""
    client = smol.client(timeout=60)
    kwargs: Any = {
        "model": "smollm2-135m",
        "input": "What are the tides at Hull?",
        "tools": [{"type": "function", **PORTS[0]["function"]}],
        "tool_choice": {"type": "function", "name": "tide"},
        "max_output_tokens": 64,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["tide"], whole.output
    assert json.loads(calls[0].arguments)["port"] in ("Hull", "Leith")  # type: ignore[union-attr]
    done = [
        event.item
        for event in client.responses.create(stream=True, **kwargs)
        if event.type == "response.output_item.done" and event.item.type == "function_call"
    ]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]  # type: ignore[union-attr]


@pytest.mark.slow
def test_the_responses_api_text_format(smol: ReplicaProcess) -> None:
    """The Responses API's ``text.format`` JSON schema, as vLLM maps it to the chat's
    ``response_format`` (the replica ignored it before)."""
    kwargs: Any = {
        "model": "smollm2-135m",
        "input": "Give a person's name and age as JSON.",
        "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
        "max_output_tokens": 60,
        "temperature": 0,
    }
    out = smol.client(timeout=60).responses.create(**kwargs)
    value = json.loads(out.output_text)
    assert list(value) == ["name", "age"] and isinstance(value["age"], int)


def test_a_body_that_may_ask_for_a_grammar_is_built_off_the_event_loop() -> None:
    """Compiling a grammar, and loading xgrammar the first time (about 2 s), must not
    hold the loop that streams every other answer of the replica."""
    small = json.dumps({"model": MODEL, "messages": CHAT}).encode()
    assert work_size(small) == len(small) <= INLINE_BODY_BYTES
    for key in ("response_format", "structured_outputs", "tool_choice"):
        body = json.dumps({"model": MODEL, "messages": CHAT, key: None}).encode()
        assert work_size(body) > INLINE_BODY_BYTES


@pytest.mark.parametrize("value", [0.0, "json", {"type": 5}, {"type": "structural_tag"}])
def test_a_completions_response_format_is_checked(replica: ReplicaProcess, value: Any) -> None:
    """A completion's ``response_format`` arrives unchecked (it is no field of the wire's
    completion): a number there was a 500 (found by tests/test_fuzz_servers.py)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "response_format": value}
    answer = httpx.post(replica.url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "response_format"


@pytest.mark.slow
@pytest.mark.parametrize("choice", [{"type": "tool", "name": "tide"}, {"type": "any"}])
def test_a_forced_tool_choice_on_the_messages_api(smol: ReplicaProcess, choice: Any) -> None:
    """Anthropic's ``tool_choice`` ``tool`` and ``any`` are the chat's named function and
    ``required``: the answer is ``tool_use`` blocks, whole and streamed, not their JSON as
    text (which it was, once forced choices were decoded, before this was taken care of)."""
    client = anthropic.Anthropic(base_url=smol.url, api_key="x", max_retries=0)
    tool = PORTS[0]["function"]
    kwargs: Any = {
        "model": "smollm2-135m",
        "max_tokens": 64,
        "extra_body": {"temperature": 0},  # (this client version takes no temperature)
        "messages": [{"role": "user", "content": "What are the tides at Hull?"}],
        "tools": [{"name": tool["name"], "input_schema": tool["parameters"]}],
        "tool_choice": choice,
    }
    whole = client.messages.create(**kwargs)
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and uses, whole.content
    assert {u.name for u in uses} == {"tide"}  # (any: parallel calls allowed)
    assert len(uses) == 1 or choice["type"] == "any"
    assert all(u.input["port"] in ("Hull", "Leith") for u in uses)  # type: ignore[index]
    assert not [b for b in whole.content if b.type == "text" and b.text]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [  # type: ignore[union-attr]
        (u.name, u.input) for u in uses
    ]


def test_a_large_spec_is_compiled_but_not_kept() -> None:
    """Compiled grammars are kept by spec; one from a spec over 64 KiB is not, so 64
    bodies of large schemas stay out of memory."""
    from prefixgate.tokenizer import ChatTokenizer

    tok = ChatTokenizer.for_model(MODEL)
    grammars = Grammars(tok.tokenizer, tok.vocab_size, tok.eos_token_ids)
    small = GrammarSpec("json_schema", json.dumps(PERSON))
    large = GrammarSpec("json_schema", json.dumps({**PERSON, "description": "x" * 70_000}))
    assert grammars.compile(small) is grammars.compile(small)  # kept: compiled once
    assert grammars.compile(large) is not None
    assert grammars.compile(large) is not grammars.compile(large)  # not kept
