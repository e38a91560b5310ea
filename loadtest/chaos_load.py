"""Closed-loop client load for chaos experiments, and what every request saw.

``run_load`` keeps ``clients`` requests in flight against one base URL until a stop
event or a request budget, each request drawn by a caller's function (ordinary chat
turns, streaming or not, hostile bodies, requests the client abandons midway). Every
request ends as one ``Outcome``:

* ``ok``: a complete answer — a 200 with its body, a stream that ends with ``[DONE]``
  (a Responses stream: with ``response.completed`` or ``response.incomplete``) and
  carries no error event, or (for a hostile body) a 4xx OpenAI error;
* ``failed``: anything else that came back: a 5xx or a 4xx for an honest request, a
  connection refused or cut, a stream that ended with an error event or without
  ``[DONE]``;
* ``hung``: no complete answer within the client's timeout;
* ``disconnected``: the client gave up on purpose before the answer was complete.

``saw`` says what the client saw, in words a row of a table can carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import httpx

Kind = Literal["ok", "failed", "hung", "disconnected"]
REFUSED_PAUSE_S = 0.1  # a client's pause after a refused connection, as retrying clients do


class RequestSpec(NamedTuple):
    """One request to send."""

    path: str
    body: bytes
    stream: bool
    hostile: str | None = None  # the hostile input class; None for an honest request
    disconnect_after_s: float | None = None  # abandon the request after this long
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True)
class Outcome:
    kind: Kind
    saw: str
    start_s: float  # since the load started
    latency_s: float
    stream: bool
    hostile: str | None
    replica: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    detail: str = ""  # for a failure: the end of what came back


@dataclass(slots=True)
class Tally:
    """Outcomes summed up as one row."""

    outcomes: list[Outcome]
    started: float  # time.perf_counter() when the load began: ``Outcome.start_s`` is after it

    def since_start(self, perf_time: float) -> float:
        """A ``time.perf_counter()`` reading on the outcomes' clock."""
        return perf_time - self.started

    def count(self, kind: Kind) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    def seen(self) -> Counter[str]:
        """How often clients saw each thing other than a plain success."""
        return Counter(o.saw for o in self.outcomes if o.kind != "ok" or o.hostile)

    def saw(self, top: int = 4) -> str:
        """The commonest things clients saw other than a plain success."""
        seen = self.seen()
        parts = [f"{n}× {what}" for what, n in seen.most_common(top)]
        more = len(seen) - top
        return "; ".join(parts) + (f"; {more} more kinds" if more > 0 else "")

    def examples(self) -> dict[str, str]:
        """One ``detail`` per kind of failure (and hostile input class, if any): what
        exactly came back."""
        out: dict[str, str] = {}
        for o in self.outcomes:
            key = o.saw if o.hostile is None else f"{o.saw} [{o.hostile}]"
            if o.kind in ("failed", "hung") and key not in out:
                out[key] = o.detail
        return out

    def max_latency_s(self) -> float:
        finished = [o.latency_s for o in self.outcomes if o.kind != "disconnected"]
        return max(finished, default=0.0)

    def hit_rate(self, since_s: float = 0.0, until_s: float = float("inf")) -> float | None:
        """Cached over prompt tokens of the complete answers started in the window."""
        window = [
            o
            for o in self.outcomes
            if since_s <= o.start_s < until_s and o.prompt_tokens and o.cached_tokens is not None
        ]
        prompt = sum(o.prompt_tokens or 0 for o in window)
        return sum(o.cached_tokens or 0 for o in window) / prompt if prompt else None

    def row(self) -> dict[str, int | str]:
        return {
            "sent": len(self.outcomes),
            "succeeded": self.count("ok"),
            "failed": self.count("failed"),
            "hung": self.count("hung"),
            "disconnected": self.count("disconnected"),
            "client saw": self.saw(),
        }


async def run_load(
    base_url: str,
    make: Callable[[random.Random], RequestSpec],
    clients: int,
    timeout_s: float,
    stop: asyncio.Event,
    budget: int | None = None,
    seed: int = 0,
) -> Tally:
    """``clients`` concurrent request loops until ``stop`` is set or ``budget`` requests
    have been sent (each loop finishes its request in hand, and pauses briefly after a
    refused connection rather than spinning on a server that is down)."""
    started = time.perf_counter()
    outcomes: list[Outcome] = []
    issued = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:

        async def loop(index: int) -> None:
            nonlocal issued
            rng = random.Random(seed * 1_000 + index)
            while not stop.is_set() and (budget is None or issued < budget):
                issued += 1
                spec = make(rng)
                outcome = await _one(client, spec, started, timeout_s)
                outcomes.append(outcome)
                if outcome.saw == "connection refused":
                    await asyncio.sleep(REFUSED_PAUSE_S)

        await asyncio.gather(*(loop(i) for i in range(clients)))
    return Tally(outcomes, started)


