"""The replica's chat flags, as vLLM spells them: ``--chat-template FILE`` (instead of the
model's own template; the gateway must be given the same file for the model, or its keys
never match the replica's blocks) and ``--tool-call-parser hermes``."""

from __future__ import annotations

import argparse

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
        "tool-call-parser",
        choices=list(TOOL_CALL_PARSERS),
        help="parse tool calls from the model's text (tool_choice auto); without it, "
        "requests whose tool_choice is not none are refused",
    )


def apply_chat_template_flag(args: argparse.Namespace, tokenizer: ChatTokenizer) -> None:
    """Install ``--chat-template`` on the model's tokenizer; ValueError when unreadable."""
    if args.chat_template is not None:
        try:
            tokenizer.set_chat_template(read_chat_template_file(args.chat_template))
        except OSError as exc:
            raise ValueError(f"--chat-template {args.chat_template}: {exc}") from exc
