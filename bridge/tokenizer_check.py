"""``prefixgate check-tokenizer``: do the gateway and the engine see the same token ids?

Precise routing rests on it: the gateway computes a request's block keys over the ids
its own chat tokenizer produces, and the bridge over the ids the engine hashed. Any
difference (another template version, a tokenizer revision, a BOS added twice) makes
every key differ, and routing silently falls back to optimistic guesses.

Each case is a chat rendered by the gateway's tokenizer (the very object the gateway
uses: prefixgate/model_tokenizer.py's) and by the engine's ``POST /tokenize``
(vLLM, SGLang: ``{"model", "messages", "add_generation_prompt": true}``), compared id for
id. Prints a pass/fail line per case and exits 1 on any failure. With ``--chat-template
FILE`` the gateway's side renders with that template, as a gateway started with the same
flag does; the engine's side is what its own start-up template makes of a plain request.
``--default-chat-template-kwargs JSON`` likewise gives the gateway's side the variables
the engine was started with, ``--tokenizer-mode`` the engine's choice between a model's
Hugging Face and Mistral tokenizers, and ``--chat-template-content-format`` how it hands
content to its template.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
from typing import Any, NamedTuple, cast

import httpx

from bridge.engine_auth import add_engine_access_flags, engine_api_key, engine_headers
from prefixgate.chat_input import ChatInput, template_defaults
from prefixgate.content_format import CONTENT_FORMAT_OPTIONS, ContentFormat
from prefixgate.envflags import add_env_flag
from prefixgate.mistral_tokenizer import TOKENIZER_MODES
from prefixgate.model_tokenizer import ModelTokenizer, load_model_tokenizer
from prefixgate.segments import SegmentCache
from prefixgate.tls import client_context, client_tls_from_args
from prefixgate.tokenizer import read_chat_template_file

Chat = list[dict[str, str]]

LONG_TEXT = " ".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog, then checks the logs."
    for i in range(120)
)

CASES: dict[str, Chat] = {
    "single user turn": [{"role": "user", "content": "Hello! What is a KV cache?"}],
    "system prompt": [
        {"role": "system", "content": "You are a terse assistant. Answer in one line."},
        {"role": "user", "content": "Name three prime numbers."},
    ],
    "multi-turn": [
        {"role": "system", "content": "You help with Python."},
        {"role": "user", "content": "How do I reverse a list?"},
        {"role": "assistant", "content": "Use `xs[::-1]` or `xs.reverse()`."},
        {"role": "user", "content": "And a string?\nShow both ways."},
    ],
    "unicode": [
        {"role": "user", "content": "Traduis: «déjà vu» — 日本語, Ελληνικά, emoji 🚀🧪, ZWJ 👩‍💻."}
    ],
    "whitespace": [{"role": "user", "content": "  leading\t\ttabs\n\n\ntrailing   \n"}],
    "long": [
        {"role": "system", "content": "Summarise documents."},
        {"role": "user", "content": LONG_TEXT},
    ],
}


class CaseResult(NamedTuple):
    name: str
    ok: bool
    gateway_tokens: int
    engine_tokens: int
    detail: str  # where they first differ, or the engine's error


def load_first(
    sources: list[str],
    chat_template: str | None = None,
    template_defaults: dict[str, Any] | None = None,
    mode: str = "auto",
    content_format: str = "auto",
) -> tuple[ModelTokenizer, str]:
    """``load_tokenizer`` of the first of ``sources`` that loads, and that source, as the
    gateway tries a model's name and then its engine's ``root``; the last failure when
    none does."""
    for i, source in enumerate(sources):
        try:
            loaded = load_tokenizer(source, chat_template, template_defaults, mode, content_format)
            return loaded, source
        except Exception:
            if i == len(sources) - 1:
                raise
    raise ValueError("no tokenizer source")


def load_tokenizer(
    name_or_dir: str,
    chat_template: str | None = None,
    template_defaults: dict[str, Any] | None = None,
    mode: str = "auto",
    content_format: str = "auto",
) -> ModelTokenizer:
    """The gateway's tokenizer for the model; ``chat_template``: the jinja source of a
    ``--chat-template`` that replaces the model's own, ``template_defaults`` a
    ``--default-chat-template-kwargs``, ``mode`` a ``--tokenizer-mode`` and
    ``content_format`` a ``--chat-template-content-format``, as the gateway applies them."""
    tokenizer = load_model_tokenizer(name_or_dir, chat_template, mode)
    tokenizer.template_defaults = dict(template_defaults or {})
    if content_format != "auto" and isinstance(tokenizer, SegmentCache):
        tokenizer.content_format_option = cast(ContentFormat, content_format)
    return tokenizer


async def engine_model_name(client: httpx.AsyncClient, engine_url: str) -> str:
    """The first model the engine serves (``/v1/models``)."""
    reply = await client.get(f"{engine_url}/v1/models")
    reply.raise_for_status()
    return str(reply.json()["data"][0]["id"])


async def engine_card(
    engine_url: str, api_key: str | None, tls: ssl.SSLContext | None
) -> dict[str, Any]:
    """The engine's first model card (``/v1/models``): its served name and ``root``."""
    async with httpx.AsyncClient(
        timeout=30.0,
        headers=engine_headers(api_key),
        trust_env=False,
        verify=tls or client_context(),
    ) as client:
        reply = await client.get(f"{engine_url}/v1/models")
        reply.raise_for_status()
        data = reply.json().get("data") if isinstance(reply.json(), dict) else None
        card = data[0] if isinstance(data, list) and data else None
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            raise ValueError(f"{engine_url}/v1/models lists no model card")
        return card


