"""The chat tokenizer that the gateway and the replica share. Torch-free.

Block keys are hashes of token ids, so the gateway (which routes by them) and the replica
(which caches by them) must turn a chat into exactly the same ids. Both use this class.
It is built on the ``tokenizers`` library and jinja2 directly — importing transformers'
tokenizers costs seconds and pulls in much of transformers — and renders chat templates
the way ``transformers``' ``apply_chat_template`` does (same jinja environment options,
same globals and ``tojson`` filter, special tokens as template variables), which the tests
check id for id against transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from prefixgate.chat_input import ChatInput, without_developer_role
from prefixgate.content_format import ContentFormat, detect_content_format, shaped_messages
from prefixgate.models import ensure_tokenizer_dir
from prefixgate.tojson import tojson
from prefixgate.wire import OpenAIError

# The named special tokens transformers hands to every chat template.
# A text longer than this is encoded through ``encode_batch``, which releases the GIL.
GIL_FREE_CHARS = 4096


def encode_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode(text).ids``, with the GIL released for a long text. ``encode``
    holds it throughout, so an event loop whose worker thread encoded 1 MiB of text
    waited as long (~1 s); ``encode_batch`` of the one text gives the same ids."""
    if len(text) <= GIL_FREE_CHARS:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    else:
        ids = tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return ids


SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(OpenAIError):
    """The chat template refused the conversation (its ``raise_exception``) or is missing;
    a 400 on ``messages`` for the user."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``: the assistant's text, marked for a
    training loss mask. TRL saves templates with these in fine-tuned models, NeMo's
    Llama 3.1 template has them; transformers and vLLM render the block's body as it
    stands (transformers also records where it fell, when asked for a mask). Without the
    tag, such a template did not compile here, and its model's chats were keyed by bytes."""

    tags = {"generation"}  # noqa: RUF012 - a set, as jinja's Extension declares it

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)  # its assignments stay inside, as a call's


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads (``tools``, ``documents``, ...)."""
    return frozenset(meta.find_undeclared_variables(_environment().parse(source)))


def read_chat_template_file(path: str | Path) -> str:
    """A ``--chat-template FILE``: the jinja source, compiled once here so that a broken
    template stops the server at start-up rather than failing every chat."""
    source = Path(path).read_text()
    try:
        compile_chat_template(source)
    except jinja2.exceptions.TemplateError as error:
        raise ValueError(f"chat template {path}: {error}") from error
    return source


def _continued(rendered: str, messages: list[dict[str, Any]]) -> str:
    """transformers' ``continue_final_message``: cut the text after the last message's
    content (its last text part when it is a list), so the model continues it."""
    if not messages:
        raise ChatTemplateError("continue_final_message needs a message", param="messages")
    final = messages[-1].get("content")
    if isinstance(final, list):
        final = next((p["text"] for p in reversed(final) if "text" in p), None)
    if not isinstance(final, str) or final.strip() not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the "
            "rendered chat",
            param="messages",
        )
    at = rendered.rindex(final.strip())
    if rendered[at : at + len(final.lstrip())] == final:
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


# Where transformers (5) keeps a model's named templates beside ``chat_template.jinja``.
TEMPLATES_DIR = "additional_chat_templates"
TOOL_USE = "tool_use"  # the named template transformers and vLLM render chats with tools by


def _read_chat_templates(path: Path, config: dict[str, Any]) -> dict[str, str]:
    """The model's templates by name, as transformers loads them: "default" from
    ``chat_template.jinja`` (else the config's ``chat_template``), the others from
    ``additional_chat_templates/NAME.jinja`` or the config's list of named templates."""
    templates: dict[str, str] = {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        templates.update({entry["name"]: entry["template"] for entry in template})
    elif isinstance(template, str):
        templates["default"] = template
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text()
    for named in sorted((path / TEMPLATES_DIR).glob("*.jinja")):
        templates[named.name.removesuffix(".jinja")] = named.read_text()
    return templates


@dataclass(frozen=True, slots=True)
class _Template:
    """A chat template compiled, with what vLLM detects of it once."""

    source: str
    compiled: jinja2.Template
    reads: frozenset[str]  # the variables it reads
    content_format: ContentFormat  # vLLM's "auto" detection
    developer_role: bool  # vLLM's test: it names the role, and handles developer messages

    @classmethod
    def of(cls, source: str) -> _Template:
        return cls(
            source=source,
            compiled=compile_chat_template(source),
            reads=template_variables(source),
            content_format=detect_content_format(_environment().parse(source)),
            developer_role='"developer"' in source or "'developer'" in source,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


class ChatTokenizer:
    """Text and chats to token ids and back, identical to the model's HF tokenizer."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        eos_token_ids: list[int],
        name: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens
        self._default: _Template | None = None
        # the model's "tool_use" template, for chats that carry tools (transformers' choice)
        self._tool_use: _Template | None = None
        # the server's --default-chat-template-kwargs, under each request's (chat_input.py)
        self.template_defaults: dict[str, Any] = {}
        # the server's --exclude-tools-when-tool-choice-none (vLLM's; chat_input.py)
        self.exclude_tools_when_tool_choice_none = False
        # the server's --chat-template-content-format (vLLM's): a format, or None to detect
        self.content_format_option: ContentFormat | None = None
        self.set_chat_template(chat_template)
        self.eos_token_ids = eos_token_ids
        bos = special_tokens.get("bos_token")
        self.bos_token_id: int | None = tokenizer.token_to_id(bos) if bos is not None else None
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.name = name

    @classmethod
    def from_dir(cls, path: Path) -> ChatTokenizer:
        """Load ``tokenizer.json``, ``tokenizer_config.json``, the chat template and the eos
        ids (``generation_config.json`` may list several) from an HF folder."""
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(name))
            if content is not None:
                special_tokens[name] = content
        eos_ids: list[int] = []
        eos = special_tokens.get("eos_token")
        eos_id = tokenizer.token_to_id(eos) if eos is not None else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        generation = _read_json(path / "generation_config.json")
        extra = generation.get("eos_token_id")
        for token_id in extra if isinstance(extra, list) else [extra]:
            if isinstance(token_id, int) and token_id not in eos_ids:
                eos_ids.append(token_id)
        templates = _read_chat_templates(path, config)
        loaded = cls(tokenizer, special_tokens, templates.get("default"), eos_ids, path.name)
        if TOOL_USE in templates:
            loaded._tool_use = _Template.of(templates[TOOL_USE])
        return loaded

    @classmethod
    def for_model(cls, name_or_path: str) -> ChatTokenizer:
        tokenizer = cls.from_dir(ensure_tokenizer_dir(name_or_path))
        tokenizer.name = name_or_path
        return tokenizer

    def set_chat_template(self, source: str | None) -> None:
        """Use ``source`` (a ``--chat-template``) instead of the model's own templates, for
        every chat, as vLLM does."""
        self._default = _Template.of(source) if source else None
        self._tool_use = None

    @property
    def chat_template(self) -> str | None:
        """The default template's source."""
        return self._default.source if self._default is not None else None

    @property
    def template_reads(self) -> frozenset[str]:
        return self._default.reads if self._default is not None else frozenset()

    @property
    def content_format(self) -> ContentFormat:
        if self.content_format_option is not None:
            return self.content_format_option
        return self._default.content_format if self._default is not None else "string"

    @property
    def developer_role(self) -> bool:
        return self._default is not None and self._default.developer_role

    @property
    def has_chat_template(self) -> bool:
        return self._default is not None

    @property
    def template_ignores_tools(self) -> bool:
        """No template of the model's reads ``tools``: tool definitions do not reach the
        prompt."""
        if self._tool_use is not None:
            return "tools" not in self._tool_use.reads
        return self._default is not None and "tools" not in self._default.reads

    def _template_for(self, chat: ChatInput) -> _Template | None:
        """The template a chat renders with: the model's "tool_use" one when the chat
        carries tools (even none: ``tools: []``) and the model has one, else its default,
        as transformers' ``get_chat_template`` chooses."""
        if chat.tools is not None and self._tool_use is not None:
            return self._tool_use
        return self._default

    def encode(self, text: str) -> list[int]:
        """Ids of plain text, with whatever the tokenizer adds for plain text (as
        transformers' ``tokenizer(text).input_ids``)."""
        return encode_ids(self.tokenizer, text, add_special_tokens=True)

    def render(self, chat: ChatInput) -> str:
        """The prompt text of a chat, rendered as transformers renders it."""
        chat = chat.without_tools_if(self.exclude_tools_when_tool_choice_none)
        template = self._template_for(chat)
        if template is None:
            raise ChatTemplateError(
                f"model {self.name!r} has no chat template; use /v1/completions or start "
                "the server with --chat-template FILE",
                param="messages",
            )
        variables = chat.variables(self.template_defaults)
        fmt = self.content_format_option or template.content_format
        variables["messages"] = shaped_messages(variables["messages"], fmt)
        if not template.developer_role:
            variables["messages"] = without_developer_role(variables["messages"])
        try:
            rendered = template.compiled.render({**self.special_tokens, **variables})
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(
                f"the model's chat template rejected the messages: {error}", param="messages"
            ) from error
        except (TypeError, ValueError, LookupError, ArithmeticError) as error:
            # A template tripping over the request's own values (a tool schema of an
            # unexpected shape, a kwarg of the wrong type) is the request's problem.
            raise ChatTemplateError(
                f"the model's chat template cannot render this request: {error}",
                param="messages",
            ) from error
        if chat.continue_final_message:
            return _continued(rendered, variables["messages"])
        return rendered

    def encode_input(self, chat: ChatInput) -> list[int]:
        """Ids of a chat; the template writes its own special tokens, so none are added."""
        return self.encode_rendered(self.render(chat))

    def encode_rendered(self, text: str) -> list[int]:
        """``encode_input``'s second half: the ids of a rendered chat."""
        return encode_ids(self.tokenizer, text, add_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of role/content messages."""
        return self.render(ChatInput.plain(messages, add_generation_prompt))

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of role/content messages."""
        return self.encode_input(ChatInput.plain(messages, add_generation_prompt))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_to_id(self, token: str) -> int | None:
        token_id: int | None = self.tokenizer.token_to_id(token)
        return token_id
