"""``prefixgate`` — one console script, one subcommand per process kind.

Each subcommand lives with the code it runs and is imported only when chosen, so that
``prefixgate gateway`` never imports torch.

A proxy set for the whole machine (``HTTP_PROXY``, as on corporate machines) cannot reach
127.0.0.1: ``up`` waited its whole ready timeout for servers that were up, and ``chat``
and ``bench`` found no gateway. Every command reaches this machine's own servers directly:
the loopback names join ``NO_PROXY``, which urllib, httpx and every child read.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import MutableMapping

PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
LOOPBACK = ("127.0.0.1", "localhost")

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


def bypass_proxy_for_loopback(environ: MutableMapping[str, str] = os.environ) -> None:
    """With a proxy set, add this machine's loopback names to ``NO_PROXY`` (both
    spellings; the hosts already there stay)."""
    if not any(environ.get(var) for var in PROXY_VARS):
        return
    for var in ("NO_PROXY", "no_proxy"):
        hosts = [h.strip() for h in environ.get(var, "").split(",") if h.strip()]
        environ[var] = ",".join([*hosts, *(h for h in LOOPBACK if h not in hosts)])


def main(argv: list[str] | None = None) -> int:
    bypass_proxy_for_loopback()
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
