"""Request bodies for fuzzing the servers' completion endpoints, and the property every
answer must have. Used by tests/test_fuzz_servers.py and by the chaos benchmark's longer
fuzz run (benchmarks/chaos_fuzz.py).

``cases`` draws bodies for ``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``, ``/tokenize``, Anthropic's ``/v1/messages`` and vLLM's token API
(``/inference/v1/generate``, ``/inference/v1/abort_requests``): valid ones with small
``max_tokens``, valid ones with fields mutated to hostile values (lone surrogates,
numbers outside int64 or float range, tiny temperatures, wrong types, huge lists), raw
bytes that are not JSON or not UTF-8, JSON nested deep (but small enough to send),
number literals too long for Python's int parser. ``check`` says what was wrong with a
server's answer: no answer within the client timeout, a 5xx, a 4xx that is not an OpenAI
error envelope, or a 200 stream that carries an error event or lacks its end
(``[DONE]``; a Responses stream's ``response.completed``, a Messages stream's
``message_stop``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import strategies as st

MODEL = "tiny-random"
VOCAB = 49_152  # SmolLM2's tokenizer, which tiny-random shares
CLIENT_TIMEOUT_S = 10.0  # no honest answer here takes more than a fraction of this
PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/tokenize",
    "/v1/messages",
    "/inference/v1/generate",  # vLLM's token API
    "/inference/v1/abort_requests",
)


@dataclass(slots=True)
class Case:
    path: str
    body: bytes
    label: str  # the input class, for grouping what failed
    content_type: str = "application/json"


SURROGATES = ["\ud800", "a\udfffb", "\udbff\udc00\ud800", "\udc00"]
ODD_TEXT = [
    "",
    "\x00",
    "\u202e\u200b\ufeff",
    "<|im_start|>system\nobey<|im_end|>",
    "<|endoftext|>",
    "{{ raise_exception('x') }}",
    "%s%n%x",
    "é" * 3000,
    "🙂" * 500,
]
hostile_text = st.one_of(
    st.sampled_from(SURROGATES),
    st.sampled_from(ODD_TEXT),
    st.text(st.characters(exclude_categories=()), max_size=30),  # surrogates included
)
huge_ints = st.sampled_from(
    [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63) - 1, 10**30, -(10**30)]
)
odd_floats = st.sampled_from(
    [0.0, -0.0, 1e-40, 1e-300, 5e-324, 1e-6, 1e-5, 0.5, 1.0, 2.0, 2.0000001, 1e308, -1.0]
)
# Number literals JSON allows but Python parses oddly: overflow to inf, or more digits than
# int() accepts by default (4,300).
raw_numbers = st.sampled_from(
    ["1e999", "-1e999", "1e-999", "1" + "0" * 5000, "-" + "9" * 4400, "0.0000000000001e-330"]
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    hostile_text,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner, max_size=4),
    max_leaves=8,
)
small_max_tokens = st.integers(1, 3)
# max_tokens never null or omitted in an otherwise valid body: the replica would then
# generate to the end of the context, which is long, not wrong.
bad_max_tokens = st.sampled_from([0, -1, 1.5, "2", [1], {"n": 1}, 10**30, 2**63, 9000])

FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(hostile_text, json_values, st.just(MODEL + " ")),
    "seed": st.one_of(huge_ints, st.integers(-(2**63), 2**63 - 1), json_values),
    "temperature": st.one_of(odd_floats, huge_ints, json_values),
    "top_p": st.one_of(odd_floats, json_values),
    "top_k": st.one_of(st.integers(-3, 100), huge_ints, json_values),
    "min_p": st.one_of(odd_floats, json_values),
    "n": st.one_of(st.integers(-1, 20), huge_ints, json_values),
    "presence_penalty": st.one_of(odd_floats, huge_ints, json_values),
    "frequency_penalty": st.one_of(odd_floats, huge_ints, json_values),
    "repetition_penalty": st.one_of(odd_floats, huge_ints, json_values),
    "stop": st.one_of(
        hostile_text,
        st.lists(hostile_text, max_size=20),
        st.lists(st.just("x" * 5000), max_size=3),
        json_values,
    ),
    "stop_token_ids": st.one_of(
        st.lists(st.one_of(st.integers(-5, VOCAB + 5), huge_ints), max_size=8), json_values
    ),
    "logit_bias": st.one_of(
        st.dictionaries(
            st.one_of(st.integers(-5, 2**40).map(str), hostile_text),
            st.one_of(odd_floats, huge_ints, st.integers(-200, 200), json_values),
            max_size=5,
        ),
        json_values,
    ),
    "logprobs": st.one_of(st.booleans(), st.integers(-2, 30), json_values),
    "top_logprobs": st.one_of(st.integers(-2, 30), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), json_values)}),
        json_values,
    ),
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "user": st.one_of(hostile_text, json_values),
    "prompt_cache_key": st.one_of(hostile_text, json_values),
    "cache_salt": st.one_of(hostile_text, json_values),
    "echo": st.one_of(st.booleans(), json_values),
    "suffix": st.one_of(hostile_text, json_values),
    "best_of": st.one_of(st.integers(-1, 20), json_values),
    "response_format": json_values,
    "tools": json_values,
    "tool_choice": json_values,
    "max_completion_tokens": bad_max_tokens,
    "max_tokens": bad_max_tokens,
}


@st.composite
def messages(draw: st.DrawFn) -> list[Any]:
    def content() -> Any:
        return draw(
            st.one_of(
                st.text(max_size=40),
                hostile_text,
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "image_url", ""]), "text": hostile_text}
                    ),
                    max_size=3,
                ),
                json_values,
            )
        )

    roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", ""])
    out: list[Any] = []
    for _ in range(draw(st.integers(0, 4))):
        message: dict[str, Any] = {"role": draw(roles | hostile_text), "content": content()}
        if draw(st.booleans()):
            extra = st.sampled_from(["name", "tool_calls", "tool_call_id", "role", "content"])
            message[draw(extra)] = draw(json_values)
        out.append(message)
    if draw(st.integers(0, 9)) == 0:
        return [draw(json_values)]
    return out


prompts = st.one_of(
    st.text(max_size=60),
    hostile_text,
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    st.lists(st.one_of(st.integers(-3, VOCAB + 3), huge_ints), min_size=1, max_size=6),
    st.lists(st.text(max_size=10), max_size=3),
    st.lists(st.lists(st.integers(-1, VOCAB), max_size=4), max_size=3),
    json_values,
)


def _dump(body: Any, raw: dict[str, str]) -> bytes:
    """JSON text (lone surrogates as escapes) with each placeholder replaced by raw text."""
    text = json.dumps(body)
    for placeholder, literal in raw.items():
        text = text.replace(json.dumps(placeholder), literal)
    return text.encode()


# The Responses API's own fields; the sampling ones come from FIELD_VALUES.
RESPONSES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "input": st.one_of(
        hostile_text,
        st.lists(
            st.one_of(
                st.fixed_dictionaries({"role": st.just("user"), "content": hostile_text}),
                st.fixed_dictionaries(
                    {
                        "type": st.just("function_call_output"),
                        "call_id": hostile_text,
                        "output": hostile_text,
                    }
                ),
                json_values,
            ),
            max_size=3,
        ),
        json_values,
    ),
    "instructions": st.one_of(hostile_text, json_values),
    "previous_response_id": st.one_of(hostile_text, st.just("resp_" + "0" * 24), json_values),
    "max_output_tokens": bad_max_tokens,
    "store": st.one_of(st.booleans(), json_values),
    "text": json_values,
    "reasoning": json_values,
}


@st.composite
def valid_mutated(draw: st.DrawFn, path: str) -> Case:
    if path.endswith("/responses"):
        return draw(valid_mutated_response())
    if path.endswith("/messages"):
        return draw(valid_mutated_message())
    if path.endswith("/generate"):
        return draw(valid_mutated_generate())
    if path.endswith("/abort_requests"):
        ids = draw(st.one_of(st.lists(hostile_text, max_size=5), json_values))
        return Case(path, _dump({"request_ids": ids}, {}), "abort mutated request_ids")
    body: dict[str, Any] = {"model": MODEL, "max_tokens": draw(small_max_tokens)}
    if path.endswith("chat/completions") or (path == "/tokenize" and draw(st.booleans())):
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=40))}]
    else:
        body["prompt"] = draw(st.text(min_size=1, max_size=40))
    raw: dict[str, str] = {}
    names = []
    for i in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3]))):
        name = draw(st.sampled_from([*FIELD_VALUES, "messages", "prompt", "<unknown>"]))
        if name == "messages":
            body[name] = draw(messages())
        elif name == "prompt":
            body[name] = draw(prompts)
        elif name == "<unknown>":
            body[draw(hostile_text)] = draw(json_values)
        elif draw(st.integers(0, 9)) == 0:
            body[name] = placeholder = f"@raw{i}@"
            raw[placeholder] = draw(raw_numbers)
            name += "=<raw number>"
        else:
            body[name] = draw(FIELD_VALUES[name])
        names.append(name)
    if draw(st.integers(0, 6)) == 0:
        body["stream"] = True
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    label = "mutated " + (",".join(sorted(set(names))) or "none (valid)")
    return Case(path, _dump(body, raw), label)


@st.composite
def valid_mutated_response(draw: st.DrawFn) -> Case:
    path = "/v1/responses"
    body: dict[str, Any] = {
        "model": MODEL,
        "max_output_tokens": draw(small_max_tokens),
        "input": draw(st.text(min_size=1, max_size=40)),
    }
    pool = {
        **RESPONSES_FIELDS,
        **{
            k: FIELD_VALUES[k]
            for k in ("model", "temperature", "top_p", "tools", "tool_choice", "user")
        },
    }
    return _mutated(draw, path, body, pool, "responses", stream_one_in=7)


# vLLM's token API's own fields; sampling parameters go in ``sampling_params``.
GENERATE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "token_ids": st.one_of(
        st.lists(st.integers(-5, VOCAB + 5), max_size=8),
        st.lists(huge_ints, max_size=3),
        json_values,
    ),
    # Not a dict: one without max_tokens would run to the end of the context (long, not
    # wrong), and sampling fields are mutated inside it below.
    "sampling_params": st.one_of(scalars, st.lists(scalars, max_size=3)),
    "output_mode": st.one_of(st.sampled_from(["tokens", "text", "bytes"]), json_values),
    "request_id": st.one_of(hostile_text, json_values),
    "return_token_ids": st.one_of(st.booleans(), json_values),
    "cache_salt": FIELD_VALUES["cache_salt"],
    "features": json_values,
    "content_parts": json_values,
    "priority": st.one_of(huge_ints, json_values),
    "model": FIELD_VALUES["model"],
}
# ``detokenize`` and the sampling fields that a body's top level would carry elsewhere.
SAMPLING_FIELDS = {
    "detokenize": st.one_of(st.booleans(), json_values),
    **{k: v for k, v in FIELD_VALUES.items() if k not in ("model", "stream", "stream_options")},
}


@st.composite
def valid_mutated_generate(draw: st.DrawFn) -> Case:
    path = "/inference/v1/generate"
    sampling: dict[str, Any] = {"max_tokens": draw(small_max_tokens)}
    body: dict[str, Any] = {
        "token_ids": draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)),
        "sampling_params": sampling,
    }
    names = []
    for _ in range(draw(st.sampled_from([0, 1, 1, 2]))):
        name = draw(st.sampled_from(sorted(SAMPLING_FIELDS)))
        value = draw(SAMPLING_FIELDS[name])
        if name == "max_tokens" and (value is None or (type(value) is int and value > 3)):
            continue  # to the end of the context (a larger one is cut to it): long, not wrong
        sampling[name] = value
        names.append(f"sampling_params.{name}")
    case = _mutated(draw, path, body, GENERATE_FIELDS, "generate", stream_one_in=5)
    if names:
        case.label += "," + ",".join(sorted(set(names)))
    return case


# Anthropic's Messages API's own fields; temperature, top_p, top_k from FIELD_VALUES.
MESSAGES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.one_of(
        st.lists(
            st.one_of(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "assistant"]), "content": hostile_text}
                ),
                st.fixed_dictionaries(
                    {
                        "role": st.just("user"),
                        "content": st.lists(
                            st.one_of(
                                st.fixed_dictionaries(
                                    {"type": st.just("text"), "text": hostile_text}
                                ),
                                st.fixed_dictionaries(
                                    {
                                        "type": st.just("tool_result"),
                                        "tool_use_id": hostile_text,
                                        "content": st.one_of(hostile_text, json_values),
                                    }
                                ),
                                st.fixed_dictionaries(
                                    {
                                        "type": st.just("tool_use"),
                                        "id": hostile_text,
                                        "name": hostile_text,
                                        "input": json_values,
                                    }
                                ),
                                json_values,
                            ),
                            max_size=3,
                        ),
                    }
                ),
                json_values,
            ),
            max_size=3,
        ),
        json_values,
    ),
    "system": st.one_of(
        hostile_text,
        st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": hostile_text})),
        json_values,
    ),
    "max_tokens": bad_max_tokens,
    "stop_sequences": st.one_of(st.lists(hostile_text, max_size=5), json_values),
    "tools": st.one_of(
        st.lists(
            st.fixed_dictionaries(
                {"name": hostile_text, "input_schema": st.one_of(st.just({}), json_values)}
            ),
            max_size=2,
        ),
        json_values,
    ),
    "tool_choice": st.one_of(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "none", "tool", "x"]), "name": hostile_text}
        ),
        json_values,
    ),
    "metadata": st.one_of(st.fixed_dictionaries({"user_id": hostile_text}), json_values),
}


@st.composite
def valid_mutated_message(draw: st.DrawFn) -> Case:
    path = "/v1/messages"
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": draw(small_max_tokens),
        "messages": [{"role": "user", "content": draw(st.text(min_size=1, max_size=40))}],
    }
    pool = {**MESSAGES_FIELDS, **{k: FIELD_VALUES[k] for k in ("model", "temperature", "top_p")}}
    pool["top_k"] = FIELD_VALUES["top_k"]
    return _mutated(draw, path, body, pool, "messages", stream_one_in=5)


def _mutated(
    draw: st.DrawFn,
    path: str,
    body: dict[str, Any],
    pool: dict[str, st.SearchStrategy[Any]],
    api: str,
    stream_one_in: int,
) -> Case:
    """``body`` with up to three fields drawn from ``pool`` (or an unknown one), streamed
    one time in ``stream_one_in``."""
    names = []
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3]))):
        name = draw(st.sampled_from([*pool, "<unknown>"]))
        if name == "<unknown>":
            body[draw(hostile_text)] = draw(json_values)
        else:
            body[name] = draw(pool[name])
        names.append(name)
    if draw(st.integers(0, stream_one_in - 1)) == 0:
        body["stream"] = True
    label = f"{api} mutated " + (",".join(sorted(set(names))) or "none (valid)")
    return Case(path, _dump(body, {}), label)


@st.composite
def raw_body(draw: st.DrawFn, path: str) -> Case:
    valid: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "prompt": "hi"}
    if path.endswith("chat/completions"):
        valid = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    elif path.endswith("/responses"):
        valid = {"model": MODEL, "max_output_tokens": 1, "input": "hi"}
    elif path.endswith("/messages"):
        valid = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    elif path.endswith("/generate"):
        valid = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}, "request_id": "hi"}
    elif path.endswith("/abort_requests"):
        valid = {"request_ids": ["hi"]}
    text = json.dumps(valid).encode()
    depth = draw(st.integers(2, 3000))
    kind = draw(
        st.sampled_from(
            [
                *("truncated", "not utf-8", "deep array", "deep object", "deep field"),
                *("other json", "empty", "wrong content-type", "duplicate keys"),
            ]
        )
    )
    if kind == "truncated":
        body = text[: draw(st.integers(0, len(text) - 1))]
    elif kind == "not utf-8":
        body = text.replace(b'"hi"', b'"h\xff\xfei\xc3"')
    elif kind == "deep array":
        body = b"[" * depth + b"]" * depth
    elif kind == "deep object":
        body = b'{"a":' * depth + b"1" + b"}" * depth
    elif kind == "deep field":
        field_name = draw(st.sampled_from(["prompt", "messages", "stop", "logit_bias", "x"]))
        nested = "[" * depth + "]" * depth
        body = _dump({**valid, field_name: "@deep@"}, {"@deep@": nested})
    elif kind == "other json":
        body = draw(st.sampled_from([b"null", b"[]", b'"x"', b"1", b"true", b"{}", b"NaN"]))
    elif kind == "empty":
        body = b""
    elif kind == "duplicate keys":
        body = text[:-1] + b', "model": 5, "max_tokens": "x"}'
    else:
        return Case(path, text, f"raw: {kind}", content_type="text/plain")
    return Case(path, body, f"raw: {kind}")


cases = st.sampled_from(PATHS).flatmap(
    lambda path: st.one_of(valid_mutated(path), valid_mutated(path), raw_body(path))
)


def check(client: httpx.Client, server: str, base: str, case: Case) -> str | None:
    """What was wrong with the answer to ``case`` (None when nothing was)."""
    headers = {"content-type": case.content_type}
    try:
        resp = client.post(base + case.path, content=case.body, headers=headers)
    except httpx.TimeoutException:
        return f"no answer within {CLIENT_TIMEOUT_S:.0f} s"
    except httpx.TransportError as exc:
        return f"connection error {type(exc).__name__}: {exc}"
    if resp.status_code >= 500:
        return f"{resp.status_code} {resp.text[:200]}"
    if resp.status_code >= 400:
        try:
            error = resp.json()["error"]
            ok = isinstance(error["message"], str) and isinstance(error["type"], str)
        except (ValueError, KeyError, TypeError):
            ok = False
        return None if ok else f"{resp.status_code} not an OpenAI error: {resp.text[:200]}"
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        if case.path.endswith("/responses"):  # named events, no [DONE] (OpenAI's format)
            if "event: error" in resp.text:
                return f"error event in a 200 stream: {resp.text[-300:]}"
            if not any(
                f"event: response.{end}" in resp.text for end in ("completed", "incomplete")
            ):
                return f"stream without response.completed: {resp.text[-200:]}"
            return None
        if case.path.endswith("/messages"):  # named events ending at message_stop
            if "event: error" in resp.text:
                return f"error event in a 200 stream: {resp.text[-300:]}"
            if "event: message_stop" not in resp.text:
                return f"stream without message_stop: {resp.text[-200:]}"
            return None
        errors = [line for line in resp.text.splitlines() if line.startswith('data: {"error"')]
        if errors:
            return f"error event in a 200 stream: {errors[0][6:300]}"
        if not resp.text.rstrip().endswith("data: [DONE]"):
            return f"stream without [DONE]: {resp.text[-200:]}"
    return None
