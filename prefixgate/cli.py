"""``prefixgate`` — one console script, one subcommand per process kind.

Each subcommand lives with the code it runs and is imported only when chosen, so that
``prefixgate gateway`` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "replica": ("replica.cli", "serve one model replica with an OpenAI API"),
    "gateway": ("gateway.cli", "the OpenAI-compatible front door that routes to replicas"),
    "up": ("prefixgate.up", "start Redis, N replicas and a gateway locally"),
    "chat": ("prefixgate.chat", "send one prompt to a running gateway"),
    "bench": ("loadtest.cli", "workloads, replay client, simulator and reports"),
    "bridge": ("bridge.cli", "make a vLLM or SGLang engine a replica from its KV events"),
    "check-tokenizer": ("bridge.tokenizer_check", "compare our chat tokenizer with an engine's"),
}


def usage() -> str:
    lines = ["usage: prefixgate <command> [options]", "", "commands:"]
    lines += [f"  {name:<15} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "prefixgate <command> --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"prefixgate: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result: int | None = module.main(rest)
    return result or 0


if __name__ == "__main__":
    sys.exit(main())
