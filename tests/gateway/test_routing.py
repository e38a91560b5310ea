"""Request → prompt tokens → block keys (gateway/routing.py)."""

from __future__ import annotations

from pathlib import Path

from gateway.routing import KeyBuilder, bytes_as_tokens, prompt_keys
from prefixgate.chat_input import ChatInput
from prefixgate.wire import ChatCompletionRequest, CompletionRequest
from router.protocol import KeySpace, short_key


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def encode_input(self, chat: ChatInput) -> list[int]:
        return self.encode("|".join(m["content"] for m in chat.messages))


def test_prompt_keys_use_the_tokenizer_salt_and_token_ids() -> None:
    req = CompletionRequest(model="m", prompt="x" * 40)
    keys = prompt_keys(req, FakeTokenizer(), "m", 16, "salt")
    space = KeySpace("m", 16, "salt")
    assert keys.keys == space.short_keys([ord("x")] * 40) and keys.tokenized
    assert keys.keys == [short_key(k) for k in space.keys([ord("x")] * 40)]
    ids = CompletionRequest(model="m", prompt=list(range(33)))
    assert prompt_keys(ids, None, "m", 16, "").keys == KeySpace("m", 16, "").short_keys(
        list(range(33))
    )
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "y" * 64}]}
    )
    byte_keys = prompt_keys(chat, None, "m", 16, "")
    assert not byte_keys.tokenized and len(byte_keys.keys) == 1  # 64+ bytes = 16+ words
    assert byte_keys.keys != prompt_keys(chat, None, "m", 16, "other").keys


def test_key_builder_remembers_a_missing_tokenizer() -> None:
    calls = []

    def loader(name: str, chat_template: str | None) -> FakeTokenizer:
        calls.append(name)
        raise FileNotFoundError(name)

    builder = KeyBuilder(loader=loader)
    assert builder.tokenizer_for("foreign") is None and builder.tokenizer_for("foreign") is None
    assert calls == ["foreign"]
    assert list(bytes_as_tokens(b"abcdefg")) == [int.from_bytes(b"abcd", "little")]


def test_tool_definitions_change_the_keys() -> None:
    """Two agents with different tool sets never share keys, with or without a tokenizer."""
    from prefixgate.tokenizer import ChatTokenizer

    messages = [{"role": "user", "content": "z" * 80}]
    tool = {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "b"}}
    bodies = [
        {"model": "m", "messages": messages},
        {"model": "m", "messages": messages, "tools": [tool]},
        {"model": "m", "messages": messages, "tools": [other]},
    ]
    requests = [ChatCompletionRequest.model_validate(b) for b in bodies]
    template = (Path(__file__).parents[1] / "support" / "tool_template.jinja").read_text()
    tokenizer = ChatTokenizer.for_model("tiny-random")
    tokenizer.set_chat_template(template)
    for tok in (tokenizer, None):
        all_keys = [tuple(prompt_keys(r, tok, "m", 16, "").keys) for r in requests]
        assert len(set(all_keys)) == 3, tok
