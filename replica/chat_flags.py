"""The replica's chat flags, as vLLM spells them: ``--chat-template FILE`` (instead of the
model's own template; the gateway must be given the same file for the model, or its keys
never match the replica's blocks), ``--default-chat-template-kwargs JSON`` (the template's
variables where a request sets none; the gateway too), ``--exclude-tools-when-tool-choice-none``
(the gateway too) and ``--tool-call-parser hermes``."""

from __future__ import annotations

import argparse

from prefixgate.chat_input import template_defaults
from prefixgate.content_format import CONTENT_FORMAT_OPTIONS
from prefixgate.envflags import add_env_flag
from prefixgate.tokenizer import ChatTokenizer, read_chat_template_file
from replica.tool_parser import TOOL_CALL_PARSERS


def add_chat_flags(p: argparse.ArgumentParser) -> None:
    add_env_flag(
        p,
        "chat-template",
        metavar="FILE",
        help="jinja chat template instead of the model's own (give the gateway the same)",
    )
    add_env_flag(
        p,
        "default-chat-template-kwargs",
        metavar="JSON",
        help='chat template variables where a request sets none, e.g. \'{"enable_thinking": '
        "false}' (vLLM's flag; give the gateway the same)",
    )
    add_env_flag(
        p,
        "chat-template-content-format",
        default="auto",
        choices=CONTENT_FORMAT_OPTIONS,
        help="how a message's content reaches the template: a string, OpenAI's list of "
        "parts, or auto-detected from the template (vLLM's flag; give the gateway the same)",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="render a chat whose tool_choice is none without its tools (vLLM's flag; "
        "give the gateway the same)",
    )
    add_env_flag(
        p,
        "tool-call-parser",
        choices=list(TOOL_CALL_PARSERS),
        help="parse tool calls from the model's text (tool_choice auto); without it, "
        "requests whose tool_choice is not none are refused",
    )


def apply_chat_template_flag(args: argparse.Namespace, tokenizer: ChatTokenizer) -> None:
    """Install ``--chat-template`` and ``--default-chat-template-kwargs`` on the model's
    tokenizer; ValueError when unreadable."""
    if args.default_chat_template_kwargs is not None:
        tokenizer.template_defaults = template_defaults(args.default_chat_template_kwargs)
    tokenizer.exclude_tools_when_tool_choice_none = args.exclude_tools_when_tool_choice_none
    if args.chat_template_content_format != "auto":
        tokenizer.content_format_option = args.chat_template_content_format
    if args.chat_template is not None:
        try:
            tokenizer.set_chat_template(read_chat_template_file(args.chat_template))
        except OSError as exc:
            raise ValueError(f"--chat-template {args.chat_template}: {exc}") from exc
