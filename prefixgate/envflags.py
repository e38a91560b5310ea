"""Command-line flags whose defaults come from the environment, for every server CLI.

``--kv-cache-mb`` takes its default from ``PREFIXGATE_KV_CACHE_MB``: containers and
orchestrators (compose, Kubernetes config maps) configure a process through its
environment, and one config map can serve replicas and gateways alike, since each CLI
reads only the variables of its own flags. A flag given on the command line wins; an
empty variable counts as unset. A list flag (repeatable on the command line) reads a
comma-separated variable, and its first use on the command line replaces that list
rather than adding to it. A variable whose value the flag would refuse stops the
command with a usage error that names the variable.

Torch-free, so that ``prefixgate gateway --help`` stays quick.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

ENV_PREFIX = "PREFIXGATE_"


def env_var(flag: str) -> str:
    """``kv-cache-mb`` → ``PREFIXGATE_KV_CACHE_MB``."""
    return ENV_PREFIX + flag.upper().replace("-", "_")


def add_env_flag(
    parser: argparse.ArgumentParser,
    name: str,
    *,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str = "",
    choices: Collection[Any] | None = None,
    metavar: str | None = None,
) -> argparse.Action:
    """``--name``, its default taken from ``PREFIXGATE_NAME`` when that is set."""
    var = env_var(name)
    raw = os.environ.get(var, "")
    value = _convert(parser, var, raw, type, choices) if raw else default
    return parser.add_argument(
        f"--{name}",
        type=type,
        default=value,
        choices=choices,
        metavar=metavar,
        help=f"{help} (env {var}; default {default})".lstrip(),
    )


def add_env_list_flag(
    parser: argparse.ArgumentParser,
    name: str,
    *,
    help: str = "",
    metavar: str | None = None,
    separator: str | None = ",",
) -> argparse.Action:
    """Repeatable ``--name``; without it on the command line, the items of
    ``PREFIXGATE_NAME`` split at ``separator`` (None: the whole value is one item; none
    when unset). The parsed value is always a list."""
    var = env_var(name)
    split = "comma-separated" if separator == "," else "one value"
    return parser.add_argument(
        f"--{name}",
        action=_ReplacingAppend,
        default=env_list(name, separator),
        metavar=metavar,
        help=f"{help} (repeatable; env {var}, {split})".lstrip(),
    )


class _ReplacingAppend(argparse.Action):
    """``append`` whose first use starts a new list, so the command line replaces the
    default from the environment instead of adding to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


def _convert(
    parser: argparse.ArgumentParser,
    var: str,
    raw: str,
    type_: Callable[[str], Any],
    choices: Collection[Any] | None,
) -> Any:
    try:
        value = type_(raw)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{var}={raw!r} is not a valid {getattr(type_, '__name__', 'value')}: {exc}")
    if choices is not None and value not in choices:
        parser.error(f"{var}={raw!r} is not one of {', '.join(map(str, choices))}")
    return value


def api_key_value(flag: str, value: str | None) -> str | None:
    """An API key given to ``--flag`` (None when empty). It goes into an Authorization
    header line, so a control character (a newline pasted with it) or surrounding space
    is refused rather than sent."""
    if not value:
        return None
    if not (value.isascii() and value.isprintable()) or value != value.strip():
        raise ValueError(f"--{flag}: printable ASCII only, no surrounding spaces")
    return value


def env_list(name: str, separator: str | None = ",") -> list[str]:
    """The items of ``PREFIXGATE_NAME`` split at ``separator`` (None: one item; none
    when unset)."""
    raw = os.environ.get(env_var(name), "")
    items = raw.split(separator) if separator is not None else [raw]
    return [item.strip() for item in items if item.strip()]
