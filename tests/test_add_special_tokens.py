"""vLLM's ``add_special_tokens``: a completion's prompt is encoded with the tokenizer's
special tokens (a BOS, for Llama's, Gemma's and Mistral's tokenizers) unless the request
says false, as it does for a chat the client rendered itself, BOS included; a chat's
rendered prompt gets them only when it says true. The gateway's keys and the built-in
replica's prompt follow the field, or part from the engine's blocks at the first token
(docs/BENCHMARKS.md, "Prompts that hold their own BOS")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from gateway.routing import prompt_keys
from prefixgate.models import ensure_tokenizer_dir, model_dir
from prefixgate.segments import SegmentCache
from prefixgate.tokenizer import ChatTokenizer
from prefixgate.wire import ChatCompletionRequest, CompletionRequest, parse_request
from router.protocol import KeySpace

BOS = "<|endoftext|>"
TEXT = "<|endoftext|><|im_start|>user\nHello there, a prompt rendered by the client."


def with_bos(folder: Path, into: Path) -> Path:
    """``folder``'s model with a tokenizer that adds a BOS, as Llama 3's does."""
    shutil.copytree(folder, into)
    tokenizer = json.loads((into / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}},
    }
    (into / "tokenizer.json").write_text(json.dumps(tokenizer))
    return into


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> SegmentCache:
    folder = with_bos(ensure_tokenizer_dir("tiny-random"), tmp_path_factory.mktemp("bos") / "t")
    inner = ChatTokenizer.from_dir(folder)
    inner.set_chat_template(
        "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
    )
    return SegmentCache(inner)


def test_a_completions_prompt_is_keyed_as_the_engine_encodes_it(tokenizer: SegmentCache) -> None:
    plain = tokenizer.encode_rendered(TEXT)
    assert tokenizer.encode(TEXT) == [0, *plain]  # the tokenizer adds its BOS
    space = KeySpace("m", 4, "")
    for special, ids in ((True, [0, *plain]), (False, plain)):
        body = {"model": "m", "prompt": TEXT, "add_special_tokens": special}
        request = parse_request(CompletionRequest, body)
        assert prompt_keys(request, tokenizer, "m", 4, "").keys == space.short_keys(ids)


def test_a_chat_gets_special_tokens_only_when_it_asks(tokenizer: SegmentCache) -> None:
    messages = [{"role": "user", "content": "Hello there, a chat of a few words."}]
    rendered = tokenizer.encode_rendered("user: Hello there, a chat of a few words.\n")
    space = KeySpace("m", 4, "")
    for special, ids in ((False, rendered), (True, [0, *rendered])):
        body = {"model": "m", "messages": messages, "add_special_tokens": special}
        request = parse_request(ChatCompletionRequest, body)
        assert prompt_keys(request, tokenizer, "m", 4, "").keys == space.short_keys(ids)


def test_the_replica_encodes_a_prompt_as_vllm_does(tmp_path: Path) -> None:
    from tests.gateway.conftest import start_replica

    folder = with_bos(model_dir("tiny-random"), tmp_path / "bos-model")
    replica = start_replica(tmp_path, "replica", "--model", str(folder))
    try:
        for special, extra in ((True, 1), (False, 0)):
            body = {"model": str(folder), "prompt": TEXT, "max_tokens": 1}
            r = httpx.post(
                f"{replica.url}/v1/completions", json={**body, "add_special_tokens": special}
            )
            assert r.status_code == 200, r.text
            plain = ChatTokenizer.from_dir(folder).encode_rendered(TEXT)
            assert r.json()["usage"]["prompt_tokens"] == len(plain) + extra
    finally:
        replica.stop()
