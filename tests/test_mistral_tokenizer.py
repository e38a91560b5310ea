"""vLLM's Mistral tokenizer mode (prefixgate/mistral_tokenizer.py): which models it takes,
and ids equal, id for id, to those of transformers' ``MistralCommonBackend``, which vLLM's
``MistralTokenizer`` calls, for the messages vLLM hands it (tool call ids cut to nine
characters). The tokenizers are mistral_common's own files: Tekken (version 3) and
SentencePiece (version 7)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mistral_common
import pytest

from bridge.tokenizer_check import CASES, load_tokenizer
from gateway.cli import build_parser, tokenizer_mode_flags
from gateway.routing import KeyBuilder, default_loader, prompt_keys
from prefixgate import up
from prefixgate.chat_input import ChatInput, chat_input
from prefixgate.engines import EnginePorts, bridge_command, vllm_command
from prefixgate.mistral_tokenizer import MistralChatTokenizer, load_mistral, uses_mistral
from prefixgate.models import ModelNotFoundError
from prefixgate.segments import SegmentCache
from prefixgate.tokenizer import ChatTemplateError, ChatTokenizer
from prefixgate.wire import ChatCompletionRequest, CompletionRequest
from router.protocol import KeySpace

DATA = Path(mistral_common.__file__).parent / "data"
FILES = {"tekken": ("tekken_240911.json", "tekken.json")}
FILES["v7"] = ("mistral_instruct_tokenizer_241114.model.v7", "tokenizer.model.v7")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Add.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]


def model_folder(root: Path, kind: str, weights: bool = True) -> Path:
    """A folder as Mistral's repositories hold one: its tokenizer, and (``weights``) a
    ``consolidated.safetensors`` (empty: only its name is read)."""
    folder = root / kind
    folder.mkdir()
    source, name = FILES[kind]
    shutil.copy(DATA / source, folder / name)
    if weights:
        (folder / "consolidated.safetensors").write_bytes(b"")
    return folder


def agent_messages(call_id: str) -> list[dict[str, Any]]:
    call = {"name": "calc", "arguments": json.dumps({"x": 2})}
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
    ]


def reference(folder: Path, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    from transformers.tokenization_mistral_common import MistralCommonBackend

    backend = MistralCommonBackend.from_pretrained(str(folder))
    ids: list[int] = backend.apply_chat_template(messages, return_dict=False, **kwargs)
    return ids


def ours(folder: Path, body: dict[str, Any]) -> list[int]:
    tokenizer = load_mistral(str(folder), "auto")
    assert tokenizer is not None
    request = ChatCompletionRequest.model_validate({"model": "m", **body})
    return tokenizer.encode_input(chat_input(request))


def test_vllm_takes_mistral_tokenizer_for_mistral_weights_and_tokenizer() -> None:
    assert uses_mistral(["consolidated.safetensors", "tekken.json"], "auto")
    assert uses_mistral(["consolidated-00001-of-00002.safetensors", "tokenizer.model.v3"], "auto")
    assert uses_mistral(["sub/consolidated.safetensors", "sub/tekken.json"], "auto")
    assert not uses_mistral(["model.safetensors", "tekken.json", "tokenizer.json"], "auto")
    assert not uses_mistral(["consolidated.safetensors", "tokenizer.json"], "auto")
    assert not uses_mistral(["consolidated.safetensors", "tekken.json"], "hf")
    assert uses_mistral(["model.safetensors", "tekken.json"], "mistral")


@pytest.mark.parametrize("kind", sorted(FILES))
def test_chats_encode_as_mistral_common_does(tmp_path: Path, kind: str) -> None:
    folder = model_folder(tmp_path, kind)
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours(folder, {"messages": plain}) == reference(folder, plain)
    agent = agent_messages("abc123xyz")  # nine characters: as sent
    body: dict[str, Any] = {"messages": agent, "tools": TOOLS}
    assert ours(folder, body) == reference(folder, agent, tools=TOOLS)
    continued = [*plain, {"role": "assistant", "content": "Hel"}]
    body = {"messages": continued, "add_generation_prompt": False, "continue_final_message": True}
    assert ours(folder, body) == reference(folder, continued, continue_final_message=True)


@pytest.mark.parametrize("kind", sorted(FILES))
def test_long_tool_call_ids_are_cut_to_their_last_nine_characters_as_vllm_cuts_them(
    tmp_path: Path, kind: str
) -> None:
    folder = model_folder(tmp_path, kind)
    sent = ours(folder, {"messages": agent_messages("call_0123456789abcdef"), "tools": TOOLS})
    assert sent == reference(folder, agent_messages("789abcdef"), tools=TOOLS)
    assert sent != reference(folder, agent_messages("call01234"), tools=TOOLS)


def test_messages_are_encoded_as_sent_not_as_a_template_sees_them(tmp_path: Path) -> None:
    """vLLM hands mistral_common the request's own messages: Claude Code's billing line,
    which vLLM drops before a template renders, stays."""
    folder = model_folder(tmp_path, "v7")
    billed = [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=1; cch=9\nBe brief."},
        {"role": "user", "content": "Hi!"},
    ]
    assert ours(folder, {"messages": billed}) == reference(folder, billed)


def test_text_encodes_with_a_bos_unless_asked_not_to(tmp_path: Path) -> None:
    from transformers.tokenization_mistral_common import MistralCommonBackend

    folder = model_folder(tmp_path, "tekken")
    tokenizer = load_mistral(str(folder), "auto")
    assert tokenizer is not None
    backend = MistralCommonBackend.from_pretrained(str(folder))
    text = "Paris is the capital of France."
    assert tokenizer.encode(text) == backend(text)["input_ids"]
    assert tokenizer.encode(text)[1:] == tokenizer.encode_rendered(text)  # the BOS
    assert tokenizer.encode_rendered(text) == backend(text, add_special_tokens=False)["input_ids"]


def test_a_chat_mistral_common_refuses_is_a_400_not_a_crash(tmp_path: Path) -> None:
    tokenizer = load_mistral(str(model_folder(tmp_path, "v7")), "auto")
    assert tokenizer is not None
    chat = ChatInput.plain([{"role": "tool", "content": "4"}])  # no tool_call_id
    with pytest.raises(ChatTemplateError) as refused:
        tokenizer.encode_input(chat)
    assert refused.value.param == "messages"


def test_which_tokenizer_the_gateway_loads(tmp_path: Path) -> None:
    """auto: Mistral's where vLLM's auto takes it, the Hugging Face one elsewhere; the
    modes as vLLM's; a folder with neither tokenizer loads none."""
    mistral = model_folder(tmp_path, "v7")
    assert isinstance(default_loader(str(mistral)), MistralChatTokenizer)
    with pytest.raises(ModelNotFoundError):  # hf: no tokenizer.json here
        default_loader(str(mistral), None, "hf")
    without_weights = model_folder(tmp_path, "tekken", weights=False)
    with pytest.raises(ModelNotFoundError):  # auto: not Mistral's format, so vLLM's HF one
        default_loader(str(without_weights))
    assert isinstance(default_loader(str(without_weights), None, "mistral"), MistralChatTokenizer)
    assert isinstance(default_loader("tiny-random", None, "auto"), SegmentCache)
    with pytest.raises(ValueError, match="no Mistral tokenizer"):
        default_loader(str(tmp_path), None, "mistral")