async def engine_tokens(
    client: httpx.AsyncClient, engine_url: str, model: str, chat: Chat
) -> list[int]:
    body: dict[str, Any] = {"model": model, "messages": chat, "add_generation_prompt": True}
    reply = await client.post(f"{engine_url}/tokenize", json=body)
    reply.raise_for_status()
    tokens = reply.json()["tokens"]
    return [int(t) for t in tokens]


def first_difference(ours: list[int], theirs: list[int]) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return f"first difference at token {i}: gateway {a}, engine {b}"
    return f"same first {min(len(ours), len(theirs))} ids, then lengths differ"


async def check(
    engine_url: str,
    tokenizer: ModelTokenizer,
    model: str | None = None,
    cases: dict[str, Chat] = CASES,
    timeout_s: float = 30.0,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> list[CaseResult]:
    """One result per case; an engine that cannot tokenize a case fails that case.
    ``tls``: how an HTTPS engine is verified (None: the system's CAs)."""
    engine_url = engine_url.rstrip("/")
    results = []
    headers = engine_headers(api_key)
    verify = tls or client_context()
    async with httpx.AsyncClient(
        timeout=timeout_s, headers=headers, trust_env=False, verify=verify
    ) as client:
        served = model or await engine_model_name(client, engine_url)
        for name, chat in cases.items():
            ours = tokenizer.encode_input(ChatInput.plain(chat, add_generation_prompt=True))
            try:
                theirs = await engine_tokens(client, engine_url, served, chat)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                results.append(CaseResult(name, False, len(ours), 0, f"engine: {exc!r}"))
                continue
            ok = ours == theirs
            detail = "" if ok else first_difference(ours, theirs)
            results.append(CaseResult(name, ok, len(ours), len(theirs), detail))
    return results


def report(results: list[CaseResult]) -> str:
    lines = []
    for r in results:
        verdict = "PASS" if r.ok else "FAIL"
        counts = f"gateway {r.gateway_tokens:>5} ids, engine {r.engine_tokens:>5}"
        line = f"{verdict}  {r.name:<18} {counts}"
        lines.append(line + (f"  ({r.detail})" if r.detail else ""))
    failed = sum(not r.ok for r in results)
    lines.append(
        f"{len(results) - failed}/{len(results)} cases identical"
        + ("" if not failed else ": routing keys will not match the engine's (see README)")
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixgate check-tokenizer",
        description="Compare the gateway's chat tokenizer with an engine's /tokenize.",
    )
    add_env_flag(p, "engine-url", help="the engine's OpenAI server, e.g. http://127.0.0.1:8001")
    add_env_flag(
        p,
        "model",
        help="the gateway's tokenizer: a builtin model, a model folder or a Hub id (default: "
        "the engine's served name, else its card's root, as the gateway tries them)",
    )
    add_env_flag(
        p, "served-model", help="model name to send the engine (default: its first /v1/models)"
    )
    add_engine_access_flags(p)
    add_env_flag(
        p,
        "chat-template",
        metavar="FILE",
        help="a jinja chat template instead of the model's own, as given to the gateway's "
        "--chat-template (the engine must have been started with the same file: requests "
        "to /tokenize do not carry it)",
    )
    add_env_flag(
        p,
        "default-chat-template-kwargs",
        metavar="JSON",
        help="the template variables the engine was started with (its "
        "--default-chat-template-kwargs), as given to the gateway",
    )
    add_env_flag(
        p,
        "tokenizer-mode",
        default="auto",
        choices=TOKENIZER_MODES,
        help="the engine's --tokenizer-mode (vLLM's), as given to the gateway",
    )
    add_env_flag(
        p,
        "chat-template-content-format",
        default="auto",
        choices=CONTENT_FORMAT_OPTIONS,
        help="the engine's --chat-template-content-format (vLLM's), as given to the gateway",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.engine_url:
        parser.error("--engine-url is required")
    try:
        key = engine_api_key(args.engine_api_key)
        tls = client_tls_from_args(args, "engine")
        template = read_chat_template_file(args.chat_template) if args.chat_template else None
        content_format = args.chat_template_content_format
        raw_defaults = args.default_chat_template_kwargs
        defaults = template_defaults(raw_defaults) if raw_defaults is not None else None
        if args.model:
            tokenizer = load_tokenizer(
                args.model, template, defaults, args.tokenizer_mode, content_format
            )
        else:
            card = asyncio.run(engine_card(args.engine_url.rstrip("/"), key, tls))
            root = card.get("root")
            sources = [str(card["id"]), *([root] if isinstance(root, str) and root else [])]
            tokenizer, source = load_first(
                list(dict.fromkeys(sources)),
                template,
                defaults,
                args.tokenizer_mode,
                content_format,
            )
            print(f"the gateway's tokenizer: {source}")
        results = asyncio.run(
            check(args.engine_url, tokenizer, args.served_model, api_key=key, tls=tls)
        )
    except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
        print(f"prefixgate check-tokenizer: {exc}", file=sys.stderr)
        return 2
    print(report(results))
    return 0 if all(r.ok for r in results) else 1
