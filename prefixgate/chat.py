"""``prefixgate chat "prompt"``: one request to a running gateway, with what routing did.

Prints the answer, then which replica served it (``x-prefixgate-replica``) and how many
prompt tokens came from that replica's KV cache. Sending the same prompt twice shows the
cache at work: the second call lands on the same replica and reports cached tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

import openai
from openai import OpenAI

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
REPLICA_HEADER = "x-prefixgate-replica"


class ChatResult(NamedTuple):
    answer: str
    replica: str | None
    prompt_tokens: int
    cached_tokens: int


def pick_model(client: OpenAI) -> str:
    """The gateway's only model; an error that says what to pass when it serves several."""
    models = [m.id for m in client.models.list()]
    if len(models) == 1:
        return models[0]
    if not models:
        raise SystemExit("prefixgate chat: the gateway lists no model; pass --model")
    raise SystemExit(f"prefixgate chat: the gateway serves {models}; pass --model NAME")


def chat(
    client: OpenAI,
    prompt: str,
    model: str,
    max_tokens: int,
    conversation_id: str | None = None,
) -> ChatResult:
    headers = {"X-Conversation-Id": conversation_id} if conversation_id else None
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        extra_headers=headers,
    )
    completion = raw.parse()
    usage = completion.usage
    details = usage.prompt_tokens_details if usage is not None else None
    return ChatResult(
        answer=completion.choices[0].message.content or "",
        replica=raw.headers.get(REPLICA_HEADER),
        prompt_tokens=usage.prompt_tokens if usage is not None else 0,
        cached_tokens=(details.cached_tokens or 0) if details is not None else 0,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixgate chat",
        description="Send one prompt to a running gateway; print the answer, the replica "
        "that served it and the prompt tokens it had cached. Send the same prompt twice "
        "to see the cache work.",
    )
    p.add_argument("prompt", help="the user message")
    p.add_argument(
        "--base-url",
        default=os.environ.get("OPENAI_BASE_URL", DEFAULT_BASE_URL),
        help=f"the gateway's OpenAI base URL (default $OPENAI_BASE_URL or {DEFAULT_BASE_URL})",
    )
    p.add_argument("--model", default=None, help="default: the gateway's only model")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "none"),
        help="gateway API key (default $OPENAI_API_KEY; none when the gateway has no keys)",
    )
    p.add_argument(
        "--conversation-id",
        default=None,
        help="sent as X-Conversation-Id: the gateway keeps one conversation on one replica",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="answer length cap (default 64)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    try:
        model = args.model or pick_model(client)
        result = chat(client, args.prompt, model, args.max_tokens, args.conversation_id)
    except openai.APIConnectionError:
        print(
            f"prefixgate chat: no gateway answers at {args.base_url}; "
            "start one with `prefixgate up` or pass --base-url",
            file=sys.stderr,
        )
        return 1
    except openai.APIStatusError as exc:
        print(f"prefixgate chat: {exc.status_code}: {exc.message}", file=sys.stderr)
        return 1
    print(result.answer)
    print(
        f"\n[replica {result.replica or '?'} · prompt tokens {result.prompt_tokens} · "
        f"cached {result.cached_tokens}]"
    )
    return 0