def test_keys_come_from_the_mistral_ids(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "v7")
    tokenizer = default_loader(str(folder))
    messages = [{"role": "user", "content": "word " * 100}]
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    keys = prompt_keys(chat, tokenizer, "m", 16, "")
    ids = reference(folder, messages)
    assert keys.tokenized and keys.prompt_tokens == len(ids)
    assert keys.keys == KeySpace("m", 16, "").short_keys(ids)
    assert isinstance(tokenizer, MistralChatTokenizer)
    text = "word " * 100
    for special, encode in ((True, tokenizer.encode), (False, tokenizer.encode_rendered)):
        body = {"model": "m", "prompt": text, "add_special_tokens": special}
        plain = prompt_keys(CompletionRequest.model_validate(body), tokenizer, "m", 16, "")
        assert plain.keys == KeySpace("m", 16, "").short_keys(encode(text))


def test_key_builder_passes_each_model_its_mode(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "tekken", weights=False)
    modes = tokenizer_mode_flags(["other=hf", f"{folder}=mistral"])
    builder = KeyBuilder(tokenizer_modes=modes)
    assert isinstance(builder.tokenizer_for(str(folder)), MistralChatTokenizer)
    assert builder.tokenizer_mode_for("other") == "hf"
    assert builder.tokenizer_mode_for("any") == "auto"
    assert tokenizer_mode_flags(["mistral"]) == {"": "mistral"}
    with pytest.raises(ValueError, match="tokenizer-mode"):
        tokenizer_mode_flags(["slow"])
    args = build_parser().parse_args(["--tokenizer-mode", "m=mistral"])
    assert tokenizer_mode_flags(args.tokenizer_mode) == {"m": "mistral"}


