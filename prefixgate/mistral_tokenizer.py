"""vLLM's Mistral tokenizer mode: chats encoded by ``mistral_common``, not by a template.

vLLM 0.32 tokenizes a model with Mistral's own library when its ``--tokenizer-mode`` is
``mistral``, and, by default (``auto``), when the model's folder or Hub repository holds
both Mistral's weights (``consolidated*.safetensors``) and Mistral's tokenizer
(``tekken.json`` or ``tokenizer.model.v*``): every model Mistral publishes (Mistral Small
3.x, Devstral, Magistral, Ministral, Mistral 7B v0.3). Such a chat never meets a Jinja
template: ``mistral_common`` turns the OpenAI messages into its own request and encodes
that, control tokens and all. A gateway that took such a model for a Hugging Face one
keyed its chats by bytes (a folder without ``tokenizer.json``) or by a template's ids
that vLLM never rendered, and so matched none of the blocks the engines published.

This class encodes as vLLM's ``MistralTokenizer`` (through transformers'
``MistralCommonBackend``) does, in ``mistral_common``'s test mode:

* the messages as the client sent them (no Claude Code billing line dropped, no developer
  role folded: vLLM hands ``mistral_common`` the request's own), with tool call ids cut to
  their last nine characters and an assistant message's ``tool_calls`` always a list;
* the tools as vLLM dumps them (prefixgate/tools.py), ``continue_final_message``, and the
  reasoning effort for tokenizers of version 15 and later;
* plain text with a BOS unless ``add_special_tokens`` is false, never an EOS.

``mistral_common`` is imported only when a model needs it. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from fnmatch import fnmatch
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from prefixgate.chat_input import ChatInput
from prefixgate.models import (
    SIM_MODEL,
    hub_mistral_dir,
    hub_mistral_files,
    is_builtin,
    model_dir,
    on_the_hub,
)
from prefixgate.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

# vLLM's --tokenizer-mode values that choose between a model's two tokenizers
TOKENIZER_MODES = ("auto", "hf", "mistral")
MISTRAL_WEIGHTS = "consolidated*.safetensors"
MISTRAL_TOKENIZER_FILES = ("tekken.json", "tokenizer.model.v*")
TOOL_CALL_ID_CHARS = 9  # vLLM keeps the last nine characters of longer ids


def check_mode(mode: str) -> str:
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer mode {mode!r}: expected one of {', '.join(TOKENIZER_MODES)}")
    return mode


def uses_mistral(files: Iterable[str], mode: str) -> bool:
    """Whether vLLM 0.32 in tokenizer ``mode`` encodes a model whose folder or repository
    holds ``files`` (names or paths) with ``mistral_common``."""
    names = {PurePath(f).name for f in files}
    if mode != "auto":
        return mode == "mistral"
    has_tokenizer = any(fnmatch(n, p) for n in names for p in MISTRAL_TOKENIZER_FILES)
    return has_tokenizer and any(fnmatch(n, MISTRAL_WEIGHTS) for n in names)


def folder_files(folder: Path) -> list[str]:
    """The files under a model folder, as vLLM lists a local model's (every level)."""
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]


def mistral_tokenizer_file(folder: Path) -> Path:
    """The tokenizer file ``mistral_common`` picks in ``folder``: ``tekken.json`` first,
    else the last ``tokenizer.model*`` in name order."""
    from mistral_common.tokens.tokenizers.utils import get_one_valid_tokenizer_file

    try:
        return folder / get_one_valid_tokenizer_file(os.listdir(folder))
    except ValueError as exc:
        raise ValueError(
            f"{folder} has no Mistral tokenizer (tekken.json, tokenizer.model.v*)"
        ) from exc


