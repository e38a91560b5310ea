"""vLLM's ``--exclude-tools-when-tool-choice-none``: an engine started with it renders a
chat whose ``tool_choice`` is "none" without its tools, on every API. The gateway given
the same flag keys such a chat as the engine renders it; the built-in replica takes the
flag too, and ``up`` passes it to replicas, engines and gateway. Without the flag, the
tools are rendered, as vLLM does by default. A tool template puts them at the head of
the system prompt, so keys that disagree part at the first tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import build_parser, config_from_args
from gateway.routing import KeyBuilder
from prefixgate import up
from prefixgate.chat_input import ChatInput, chat_input
from prefixgate.engines import EnginePorts, vllm_command
from prefixgate.tokenizer import ChatTokenizer, read_chat_template_file
from prefixgate.wire import ChatCompletionRequest, parse_request
from prefixgate.wire_messages import to_chat
from prefixgate.wire_responses import ResponsesRequest, chat_body

TEMPLATE = Path(__file__).parent / "support" / "tool_template.jinja"
TOOL = {
    "type": "function",
    "function": {"name": "lookup", "description": "Look it up.", "parameters": {}},
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]


def chat(**fields: Any) -> ChatInput:
    body = {"model": "m", "messages": MESSAGES, "tools": [TOOL], **fields}
    return chat_input(parse_request(ChatCompletionRequest, body))


def tokenizer(exclude: bool) -> ChatTokenizer:
    loaded = ChatTokenizer.for_model("tiny-random")
    loaded.set_chat_template(read_chat_template_file(TEMPLATE))
    loaded.exclude_tools_when_tool_choice_none = exclude
    return loaded


def test_a_tool_choice_of_none_renders_without_tools_only_under_the_flag() -> None:
    plain = tokenizer(False).render(ChatInput.plain(MESSAGES))
    with_tools = tokenizer(False).render(chat(tool_choice="none"))
    assert "lookup" in with_tools and with_tools != plain  # vLLM's default: rendered
    assert tokenizer(True).render(chat(tool_choice="none")) == plain
    for choice in ("auto", "required", None):
        assert "lookup" in tokenizer(True).render(chat(tool_choice=choice))
    assert "lookup" in tokenizer(True).render(chat())  # tools and no choice: auto


def test_every_api_says_none_as_vllm_reads_it() -> None:
    assert chat(tool_choice="none").tool_choice_none
    assert not chat(
        tool_choice={"type": "function", "function": {"name": "lookup"}}
    ).tool_choice_none
    responses = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": "Hi.",
            "tool_choice": "none",
            "tools": [{"type": "function", "name": "lookup"}],
        }
    )
    body = chat_body(responses, [])
    assert chat_input(parse_request(ChatCompletionRequest, body)).tool_choice_none
    messages = {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi."}],
        "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "none"},
    }
    assert chat_input(parse_request(ChatCompletionRequest, to_chat(messages))).tool_choice_none


def test_the_gateway_keys_as_the_flag_says() -> None:
    flagged = config_from_args(build_parser().parse_args(["--exclude-tools-when-tool-choice-none"]))
    assert flagged.exclude_tools_when_tool_choice_none
    template = read_chat_template_file(TEMPLATE)
    request = {"model": "tiny-random", "messages": MESSAGES, "tools": [TOOL]}
    none = parse_request(ChatCompletionRequest, {**request, "tool_choice": "none"})
    bare = parse_request(ChatCompletionRequest, {"model": "tiny-random", "messages": MESSAGES})

    def keys(exclude: bool, req: ChatCompletionRequest) -> list[bytes]:
        builder = KeyBuilder(chat_template=template, exclude_tools_when_tool_choice_none=exclude)
        return asyncio.run(builder.keys(req, "tiny-random", 16, "")).keys

    assert keys(True, none) == keys(True, bare)
    assert keys(False, none) != keys(False, bare)
    assert keys(False, none)[0] != keys(False, bare)[0]  # the tools lead the prompt


def test_the_replica_and_up_take_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from replica.chat_flags import apply_chat_template_flag
    from replica.cli import build_parser as replica_parser

    args = up.parse_args(["--exclude-tools-when-tool-choice-none"])
    replica = replica_parser().parse_args(up.replica_command(args, 0, 9000, "redis://x")[4:])
    loaded = ChatTokenizer.for_model("tiny-random")
    apply_chat_template_flag(replica, loaded)
    assert loaded.exclude_tools_when_tool_choice_none
    gateway = build_parser().parse_args(up.gateway_command(args, [], "redis://x")[4:])
    assert gateway.exclude_tools_when_tool_choice_none
    engine = up.parse_args(["--engine", "vllm", "--exclude-tools-when-tool-choice-none"])
    assert "--exclude-tools-when-tool-choice-none" in vllm_command(engine, EnginePorts(1, 2, 3))
    assert not build_parser().parse_args([]).exclude_tools_when_tool_choice_none
    monkeypatch.setenv("PREFIXGATE_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE", "1")
    assert build_parser().parse_args([]).exclude_tools_when_tool_choice_none
