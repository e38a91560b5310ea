"""Pure pieces of the gateway: API keys, prompt keys, the SSE scanner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.auth import Authenticator, derived_salt, load_api_keys, parse_api_keys
from gateway.routing import KeyBuilder, bytes_as_tokens, prompt_keys
from gateway.usage import SSEScanner, cached_tokens_in
from prefixgate.wire import ChatCompletionRequest, CompletionRequest, OpenAIError
from router.config import RouterConfig
from router.protocol import KeySpace, short_key


def test_api_keys_json_and_yaml(tmp_path: Path) -> None:
    (tmp_path / "k.json").write_text(json.dumps({"sk-1": {"tenant": "a"}}))
    (tmp_path / "k.yaml").write_text(
        "sk-2: {tenant: b, cache_salt: s2}\nsk-3: {tenant: c, shared_namespace: true}\n"
    )
    assert load_api_keys(tmp_path / "k.json")["sk-1"].salt == derived_salt("a")
    yaml_keys = load_api_keys(tmp_path / "k.yaml")
    assert yaml_keys["sk-2"].salt == "s2" and yaml_keys["sk-3"].salt == ""
    with pytest.raises(ValueError):
        parse_api_keys({"sk-4": {"no_tenant": 1}})
    keys = parse_api_keys({"sk-5": {"tenant": "ops", "admin": True}, "sk-6": "plain"})
    assert keys["sk-5"].admin and not keys["sk-6"].admin
    with pytest.raises(ValueError, match="admin"):
        parse_api_keys({"sk-7": {"tenant": "x", "admin": "yes"}})


def test_authenticator() -> None:
    auth = Authenticator(parse_api_keys({"sk-1": {"tenant": "a"}}))
    assert auth.authenticate("Bearer sk-1").name == "a"
    for header in (None, "sk-1", "Bearer sk-2"):
        with pytest.raises(OpenAIError) as err:
            auth.authenticate(header)
        assert err.value.status == 401 and err.value.code == "invalid_api_key"
    tenant = auth.authenticate("Bearer sk-1")
    assert auth.forwarded_salt(tenant, "client-choice") == derived_salt("a")
    open_auth = Authenticator(None)
    assert open_auth.forwarded_salt(open_auth.authenticate(None), "mine") == "mine"


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode("|".join(m["content"] for m in messages))


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

    def loader(name: str) -> FakeTokenizer:
        calls.append(name)
        raise FileNotFoundError(name)

    builder = KeyBuilder(loader=loader)
    assert builder.tokenizer_for("foreign") is None and builder.tokenizer_for("foreign") is None
    assert calls == ["foreign"]
    assert list(bytes_as_tokens(b"abcdefg")) == [int.from_bytes(b"abcd", "little")]


def test_sse_scanner_across_chunk_boundaries() -> None:
    usage = {"usage": {"prompt_tokens_details": {"cached_tokens": 32}}}
    stream = b"data: {}\n\n" + b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"
    scanner = SSEScanner()
    for i in range(0, len(stream), 7):
        scanner.feed(stream[i : i + 7])
    assert scanner.done and scanner.cached_tokens == 32
    assert cached_tokens_in(b'{"usage":null}') is None


def test_cached_tokens_in_answers_whatever_their_shape() -> None:
    def body(usage: object, content: str = "hi") -> bytes:
        return json.dumps({"choices": [{"text": content}], "usage": usage}).encode()

    details = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}
    assert cached_tokens_in(body(details)) == 7
    assert cached_tokens_in(json.dumps({"usage": details}, indent=2).encode()) == 7
    quoted = '"prompt_tokens_details": {"cached_tokens": 99}'  # text, not the usage
    assert cached_tokens_in(body(details, content=quoted)) == 7
    assert cached_tokens_in(body({"prompt_tokens_details": None}, content=quoted)) is None
    assert cached_tokens_in(body({"prompt_tokens_details": {"cached_tokens": None}})) is None


def test_router_options_reach_the_router_config_with_clear_errors() -> None:
    from gateway.cli import build_parser, config_from_args

    args = build_parser().parse_args(
        ["--router-option", "load_slack=0.25", "--router-option", "share-slack=0.15"]
    )
    config = config_from_args(args).router
    assert (config.load_slack, config.share_slack) == (0.25, 0.15)
    assert config.load_abs_slack == RouterConfig().load_abs_slack  # the rest: defaults
    off = build_parser().parse_args(["--router-option", "share_slack=off"])
    assert config_from_args(off).router.share_slack is None
    for bad, says in (
        ("no_such=1", "NAME one of"),
        ("load_slack", "NAME=VALUE"),
        ("load_abs_slack=1.5", "is not a valid int"),
        ("load_slack=-1", "non-negative"),
        ("load_slack=off", "is not a valid float"),  # only share_slack can be off
    ):
        with pytest.raises(ValueError, match=says):
            config_from_args(build_parser().parse_args(["--router-option", bad]))