def load_mistral(name_or_path: str, mode: str) -> MistralChatTokenizer | None:
    """The Mistral tokenizer vLLM would encode ``name_or_path`` (a local folder or a Hub
    id) with in tokenizer ``mode``; None where it takes the Hugging Face tokenizer.
    ValueError (or ModelNotFoundError) when ``mode`` is ``mistral`` and there is none."""
    if check_mode(mode) == "hf" or is_builtin(name_or_path) or name_or_path == SIM_MODEL:
        return None
    if on_the_hub(name_or_path):
        files = hub_mistral_files(name_or_path) if mode == "auto" else []
        if not uses_mistral(files, mode):
            return None
        folder = hub_mistral_dir(name_or_path, MISTRAL_TOKENIZER_FILES)
    else:
        folder = model_dir(name_or_path)
        if not uses_mistral(folder_files(folder), mode):
            return None
    return MistralChatTokenizer.from_dir(folder, name_or_path)


class MistralChatTokenizer:
    """Text and chats to token ids as vLLM's Mistral tokenizer mode makes them."""

    has_chat_template = True  # mistral_common renders every chat itself

    def __init__(self, mistral: MistralTokenizer, name: str) -> None:
        self._mistral = mistral
        self._text = mistral.instruct_tokenizer.tokenizer
        self.version = int(str(self._text.version.value).split("v")[-1].split("m")[0])
        self.name = name
        # vLLM hands Mistral's tokenizer none of them but the reasoning effort (version 15+)
        self.template_defaults: dict[str, Any] = {}
        self.exclude_tools_when_tool_choice_none = False  # vLLM's flag (chat_input.py)

    @classmethod
    def from_dir(cls, folder: Path, name: str | None = None) -> MistralChatTokenizer:
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        path = mistral_tokenizer_file(folder)
        mistral = MistralTokenizer.from_file(path, mode=ValidationMode.test)
        return cls(mistral, name or folder.name)

    def encode(self, text: str) -> list[int]:
        """Plain text with the tokenizer's BOS (a completion's prompt, vLLM's default)."""
        ids: list[int] = self._text.encode(text, bos=True, eos=False)
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        """Plain text as it stands (``add_special_tokens: false``)."""
        ids: list[int] = self._text.encode(text, bos=False, eos=False)
        return ids

    def encode_input(self, chat: ChatInput) -> list[int]:
        """A chat's ids, as ``mistral_common`` encodes what vLLM hands it."""
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        chat = chat.without_tools_if(self.exclude_tools_when_tool_choice_none)
        extra: dict[str, Any] = {}
        if self.version >= 15:
            extra["reasoning_effort"] = chat.variables(self.template_defaults).get(
                "reasoning_effort"
            )
        try:
            request = ChatCompletionRequest.from_openai(
                messages=[sent_message(m) for m in chat.sent_messages()],
                tools=chat.tools,
                continue_final_message=chat.continue_final_message,
                **extra,
            )
            ids: list[int] = self._mistral.encode_chat_completion(request).tokens
        except (AssertionError, ValueError, TypeError, KeyError, MistralCommonException) as exc:
            # vLLM answers these with a 400 too (its safe_apply_chat_template)
            raise ChatTemplateError(
                f"the model's Mistral tokenizer cannot encode these messages: {exc}",
                param="messages",
            ) from exc
        return ids


def sent_message(message: dict[str, Any]) -> dict[str, Any]:
    """One message as vLLM hands it to ``mistral_common``: tool call ids over nine
    characters cut to their last nine, an assistant's ``tool_calls`` a list."""
    out = dict(message)
    if out.get("role") == "assistant":
        out["tool_calls"] = [
            {**call, "id": _short_id(call["id"])} if isinstance(call.get("id"), str) else call
            for call in out.get("tool_calls") or []
        ]
    elif out.get("role") == "tool" and isinstance(out.get("tool_call_id"), str):
        out["tool_call_id"] = _short_id(out["tool_call_id"])
    return out


def _short_id(call_id: str) -> str:
    return call_id[-TOOL_CALL_ID_CHARS:]