async def _one(
    client: httpx.AsyncClient, spec: RequestSpec, started: float, timeout_s: float
) -> Outcome:
    t0 = time.perf_counter()
    outcome = Outcome("ok", "", t0 - started, 0.0, spec.stream, spec.hostile)
    limit = timeout_s if spec.disconnect_after_s is None else spec.disconnect_after_s
    try:
        await asyncio.wait_for(_exchange(client, spec, outcome), limit)
    except TimeoutError:
        if spec.disconnect_after_s is None:
            outcome.kind, outcome.saw = "hung", f"no answer within {timeout_s:g} s"
        else:
            outcome.kind, outcome.saw = "disconnected", "client left"
    except httpx.TransportError as exc:
        outcome.kind, outcome.saw = "failed", _transport_error(exc)
        outcome.detail = f"{type(exc).__name__}: {exc}"
    outcome.latency_s = time.perf_counter() - t0
    return outcome


def _transport_error(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused"
    if isinstance(exc, httpx.TimeoutException):
        return f"client {type(exc).__name__}"
    return f"connection cut ({type(exc).__name__})"


async def _exchange(client: httpx.AsyncClient, spec: RequestSpec, out: Outcome) -> None:
    headers = {"content-type": "application/json", **dict(spec.headers)}
    async with client.stream("POST", spec.path, content=spec.body, headers=headers) as resp:
        out.replica = resp.headers.get("x-prefixgate-replica")
        raw = await resp.aread()
    status = resp.status_code
    out.detail = raw[-300:].decode(errors="replace")
    if status >= 400:
        code = _error_code(raw)
        honest_4xx = spec.hostile is not None and status < 500 and code is not None
        out.kind = "ok" if honest_4xx else "failed"
        out.saw = f"HTTP {status} {code or 'non-OpenAI body'}"
        return
    if status != 200:
        out.kind, out.saw = "failed", f"HTTP {status}"
        return
    if spec.stream:
        _read_stream(raw.decode(errors="replace"), out)
    else:
        _read_body(raw, out)


def _error_code(raw: bytes) -> str | None:
    """The OpenAI error's code (else its type); None when the body is no OpenAI error."""
    try:
        error = json.loads(raw)["error"]
        return str(error.get("code") or error["type"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _read_body(raw: bytes, out: Outcome) -> None:
    try:
        body = json.loads(raw)
        _read_usage(body.get("usage") or {}, out)
        if body.get("object") == "response":
            ok = body["status"] in ("completed", "incomplete") and bool(body["output"])
        else:
            ok = bool(body["choices"])
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    out.kind, out.saw = ("ok", "HTTP 200") if ok else ("failed", "HTTP 200 without an answer")


def _read_usage(usage: dict[str, Any], out: Outcome) -> None:
    """Chat and completions usage, or a response's (``input_tokens``)."""
    if "input_tokens" in usage:
        out.prompt_tokens = usage.get("input_tokens")
        out.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
    else:
        out.prompt_tokens = usage.get("prompt_tokens")
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def _read_stream(text: str, out: Outcome) -> None:
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    if names:
        _read_response_stream(text, names, out)
        return
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    done = bool(events) and events[-1] == "[DONE]"
    errors = [e for e in events if e.startswith('{"error"')]
    for event in events:
        if '"usage"' in event and event != "[DONE]":
            try:
                usage = json.loads(event).get("usage") or {}
            except ValueError:
                continue
            out.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            out.cached_tokens = details.get("cached_tokens")
    if errors:
        out.kind = "failed"
        out.saw = "stream: error event" + (" then [DONE]" if done else " without [DONE]")
    elif not done:
        out.kind, out.saw = "failed", "stream: cut without [DONE]"
    else:
        out.kind, out.saw = "ok", "stream to [DONE]"


def _read_response_stream(text: str, names: list[str], out: Outcome) -> None:
    """A Responses stream: named events, the last one ending it (no ``[DONE]``)."""
    done = names[-1] in ("response.completed", "response.incomplete")
    errors = [n for n in names if n in ("error", "response.failed")]
    if done:
        last = [line[6:] for line in text.splitlines() if line.startswith("data: ")][-1]
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            _read_usage(json.loads(last)["response"].get("usage") or {}, out)
    if errors:
        out.kind, out.saw = "failed", f"responses stream: {errors[0]} event"
    elif not done:
        out.kind, out.saw = "failed", "responses stream: cut before its last event"
    else:
        out.kind, out.saw = "ok", "responses stream to its last event"
