"""Chat template content format, detected as vLLM's ``--chat-template-content-format auto``
detects it (prefixgate/content_format.py), and content shaped to match: a template that
loops over ``message['content']`` gets lists of text parts, any other template one string;
rendered id for id as transformers renders what vLLM hands it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from prefixgate.chat_input import ChatInput, chat_input
from prefixgate.content_format import detect_content_format
from prefixgate.models import ensure_tokenizer_dir
from prefixgate.tokenizer import ChatTokenizer, compile_chat_template
from prefixgate.wire import ChatCompletionRequest, parse_request

SUPPORT = Path(__file__).parent / "support"
OPENAI_TEMPLATE = SUPPORT / "openai_content_template.jinja"

STRING_STYLE = [
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    # loops over other message fields and over non-message lists
    "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls %}{{ c.id }}{% endfor %}"
    "{% endfor %}{% for t in tools %}{{ t | tojson }}{% endfor %}",
    # a macro that loops, called with something other than a message's content
    "{% macro each(xs) %}{% for x in xs %}{{ x }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ m.content }}{{ each(m.tool_calls) }}{% endfor %}",
    # a loop over a variable named content inside a macro not fed with content
    "{% macro each(content) %}{% for x in content %}{{ x }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ m.content }}{{ each(tools) }}{% endfor %}",
    # a tuple loop target over the content: the tree cannot be followed (vLLM: "string")
    "{% for m in messages %}{% for a, b in m.content %}{{ a }}{% endfor %}{% endfor %}",
]
OPENAI_STYLE = [
    "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    # messages through an assignment, a slice and a filter
    "{% set rest = messages[1:] %}{% for m in rest | list %}"
    "{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}{% endfor %}"
    "{% endfor %}",
    # content through a macro parameter, positional and by keyword
    "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "{% macro show(x, c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(1, c=m['content']) }}{% endfor %}",
    # a loop over a variable literally named content, outside macros
    "{% for m in messages %}{% set content = m.content %}"
    "{% for p in content %}{{ p.text }}{% endfor %}{% endfor %}",
]


def _format(source: str) -> str:
    return detect_content_format(compile_chat_template(source).environment.parse(source))


@pytest.mark.parametrize("source", STRING_STYLE)
def test_string_style_templates(source: str) -> None:
    assert _format(source) == "string"


@pytest.mark.parametrize("source", OPENAI_STYLE)
def test_templates_that_loop_over_content(source: str) -> None:
    assert _format(source) == "openai"


def test_known_templates() -> None:
    smollm2 = ChatTokenizer.from_dir(ensure_tokenizer_dir("tiny-random"))
    assert smollm2.chat_template is not None and "SmolLM" in smollm2.chat_template
    assert smollm2.content_format == "string"
    smollm2.set_chat_template((SUPPORT / "tool_template.jinja").read_text())
    assert smollm2.content_format == "string"
    smollm2.set_chat_template(OPENAI_TEMPLATE.read_text())
    assert smollm2.content_format == "openai"


@pytest.fixture(scope="module")
def source() -> str:
    return OPENAI_TEMPLATE.read_text()


@pytest.fixture(scope="module")
def ours(source: str) -> ChatTokenizer:
    tokenizer = ChatTokenizer.from_dir(ensure_tokenizer_dir("tiny-random"))
    tokenizer.set_chat_template(source)
    return tokenizer


@pytest.fixture(scope="module")
def reference() -> Iterator[PreTrainedTokenizerBase]:
    path = ensure_tokenizer_dir("tiny-random")
    yield AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _request(body: dict[str, Any]) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": "m", **body})


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


# A request, and the messages vLLM hands an "openai"-format template for it (written out
# by hand from vLLM's rules, not computed by the code under test).
REQUEST: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [_text("a"), {**_text("b"), "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "assistant", "content": None},
        {"role": "tool", "tool_call_id": "c1", "content": [_text("x"), _text("y")]},
        {"role": "user", "content": ""},
    ]
}
VLLM_MESSAGES: list[Any] = [
    {"role": "system", "content": [_text("Be brief.")]},
    {
        "role": "user",
        "content": [_text("a"), {**_text("b"), "cache_control": {"type": "ephemeral"}}],
    },
    {"role": "assistant", "content": []},
    {"role": "tool", "tool_call_id": "c1", "content": "x\ny"},
    {"role": "user", "content": [_text("")]},
]


def test_openai_format_renders_as_transformers(
    ours: ChatTokenizer, reference: PreTrainedTokenizerBase, source: str
) -> None:
    chat = chat_input(_request(REQUEST))
    expected: Any = reference.apply_chat_template(
        VLLM_MESSAGES, chat_template=source, tokenize=False, add_generation_prompt=True
    )
    ids: Any = reference.apply_chat_template(
        VLLM_MESSAGES, chat_template=source, tokenize=True, add_generation_prompt=True
    )
    assert "[a][b](cached)" in expected and "x\ny" in expected
    assert ours.render(chat) == expected
    assert ours.encode_input(chat) == ids["input_ids"]


def test_plain_string_messages_are_wrapped(
    ours: ChatTokenizer, reference: PreTrainedTokenizerBase, source: str
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    wrapped: list[Any] = [{"role": "user", "content": [_text("hi")]}]
    expected: Any = reference.apply_chat_template(
        wrapped, chat_template=source, tokenize=True, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages).startswith("<|im_start|>user\n[hi]")
    assert ours.encode_chat(messages) == expected["input_ids"]


def test_continue_final_message_with_parts(
    ours: ChatTokenizer, reference: PreTrainedTokenizerBase, source: str
) -> None:
    body: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": [_text("Hi, I am")]},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    expected: Any = reference.apply_chat_template(
        [{"role": "user", "content": [_text("Say hi")]}, body["messages"][1]],
        chat_template=source,
        tokenize=False,
        continue_final_message=True,
    )
    assert expected.endswith("[Hi, I am")
    assert ours.render(chat_input(_request(body))) == expected


def test_string_format_joins_parts_as_before() -> None:
    smollm2 = ChatTokenizer.from_dir(ensure_tokenizer_dir("tiny-random"))
    parts = chat_input(_request({"messages": REQUEST["messages"][1:2]}))
    joined = ChatInput.plain([{"role": "user", "content": "a\nb"}])
    assert smollm2.encode_input(parts) == smollm2.encode_input(joined)


def test_an_engine_told_its_format_is_followed_not_the_detection() -> None:
    """vLLM's ``--chat-template-content-format string`` (or ``openai``) overrides what it
    detects; the gateway, the replica, the bridge's check and ``up`` take the same flag."""
    import asyncio

    from bridge.tokenizer_check import load_tokenizer
    from gateway.cli import build_parser, config_from_args
    from gateway.routing import KeyBuilder
    from prefixgate import up
    from prefixgate.engines import EnginePorts, bridge_command, vllm_command
    from prefixgate.tokenizer import read_chat_template_file
    from replica.chat_flags import apply_chat_template_flag
    from replica.cli import build_parser as replica_parser

    template = read_chat_template_file(OPENAI_TEMPLATE)
    tokenizer = ChatTokenizer.from_dir(ensure_tokenizer_dir("tiny-random"))
    tokenizer.set_chat_template(template)
    chat = ChatInput.plain([{"role": "user", "content": "hi"}])
    assert "[hi]" in tokenizer.render(chat)  # detected: openai, a string becomes a part
    tokenizer.content_format_option = "string"
    assert tokenizer.content_format == "string"
    assert "[hi]" not in tokenizer.render(chat) and "hi" in tokenizer.render(chat)

    args = build_parser().parse_args(["--chat-template-content-format", "string"])
    assert config_from_args(args).content_format == "string"
    request = parse_request(
        ChatCompletionRequest,
        {"model": "tiny-random", "messages": [{"role": "user", "content": "hi " * 40}]},
    )

    def keys(fmt: str) -> list[bytes]:
        builder = KeyBuilder(chat_template=template, content_format=fmt)
        return asyncio.run(builder.keys(request, "tiny-random", 16, "")).keys

    assert keys("string") != keys("auto") and keys("openai") == keys("auto")

    flags = up.parse_args(["--chat-template-content-format", "string"])
    replica = replica_parser().parse_args(up.replica_command(flags, 0, 9000, "redis://x")[4:])
    loaded = ChatTokenizer.from_dir(ensure_tokenizer_dir("tiny-random"))
    apply_chat_template_flag(replica, loaded)
    assert loaded.content_format_option == "string"
    gateway = build_parser().parse_args(up.gateway_command(flags, [], "redis://x")[4:])
    assert gateway.chat_template_content_format == "string"
    engines = up.parse_args(["--engine", "vllm", "--chat-template-content-format", "string"])
    engine = vllm_command(engines, EnginePorts(1, 2, 3))
    assert engine[engine.index("--chat-template-content-format") + 1] == "string"
    bridge = bridge_command(engines, EnginePorts(1, 2, 3), "h", "r")
    assert bridge[bridge.index("--chat-template-content-format") + 1] == "string"
    from bridge.cli import build_parser as bridge_parser

    assert bridge_parser().parse_args(bridge[4:]).chat_template_content_format == "string"
    checked = load_tokenizer("tiny-random", template, None, "auto", "string")
    assert "[hi]" not in checked.inner.render(chat)  # type: ignore[union-attr]
