"""``prefixgate up --chat-template FILE --tool-call-parser hermes`` (and
``--default-chat-template-kwargs``): the replicas and the gateway get the same template
and variables (so their keys agree), a vLLM engine gets vLLM's flags; the
commands parse with the real parsers."""

from __future__ import annotations

import sys
from pathlib import Path

from prefixgate import up
from prefixgate.engines import EnginePorts, bridge_command, vllm_command

TEMPLATE = Path(__file__).parents[1] / "support" / "tool_template.jinja"


def test_the_template_reaches_replicas_gateway_and_vllm() -> None:
    from bridge.cli import build_parser as bridge_parser
    from gateway.cli import build_parser as gateway_parser
    from gateway.cli import chat_template_flags, template_defaults_flags
    from replica.cli import build_parser as replica_parser

    flags = ["--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes"]
    args = up.parse_args(flags)
    replica = replica_parser().parse_args(up.replica_command(args, 0, 9000, "redis://x")[4:])
    assert (replica.chat_template, replica.tool_call_parser) == (str(TEMPLATE), "hermes")
    gateway = gateway_parser().parse_args(up.gateway_command(args, [], "redis://x")[4:])
    assert chat_template_flags(gateway.chat_template) == (TEMPLATE, {})
    vllm = vllm_command(up.parse_args(["--engine", "vllm", *flags]), EnginePorts(1, 2, 3))
    assert vllm[vllm.index("--chat-template") + 1] == str(TEMPLATE)
    assert "--enable-auto-tool-choice" in vllm and "hermes" in vllm
    defaults = '{"enable_thinking": false}'
    args = up.parse_args([*flags, "--default-chat-template-kwargs", defaults])
    replica = replica_parser().parse_args(up.replica_command(args, 0, 9000, "redis://x")[4:])
    assert replica.default_chat_template_kwargs == defaults
    gateway = gateway_parser().parse_args(up.gateway_command(args, [], "redis://x")[4:])
    assert template_defaults_flags(gateway.default_chat_template_kwargs) == {
        "": {"enable_thinking": False}
    }
    args = up.parse_args(["--engine", "vllm", *flags, "--default-chat-template-kwargs", defaults])
    vllm = vllm_command(args, EnginePorts(1, 2, 3))
    assert vllm[vllm.index("--default-chat-template-kwargs") + 1] == defaults
    bridge = bridge_parser().parse_args(bridge_command(args, EnginePorts(1, 2, 3), "h", "r")[4:])
    assert bridge.default_chat_template_kwargs == defaults
    plain = up.parse_args([])
    assert "--chat-template" not in up.gateway_command(plain, [], "redis://x")
    assert sys.executable in up.replica_command(plain, 0, 9000, "redis://x")
