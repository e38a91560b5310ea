"""ChatTokenizer: torch-free, and id for id the same as transformers' tokenizer.

The second property is the gateway/replica key-identity guarantee: the gateway hashes the
ids this class produces, the replica caches under the ids of the same class, and both
must equal what the model's own HF tokenizer would feed it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from prefixgate.chat_input import ChatInput
from prefixgate.gguf_tokenizer import read_gguf_metadata
from prefixgate.models import ensure_tokenizer_dir, smollm2_gguf_path
from prefixgate.tokenizer import GIL_FREE_CHARS, ChatTemplateError, ChatTokenizer, encode_ids

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Count: 1, 22, 333, 4444."},
        {"role": "assistant", "content": "1 22 333 4444"},
        {"role": "user", "content": "And backwards?"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "empty system prompt"}],
    [
        {"role": "user", "content": "Ünïcödé — naïve café, 東京, emoji 🎉👩‍💻, RTL שלום"},
        {"role": "assistant", "content": "  leading spaces\n\n\ttabs and trailing  "},
        {"role": "user", "content": "special text <|im_end|> and <|im_start|> inline"},
    ],
    [{"role": "user", "content": "x" * 500 + " don't we'll I'M 3.14159"}],
]

TEXTS = [
    "hello world",
    "  two leading spaces, 2024-11-29 12:00",
    "<|im_start|>user\nhi<|im_end|>",
    "mixed 東京 🎉 text\r\nwith CRLF",
    "",
]


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return ensure_tokenizer_dir("tiny-random")


@pytest.fixture(scope="module")
def ours(tokenizer_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def reference(tokenizer_dir: Path) -> Iterator[PreTrainedTokenizerBase]:
    yield AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_encode_chat_matches_transformers(
    ours: ChatTokenizer,
    reference: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    encoded: Any = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    expected = encoded["input_ids"]
    text: Any = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours.apply_chat_template(messages, add_generation_prompt) == text
    assert ours.encode_chat(messages, add_generation_prompt) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(
    ours: ChatTokenizer, reference: PreTrainedTokenizerBase, text: str
) -> None:
    ids = reference(text).input_ids
    assert ours.encode(text) == ids
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.slow  # transformers' GGUF reader imports torch: ~10 s on a busy machine
def test_extracted_tokenizer_matches_transformers_gguf_reading(ours: ChatTokenizer) -> None:
    """Our struct-based GGUF extraction against transformers' own GGUF tokenizer loader.

    Digits are left out of the texts on purpose: transformers has no split rule for the
    file's "smollm" pre-tokenizer and falls back to GPT-2's, which keeps digit runs whole,
    while SmolLM2 (and llama.cpp) split every digit; both agree everywhere else.
    """
    gguf = smollm2_gguf_path()
    from_gguf = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    for text in ["hello world", "<|im_start|>user\nça va? 東京 🎉<|im_end|>", " it's  odd\n\n"]:
        assert ours.encode(text) == from_gguf(text).input_ids
    assert ours.chat_template == from_gguf.chat_template
    assert ours.vocab_size == len(from_gguf)


def test_special_tokens_and_metadata(ours: ChatTokenizer) -> None:
    assert ours.eos_token_ids == [ours.token_to_id("<|im_end|>")]
    assert ours.bos_token_id == ours.token_to_id("<|im_start|>")
    assert ours.vocab_size == 49152
    # Every digit on its own, as SmolLM2 was trained.
    assert [ours.decode([i]) for i in ours.encode("2024")] == ["2", "0", "2", "4"]
    ids = ours.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == ours.bos_token_id  # the template writes <|im_start|> itself
    assert ours.decode(ids, skip_special_tokens=True).endswith("assistant\n")


def test_gguf_metadata_reader() -> None:
    metadata = read_gguf_metadata(smollm2_gguf_path())
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.block_count"] == 30
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert (
        metadata["tokenizer.ggml.tokens"][metadata["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    )


def test_template_exception_is_an_openai_error(tmp_path: Path, tokenizer_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"
    )
    strict = ChatTokenizer.from_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="first must be user") as raised:
        strict.encode_chat([{"role": "assistant", "content": "x"}])
    assert raised.value.status == 400 and raised.value.param == "messages"
    # tojson keeps non-ASCII and HTML characters as they are, like transformers' filter.
    rendered = strict.apply_chat_template([{"role": "user", "content": "é <b>"}])
    assert rendered == '"é <b>"<|im_end|>'


# ``{% generation %}`` blocks (a training loss mask's, saved by TRL in fine-tuned models)
GENERATION_TEMPLATES = [
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == "
    "'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "A\n   {%+ generation %}\n   X\n   {% endgeneration +%}\n   B",
    "A\n   {%- generation %}\n   X\n   {% endgeneration -%}\n   B",
    # an assignment inside stays inside, as in transformers' call block
    "{% set x = 1 %}{% generation %}{% set x = 2 %}{{ x }}{% endgeneration %}{{ x }}",
]


@pytest.mark.parametrize("source", GENERATION_TEMPLATES)
def test_generation_blocks_render_as_transformers_renders_them(
    tmp_path: Path, tokenizer_dir: Path, reference: PreTrainedTokenizerBase, source: str
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(source)
    tagged = ChatTokenizer.from_dir(tmp_path)  # the model's own template, tags and all
    messages = CONVERSATIONS[1]
    expected = reference.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=True
    )
    assert tagged.apply_chat_template(messages) == expected
    assert tagged.encode_chat(messages) == reference.apply_chat_template(
        messages, chat_template=source, tokenize=True, add_generation_prompt=True, return_dict=False
    )


TOOL_USE = (
    "{% if tools is not none %}{{ 'tools: ' + (tools | map(attribute='function') | map(attribute="
    "'name') | join(',')) + '\\n' }}{% endif %}{% for m in messages %}{{ m['role'] + ': ' + "
    "m['content'] + '\\n' }}{% endfor %}"
)
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


@pytest.mark.parametrize("layout", ["folder", "config list"])
def test_a_models_tool_use_template_renders_its_chats_with_tools(
    tmp_path: Path, tokenizer_dir: Path, layout: str
) -> None:
    """A model with named templates (Hermes', Command R's) renders a chat that carries
    tools with its "tool_use" one, as transformers and vLLM choose it; transformers 5 saves
    it as ``additional_chat_templates/tool_use.jinja``, older ones in the config's list."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    default = (tokenizer_dir / "chat_template.jinja").read_text()
    if layout == "folder":
        (folder / "chat_template.jinja").write_text(default)
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE)
    else:
        config["chat_template"] = [
            {"name": "default", "template": default},
            {"name": "tool_use", "template": TOOL_USE},
        ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ours = ChatTokenizer.from_dir(folder)
    messages = CONVERSATIONS[1]
    choices: list[Any] = [None, [TOOL], []]
    for tools in choices:
        expected = reference.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        chat = ChatInput(messages=messages, tools=tools)
        assert ours.encode_input(chat) == expected, tools
    assert ours.encode_input(ChatInput(messages=messages, tools=[TOOL])) != ours.encode_input(
        ChatInput(messages=messages)
    )
    assert not ours.template_ignores_tools  # the default ignores them; tool_use reads them
    ours.set_chat_template(default)  # a --chat-template: every chat, as vLLM's flag
    assert ours.encode_input(ChatInput(messages=messages, tools=[TOOL])) == ours.encode_input(
        ChatInput(messages=messages)
    )


def test_template_from_tokenizer_config_and_missing_template(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTokenizer.from_dir(tmp_path).encode_chat([{"role": "user", "content": "x"}])
    config["chat_template"] = [{"name": "default", "template": "{{ bos_token }}"}]
    config["bos_token"] = {"content": "<|im_start|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTokenizer.from_dir(tmp_path).apply_chat_template([]) == "<|im_start|>"


def test_gateway_side_never_imports_torch() -> None:
    script = (
        "import sys\n"
        "from prefixgate.tokenizer import ChatTokenizer\n"
        "tok = ChatTokenizer.for_model('smollm2-135m')\n"
        "assert tok.encode_chat([{'role': 'user', 'content': 'hi'}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ)
    )
    assert result.returncode == 0, result.stderr


def test_long_texts_encode_the_same_with_the_gil_released(ours: ChatTokenizer) -> None:
    """``encode`` holds the GIL for the whole text: a gateway or replica encoding a long
    prompt in a worker thread stalled its event loop as long. Past ``GIL_FREE_CHARS`` the
    text goes through ``encode_batch``, which lets other threads run, with the same ids."""
    long_text = "".join(TEXTS) * 2_000 + " <|im_end|> tail"
    assert len(long_text) > GIL_FREE_CHARS
    for special in (True, False):
        expected = ours.tokenizer.encode(long_text, add_special_tokens=special).ids
        assert encode_ids(ours.tokenizer, long_text, add_special_tokens=special) == expected
    big = "lorem ipsum dolor sit amet " * 40_000  # ~1 MB: several hundred ms of BPE
    ticks = 0
    worker = threading.Thread(target=encode_ids, args=(ours.tokenizer, big, False))
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        ticks += 1
    worker.join()
    assert ticks >= 10, ticks  # the encoding thread held the GIL throughout: 1 tick before
