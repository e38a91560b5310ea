"""Replay a workload against any OpenAI ``base_url`` and measure what each request saw.

Two arrival models, as in serving benchmarks:

* closed loop (``concurrency=N``): N workers, each takes the next session and plays its
  turns one after another, so at most N requests are in flight;
* open loop (``rate=R``): sessions start at Poisson arrival times (R sessions/s, seeded),
  whatever the server's state; turns inside a session stay sequential.

Every turn resends the system prompt and the whole history, including the replies the
server actually gave, which is what chat clients and agents do and what makes prefixes
repeat. Each request streams with ``include_usage`` so that time to first token,
inter-token gaps, prompt/cached/output tokens come from the same response; the serving
replica comes from the gateway's ``x-prefixgate-replica`` header when there is one.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import openai
from tqdm import tqdm

if TYPE_CHECKING:
    from loadtest.workloads import Session

REPLICA_HEADER = "x-prefixgate-replica"


@dataclass(slots=True)
class ReplayConfig:
    base_url: str
    model: str
    api_key: str = "EMPTY"
    concurrency: int | None = None  # closed loop when set
    rate: float | None = None  # open loop (sessions per second) when set
    max_sessions: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False  # vLLM / prefixgate extension: fixed output lengths
    timeout_s: float = 600.0
    progress: bool = True
    conversation_keys: bool = True  # send each session's id as prompt_cache_key

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.rate is not None:
            raise ValueError("choose closed loop (concurrency) or open loop (rate), not both")
        if self.concurrency is None and self.rate is None:
            self.concurrency = 1
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")

    @property
    def mode(self) -> str:
        return "open" if self.rate is not None else "closed"


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds, ``start_s`` from run start."""

    session_id: str
    turn: int
    start_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    replica: str | None = None
    error: str | None = None


class Reply(NamedTuple):
    """What one request produced: its record, and the reply text for the next turn."""

    record: RequestRecord
    text: str


@dataclass(slots=True)
class ReplayResult:
    config: ReplayConfig
    requests: list[RequestRecord]
    total_time_s: float
    n_sessions: int

    def summary(self) -> dict[str, Any]:
        return summarize(self.requests, self.total_time_s, self.n_sessions)

    def to_json(self, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "kind": "replay",
            "meta": dict(meta or {}),
            "config": asdict(self.config),
            "summary": self.summary(),
            "requests": [asdict(r) for r in self.requests],
        }


# ----------------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def load_balance(counts: dict[str, int]) -> float | None:
    """max/mean requests per replica: 1.0 is perfectly even."""
    if not counts:
        return None
    mean = sum(counts.values()) / len(counts)
    return max(counts.values()) / mean if mean else None