def test_the_bridge_check_loads_what_the_gateway_loads(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "v7")
    tokenizer = load_tokenizer(str(folder))
    assert isinstance(tokenizer, MistralChatTokenizer)
    for chat in CASES.values():
        assert tokenizer.encode_input(ChatInput.plain(chat)) == reference(folder, chat)
    assert isinstance(load_tokenizer("tiny-random"), SegmentCache)
    assert isinstance(ChatTokenizer.for_model("tiny-random"), ChatTokenizer)


def test_up_passes_the_mode_to_engines_bridges_and_gateway() -> None:
    from bridge.cli import build_parser as bridge_parser

    args = up.parse_args(["--engine", "vllm", "--tokenizer-mode", "mistral"])
    engine = vllm_command(args, EnginePorts(1, 2, 3))
    assert engine[engine.index("--tokenizer-mode") + 1] == "mistral"
    bridge = bridge_parser().parse_args(bridge_command(args, EnginePorts(1, 2, 3), "h", "r")[4:])
    assert bridge.tokenizer_mode == "mistral"
    gateway = build_parser().parse_args(up.gateway_command(args, [], "redis://x")[4:])
    assert tokenizer_mode_flags(gateway.tokenizer_mode) == {"": "mistral"}
    with pytest.raises(SystemExit):  # the built-in engine renders with templates only
        up.parse_args(["--tokenizer-mode", "mistral"])


@pytest.fixture
def mistral_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's Hugging Face cache, offline, holding ``mistralai/tiny``'s Tekken
    tokenizer (its only file here: no tokenizer.json, as in Mistral's repositories)."""
    from huggingface_hub import constants

    from tests.gateway.test_tokenizer_sources import fill_hub_cache

    cache = tmp_path / "hub"
    fill_hub_cache(cache, "mistralai/tiny", model_folder(tmp_path, "tekken"), ["tekken.json"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_model_is_mistral_when_its_listing_says_so(
    mistral_hub: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline, the Hub lists nothing, so vLLM's auto takes the Hugging Face tokenizer,
    and so does the gateway (none here: bytes); ``mistral`` takes it from the cache; a
    listing with Mistral's weights and tokenizer makes auto take it too."""
    from huggingface_hub import HfApi

    assert load_mistral("mistralai/tiny", "auto") is None
    fetched = load_mistral("mistralai/tiny", "mistral")
    assert fetched is not None and fetched.name == "mistralai/tiny"
    listing = ["README.md", "consolidated.safetensors", "params.json", "tekken.json"]
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, **_: listing)
    listed = load_mistral("mistralai/tiny", "auto")
    assert listed is not None
    assert listed.encode("Hello") == fetched.encode("Hello")


def test_mistral_leaves_the_tools_out_as_the_flag_says(tmp_path: Path) -> None:
    tokenizer = load_mistral(str(model_folder(tmp_path, "v7")), "auto")
    assert tokenizer is not None
    plain = [{"role": "user", "content": "Hi!"}]
    body = {"model": "m", "messages": plain, "tools": TOOLS, "tool_choice": "none"}
    chat = chat_input(ChatCompletionRequest.model_validate(body))
    assert tokenizer.encode_input(chat) == reference(tmp_path / "v7", plain, tools=TOOLS)
    tokenizer.exclude_tools_when_tool_choice_none = True
    assert tokenizer.encode_input(chat) == reference(tmp_path / "v7", plain)
