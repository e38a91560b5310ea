"""Serving under a path prefix, as vLLM's ``--root-path``: for a server behind a proxy
that routes by path (an ingress sending ``https://host/llm/...`` here) and may or may not
strip the prefix before it forwards. Torch-free.

A request for ``PREFIX/v1/models`` is served as ``/v1/models``; one for ``/v1/models``
(a proxy that stripped it) as it is, as vLLM serves both. ``/llmx/...`` is not under
``/llm``. The rest of the server never sees the prefix: its routes, the guard's form
paths and the gateway's own forwarding (to replicas, which have their own paths) stay as
they are.
"""

from __future__ import annotations

import argparse

from starlette.types import ASGIApp, Receive, Scope, Send

from prefixgate.envflags import add_env_flag


def add_root_path_flag(parser: argparse.ArgumentParser) -> None:
    add_env_flag(
        parser,
        "root-path",
        default="",
        metavar="PREFIX",
        help="serve under this path prefix too, as vLLM's flag (behind a proxy that routes "
        "/PREFIX/... here without stripping it), e.g. /llm",
    )


def root_prefix(value: str) -> str:
    """``--root-path`` as a prefix to match: ``/llm`` for ``/llm``, ``/llm/`` or ``llm``;
    "" for none. A ValueError for one that no request path could carry."""
    prefix = "/" + value.strip().strip("/")
    if prefix == "/":
        return ""
    if any(c in prefix for c in "?#%\\") or any(c.isspace() or not c.isprintable() for c in prefix):
        raise ValueError(f"--root-path must be a plain URL path like /llm, got {value!r}")
    if "//" in prefix or any(part in (".", "..") for part in prefix.split("/")):
        raise ValueError(f"--root-path must be a plain URL path like /llm, got {value!r}")
    return prefix


class RootPath:
    """``app`` served at its own paths and under ``prefix`` (``root_prefix``'s form)."""

    __slots__ = ("app", "prefix", "raw")

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.prefix = prefix
        self.raw = prefix.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            path: str = scope["path"]
            cut = len(self.prefix)
            if path.startswith(self.prefix) and (len(path) == cut or path[cut] == "/"):
                scope = dict(scope)
                scope["path"] = path[cut:] or "/"
                raw = scope.get("raw_path")
                if isinstance(raw, bytes) and raw.startswith(self.raw):
                    scope["raw_path"] = raw[len(self.raw) :] or b"/"
        await self.app(scope, receive, send)


def with_root_path(app: ASGIApp, value: str) -> ASGIApp:
    """``app`` under ``--root-path value`` too; ``app`` itself when there is none."""
    prefix = root_prefix(value)
    return RootPath(app, prefix) if prefix else app
