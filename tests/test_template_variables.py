"""A chat template's variables, layered as vLLM 0.32 layers them (prefixgate/chat_input.py):
the server's ``--default-chat-template-kwargs``, then the request's
``chat_template_kwargs``, then its own fields, ``reasoning_effort`` among them and the
``enable_thinking`` it implies. A reasoning model's template (SmolLM3's, gpt-oss's)
renders these in its system header: rendered otherwise, the gateway's keys part from the
engine's blocks at the first token (docs/BENCHMARKS.md, "Reasoning switches")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cli import template_defaults_flags
from prefixgate.chat_input import ChatInput, chat_input, template_defaults
from prefixgate.models import ensure_tokenizer_dir
from prefixgate.segments import SegmentCache
from prefixgate.tokenizer import ChatTokenizer
from prefixgate.wire import ChatCompletionRequest, parse_request
from prefixgate.wire_messages import to_chat
from prefixgate.wire_responses import ResponsesRequest, chat_body

# the switches a reasoning template reads, in its header
TEMPLATE = (
    "{%- set thinking = not (enable_thinking is defined and enable_thinking is false) %}"
    "{{- 'mode=' + ('think' if thinking else 'no_think') }}"
    "{%- if reasoning_effort is defined and reasoning_effort %}"
    "{{- ' effort=' + reasoning_effort }}{%- endif %}"
    "{{- ' docs=' + (documents | length | string if documents else '0') + '\\n' }}"
    "{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}"
)
USER = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> ChatInput:
    return chat_input(
        parse_request(ChatCompletionRequest, {"model": "m", "messages": USER, **fields})
    )


def _header(chat: ChatInput, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    names = ("add_generation_prompt", "documents", "enable_thinking", "reasoning_effort")
    variables = chat.variables(defaults)
    return {k: variables[k] for k in names if k in variables}


def test_a_reasoning_effort_sets_the_template_variables_vllm_sets() -> None:
    assert _header(_chat(reasoning_effort="low")) == {
        "add_generation_prompt": True,
        "documents": None,
        "enable_thinking": True,
        "reasoning_effort": "low",
    }
    assert _header(_chat(reasoning_effort="none"))["enable_thinking"] is False
    # the request's own enable_thinking stands
    kwargs = {"enable_thinking": False, "reasoning_effort": "ignored"}
    chat = _chat(reasoning_effort="high", chat_template_kwargs=kwargs)
    assert _header(chat) == {
        "add_generation_prompt": True,
        "documents": None,
        "enable_thinking": False,
        "reasoning_effort": "high",  # the field wins over the kwargs
    }
    assert "enable_thinking" not in _header(_chat())  # no effort: the template's default


def test_layers_are_defaults_then_kwargs_then_fields() -> None:
    defaults = {
        "enable_thinking": False,
        "reasoning_effort": "medium",
        "add_generation_prompt": False,
    }
    assert _header(_chat(), defaults) == {
        "add_generation_prompt": True,  # the request's field, always set
        "documents": None,
        "enable_thinking": False,
        "reasoning_effort": "medium",  # unset in the request: the server's
    }
    chat = _chat(chat_template_kwargs={"enable_thinking": True, "add_generation_prompt": False})
    assert _header(chat, defaults)["enable_thinking"] is True
    assert _header(chat, defaults)["add_generation_prompt"] is True
    # an effort implies enable_thinking over the server's default
    assert _header(_chat(reasoning_effort="low"), defaults)["enable_thinking"] is True
    # None and "auto" leave what is below them
    chat = _chat(chat_template_kwargs={"enable_thinking": None, "reasoning_effort": "auto"})
    assert _header(chat, defaults)["reasoning_effort"] == "medium"
    assert _header(chat, defaults)["enable_thinking"] is False
    docs = [{"text": "d"}]
    assert _header(_chat(chat_template_kwargs={"documents": docs}))["documents"] == docs


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    tokenizer = ChatTokenizer.from_dir(ensure_tokenizer_dir("tiny-random"))
    tokenizer.set_chat_template(TEMPLATE)
    return tokenizer


def test_the_tokenizer_renders_with_the_servers_defaults(tokenizer: ChatTokenizer) -> None:
    assert tokenizer.render(_chat()) == "mode=think docs=0\nuser: hi\nassistant:"
    cached = SegmentCache(tokenizer)
    cached.template_defaults = {"enable_thinking": False}
    assert tokenizer.template_defaults == {"enable_thinking": False}
    try:
        assert tokenizer.render(_chat()) == "mode=no_think docs=0\nuser: hi\nassistant:"
        effort = _chat(reasoning_effort="low")
        assert cached.render(effort) == "mode=think effort=low docs=0\nuser: hi\nassistant:"
        assert cached.encode_input(effort) == tokenizer.encode_rendered(cached.render(effort))
    finally:
        tokenizer.template_defaults = {}


def test_responses_and_messages_name_their_effort_as_vllm_reads_it() -> None:
    request = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": "hi",
            "reasoning": {"effort": "high"},
            "chat_template_kwargs": {"x": 1},
        }
    )
    body = chat_body(request, [])
    assert body["reasoning_effort"] == "high" and body["chat_template_kwargs"] == {"x": 1}
    assert "reasoning_effort" not in chat_body(ResponsesRequest(model="m", input="hi"), [])
    # vLLM renders a Responses request with no tools when its list is empty
    assert "tools" not in chat_body(ResponsesRequest(model="m", input="hi", tools=[]), [])
    messages = {"model": "m", "messages": USER, "max_tokens": 1}
    assert "reasoning_effort" not in to_chat(messages)
    effort = {**messages, "output_config": {"effort": "max"}}
    assert to_chat(effort)["reasoning_effort"] == "max"
    assert to_chat({**effort, "thinking": {"type": "disabled"}})["reasoning_effort"] == "none"
    enabled = {**effort, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert to_chat(enabled)["reasoning_effort"] == "max"
    kwargs = {**messages, "chat_template_kwargs": {"enable_thinking": False}}
    assert to_chat(kwargs)["chat_template_kwargs"] == {"enable_thinking": False}


def test_the_flags_take_json_objects_for_every_model_or_one() -> None:
    assert template_defaults('{"enable_thinking": false}') == {"enable_thinking": False}
    flags = template_defaults_flags(['{"a": "x=y"}', 'qwen={"enable_thinking": false}'])
    assert flags == {"": {"a": "x=y"}, "qwen": {"enable_thinking": False}}
    for bad in (
        ["[1]"],
        ["{"],
        ['{"tokenize": true}'],
        ["=", "{}"],
        ["{}", "{}"],
        ["m={}", "m={}"],
    ):
        with pytest.raises(ValueError):
            template_defaults_flags(bad)


def test_a_replica_renders_with_its_default_chat_template_kwargs(tmp_path: Path) -> None:
    """The built-in replica's ``--default-chat-template-kwargs``, read as vLLM reads its
    own: a chat without a reasoning switch renders with the server's."""
    from tests.gateway.conftest import start_replica

    template = tmp_path / "reasoning.jinja"
    template.write_text(TEMPLATE)
    flags = ["--chat-template", str(template), "--default-chat-template-kwargs"]
    replica = start_replica(tmp_path, "replica", *flags, '{"enable_thinking": false}')
    try:
        expected = ChatTokenizer.from_dir(ensure_tokenizer_dir("tiny-random"))
        expected.set_chat_template(TEMPLATE)
        for fields, mode in (({}, "no_think"), ({"reasoning_effort": "low"}, "think")):
            body = {"model": "tiny-random", "messages": USER, **fields}
            r = httpx.post(replica.url + "/v1/chat/completions", json={**body, "max_tokens": 1})
            assert r.status_code == 200, r.text
            header = f"mode={mode}" + (" effort=low" if fields else "")
            ids = expected.encode_rendered(f"{header} docs=0\nuser: hi\nassistant:")
            assert r.json()["usage"]["prompt_tokens"] == len(ids)
    finally:
        replica.stop()