def busy_replicas(records: Sequence[RequestRecord], total_time_s: float) -> float | None:
    """How many replicas were serving at least one request, averaged over the run (from
    the requests' start and end times). Where replicas share a machine's cores, as in
    the local live runs, each busy one slows the others."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if r.replica is not None and r.e2e_s is not None:
            spans.setdefault(r.replica, []).append((r.start_s, r.start_s + r.e2e_s))
    if not spans or total_time_s <= 0:
        return None
    busy = 0.0
    for intervals in spans.values():
        intervals.sort()
        start, end = intervals[0]
        for s, e in intervals[1:]:
            if s > end:
                busy += end - start
                start, end = s, e
            else:
                end = max(end, e)
        busy += end - start
    return busy / total_time_s


def summarize(
    records: Sequence[RequestRecord], total_time_s: float, n_sessions: int
) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    output = sum(r.output_tokens or 0 for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    per_replica = Counter(r.replica for r in ok if r.replica is not None)
    errors = Counter((r.error or "")[:200] for r in records if r.error is not None)
    return {
        "sessions": n_sessions,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "hit_rate": cached / prompt if prompt else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "e2e_p50_s": percentile(e2es, 50),
        "e2e_p99_s": percentile(e2es, 99),
        "total_time_s": total_time_s,
        "output_tokens_per_s": output / total_time_s if total_time_s > 0 else None,
        "requests_per_s": len(ok) / total_time_s if total_time_s > 0 else None,
        "requests_per_replica": dict(sorted(per_replica.items())),
        "load_max_over_mean": load_balance(dict(per_replica)),
        "busy_replicas_mean": busy_replicas(ok, total_time_s),
        "error_counts": dict(errors.most_common()),
    }


# ------------------------------------------------------------------------------ replay


@dataclass(slots=True)
class _Run:
    """What every request of one replay shares."""

    client: openai.AsyncOpenAI
    config: ReplayConfig
    t0: float
    records: list[RequestRecord]
    bar: tqdm[Any]


async def _one_request(
    run: _Run, session: Session, turn_index: int, messages: list[dict[str, str]]
) -> Reply:
    cfg = run.config
    turn = session.turns[turn_index]
    start = time.perf_counter()
    record = RequestRecord(session.session_id, turn_index, start - run.t0)
    pieces: list[str] = []
    last: float | None = None
    extra: dict[str, Any] = {"ignore_eos": True} if cfg.ignore_eos else {}
    try:
        async with run.client.chat.completions.with_streaming_response.create(
            model=cfg.model,
            messages=cast(Any, messages),  # plain dicts are what the API takes
            max_tokens=turn.max_tokens,
            temperature=cfg.temperature,
            stream=True,
            stream_options={"include_usage": True},
            prompt_cache_key=session.session_id if cfg.conversation_keys else openai.omit,
            extra_body=extra or None,
        ) as response:
            record.replica = response.headers.get(REPLICA_HEADER)
            stream = await response.parse()
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                    record.prompt_tokens = usage.prompt_tokens
                    record.output_tokens = usage.completion_tokens
                    details = usage.prompt_tokens_details
                    record.cached_tokens = (details.cached_tokens or 0) if details else 0
                text = "".join(c.delta.content or "" for c in chunk.choices)
                if not text:
                    continue
                pieces.append(text)
                if last is None:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last)
                last = now
        record.e2e_s = time.perf_counter() - start
        if record.ttft_s is None:  # no content at all (max_tokens hit on a stop, say)
            record.ttft_s = record.e2e_s
    except openai.APIStatusError as exc:
        record.error = f"HTTP {exc.status_code}: {exc.message}"
    except (TimeoutError, openai.OpenAIError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return Reply(record, "".join(pieces))


async def _play_session(run: _Run, session: Session) -> None:
    """Turns in order; each resends the history with the replies actually received."""
    messages: list[dict[str, str]] = []
    if session.system:
        messages.append({"role": "system", "content": session.system})
    for i, turn in enumerate(session.turns):
        messages.append({"role": "user", "content": turn.user})
        reply = await _one_request(run, session, i, list(messages))
        run.records.append(reply.record)
        run.bar.update(1)
        if reply.record.error is not None:
            # Later turns would resend a history this server never produced.
            run.bar.update(len(session.turns) - i - 1)
            return
        messages.append({"role": "assistant", "content": reply.text})


async def _closed_loop(run: _Run, sessions: Sequence[Session], concurrency: int) -> None:
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)

    async def worker() -> None:
        while True:
            try:
                session = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await _play_session(run, session)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(sessions)))))


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Start times (s) of n sessions arriving as a Poisson process of ``rate`` per second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _open_loop(run: _Run, sessions: Sequence[Session], rate: float, seed: int) -> None:
    async def start_at(at: float, session: Session) -> None:
        delay = run.t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival schedule, not a readiness wait
        await _play_session(run, session)

    arrivals = poisson_arrivals(len(sessions), rate, seed)
    await asyncio.gather(*(start_at(a, s) for a, s in zip(arrivals, sessions, strict=True)))


async def replay(sessions: Sequence[Session], config: ReplayConfig) -> ReplayResult:
    chosen = list(sessions[: config.max_sessions] if config.max_sessions else sessions)
    total_turns = sum(len(s.turns) for s in chosen)
    client = openai.AsyncOpenAI(
        base_url=config.base_url,
        api_key=config.api_key,
        max_retries=0,  # a failure is a measurement, not something to hide
        timeout=config.timeout_s,
    )
    bar = tqdm(total=total_turns, unit="req", disable=not config.progress, desc="replay")
    run = _Run(client, config, time.perf_counter(), [], bar)
    try:
        if config.rate is not None:
            await _open_loop(run, chosen, config.rate, config.seed)
        else:
            assert config.concurrency is not None
            await _closed_loop(run, chosen, config.concurrency)
    finally:
        bar.close()
        await client.close()
    total = time.perf_counter() - run.t0
    run.records.sort(key=lambda r: (r.start_s, r.session_id, r.turn))
    return ReplayResult(config, run.records, total, len(chosen))


def run_replay(sessions: Sequence[Session], config: ReplayConfig) -> ReplayResult:
    return asyncio.run(replay(sessions, config))


def write_result(result: ReplayResult, path: Path, meta: dict[str, Any] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(meta), indent=1) + "\n")
