"""Request → prompt tokens → block keys (gateway/routing.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from gateway.routing import MEDIA_PSEUDO_TOKENS, KeyBuilder, bytes_as_tokens, prompt_keys
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

    def loader(name: str, chat_template: str | None, mode: str) -> FakeTokenizer:
        calls.append(name)
        raise FileNotFoundError(name)

    builder = KeyBuilder(loader=loader)
    assert builder.tokenizer_for("foreign") is None and builder.tokenizer_for("foreign") is None
    assert calls == ["foreign"]
    assert list(bytes_as_tokens(b"abcdefg")) == [int.from_bytes(b"abcd", "little")]


def test_a_name_no_replica_serves_loads_nothing_and_is_not_remembered() -> None:
    """While some replica's model is unknown, the gateway lets any model name through to
    it. Each new name made the gateway load a tokenizer from a folder of that name (a
    client-chosen path on the gateway's disk) and keep one more entry for ever."""
    calls = []

    def loader(name: str, chat_template: str | None, mode: str) -> FakeTokenizer:
        calls.append(name)
        return FakeTokenizer()

    builder = KeyBuilder(loader=loader)
    request = CompletionRequest(model="/srv/anything", prompt="x" * 40)

    async def keys(model: str, served: bool) -> Any:
        return await builder.keys(request, model, 16, "", served=served)

    unserved = asyncio.run(keys("/srv/anything", served=False))
    assert calls == [] and not unserved.tokenized  # keyed by bytes
    assert builder.tokenizer_for("m") is not None and calls == ["m"]
    assert asyncio.run(keys("m", served=False)).tokenized  # loaded already: used
    asyncio.run(keys("/srv/anything", served=False))
    assert calls == ["m"]


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


def test_where_a_chats_keys_are_computed_and_that_they_are_the_same() -> None:
    """Small: on the loop. Up to 4 x inline_chars: rendered on the loop, encoded there
    once the piece cache holds it (an agent resending its tools), in a thread before. A
    body larger than that, however few its fields (one huge tool), wholly in a thread."""
    import threading

    from prefixgate.segments import SegmentCache
    from prefixgate.tokenizer import ChatTokenizer

    template = (Path(__file__).parents[1] / "support" / "tool_template.jinja").read_text()
    inner = ChatTokenizer.for_model("tiny-random")
    inner.set_chat_template(template)
    threads: list[str] = []

    class Recording(SegmentCache):
        def encode_rendered(self, text: str) -> list[int]:
            threads.append("loop" if threading.current_thread() is loop_thread else "worker")
            return SegmentCache.encode_rendered(self, text)

    tokenizer = Recording(inner)
    assert tokenizer.enabled
    builder = KeyBuilder(loader=lambda name, chat_template, mode: tokenizer, inline_chars=2000)
    tool = {"type": "function", "function": {"name": "t", "description": "d " * 1000}}
    huge = {"type": "function", "function": {"name": "h", "description": "x " * 8000}}

    def chat(question: str, tools: list[Any]) -> tuple[ChatCompletionRequest, int]:
        body = {"model": "m", "messages": [{"role": "user", "content": question}]}
        body["tools"] = tools
        return ChatCompletionRequest.model_validate(body), len(json.dumps(body))

    async def main() -> None:
        for question, tools, where in (
            ("first", [tool], "worker"),  # 2-8k: rendered here, never seen: encoded there
            ("again", [tool], "loop"),  # its pieces cached now
            ("big", [huge], "worker"),  # one tool, 16k: all in a thread
        ):
            request, size = chat(question, tools)
            got = await builder.keys(request, "m", 16, "s", size)
            assert got == prompt_keys(request, inner, "m", 16, "s"), question
            assert threads[-1] == where, (question, threads)

    loop_thread = threading.current_thread()
    asyncio.run(main())


def test_a_prompt_over_the_head_is_keyed_by_its_head(monkeypatch: Any) -> None:
    """Encoding a whole 16 MiB prompt took the gateway 2.5 GB (over its pod's memory).
    Past ``ROUTE_HEAD_CHARS`` only the head is encoded: its keys are the whole prompt's
    (but for the blocks next to the cut) and its length is estimated."""
    from prefixgate.segments import SegmentCache
    from prefixgate.tokenizer import ChatTokenizer

    monkeypatch.setattr("gateway.routing.ROUTE_HEAD_CHARS", 20_000)
    inner = ChatTokenizer.for_model("tiny-random")
    encoded: list[int] = []

    class Recording(SegmentCache):
        def encode_rendered(self, text: str) -> list[int]:
            encoded.append(len(text))
            return SegmentCache.encode_rendered(self, text)

    tokenizer = Recording(inner)
    document = "".join(f"line {i}: the quick brown fox jumps over the dog\n" for i in range(2_000))
    body = {"model": "m", "messages": [{"role": "user", "content": document}]}
    request = ChatCompletionRequest.model_validate(body)
    head = prompt_keys(request, tokenizer, "m", 16, "")
    assert max(encoded) <= 20_000
    whole = prompt_keys(request, inner, "m", 16, "")  # uncapped: the plain tokenizer
    assert len(head.keys) > 100 and head.keys == whole.keys[: len(head.keys)]
    assert len(head.keys) <= len(whole.keys) - 2  # the blocks at the cut are left out
    assert 0.9 < head.prompt_tokens / whole.prompt_tokens < 1.1
    completion = CompletionRequest.model_validate({"model": "m", "prompt": document})
    head = prompt_keys(completion, tokenizer, "m", 16, "")
    all_keys = KeySpace("m", 16, "").short_keys(inner.encode(document))
    assert len(head.keys) > 100 and head.keys == all_keys[: len(head.keys)]


def _image(data: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def test_a_chat_with_images_is_keyed_exactly_up_to_its_first_image() -> None:
    """A vision model's engine takes images: the gateway may not refuse them, and keys the
    text before the first image as the engine renders it; from there on the chat's own
    bytes, so the same chat's next turn (same image, more turns) matches all of it and
    another image does not. A large image costs a digest, not a key per 64 bytes."""
    from prefixgate.tokenizer import ChatTokenizer

    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    look = {"role": "user", "content": [{"type": "text", "text": "What is it?"}, _image("A" * 8)]}
    turn1: list[dict[str, Any]] = [system, look]
    turn2 = [*turn1, {"role": "assistant", "content": "A cat. " * 30}, look]
    other: list[dict[str, Any]] = [
        system,
        {**look, "content": [look["content"][0], _image("B" * 8)]},
    ]  # type: ignore[index]
    huge: list[dict[str, Any]] = [
        system,
        {**look, "content": [look["content"][0], _image("C" * 4_000_000)]},
    ]  # type: ignore[index]

    def request(messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"model": "m", "messages": messages})

    tokenizer = ChatTokenizer.for_model("tiny-random")
    for tok in (tokenizer, None):
        one, two, three, big = (
            prompt_keys(request(m), tok, "m", 16, "").keys for m in (turn1, turn2, other, huge)
        )
        # The system prompt's blocks: those of any chat that starts with it, as the
        # engine renders them (here one whose question is text only).
        alone = request([system]).model_copy(update={"add_generation_prompt": False})
        exact = prompt_keys(alone, tok, "m", 16, "").keys
        textual = prompt_keys(
            request([system, {"role": "user", "content": "What?"}]), tok, "m", 16, ""
        )
        assert len(exact) >= 5 and one[: len(exact)] == exact == textual.keys[: len(exact)], tok
        assert len(one) > len(exact) and two[: len(one)] == one, tok
        diverged = next(i for i, (a, b) in enumerate(zip(one, three, strict=False)) if a != b)
        assert len(exact) <= diverged < len(one), tok
        assert len(big) <= len(one) + 1, tok
        # An image weighs about as much as an engine's rendering of one.
        assert len(one) - len(exact) >= MEDIA_PSEUDO_TOKENS // 16, tok
