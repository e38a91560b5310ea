"""Workloads as data: sessions of turns, shared by the simulator and the replay client.

A session is sent turn by turn; each turn's prompt is the system prompt, every earlier
turn (user text and the reply the client actually got) and the new user text. Text is
built from a seeded vocabulary of made-up words, so one word ≈ one token.

Kinds (sizes in words ≈ tokens; every size is a parameter):

* ``shared_system_prompt``: single-turn requests that all start with one system prompt
  (the hot prefix that must be replicated, not hoarded).
* ``multi_turn_chat``: conversations under one shared system prompt, growing each turn.
* ``agents``: a few agent types, each with its own long tool-use prompt; each session
  is a trajectory whose turns append tool output.
* ``doc_qa``: sessions that ask questions about one of many documents, document picked
  with Zipf-skewed popularity.
* ``generated_shared_prefix``: SGLang's bench_serving "gsp" shape: ``groups`` system
  prompts, ``prompts_per_group`` single-turn questions under each.

Arrivals are Poisson at ``rate`` sessions per second.
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = (
    "shared_system_prompt",
    "multi_turn_chat",
    "agents",
    "doc_qa",
    "generated_shared_prefix",
)


@dataclass(slots=True)
class Turn:
    user: str
    max_tokens: int


@dataclass(slots=True)
class Session:
    session_id: str
    kind: str
    system: str
    turns: list[Turn] = field(default_factory=list)
    arrival_s: float = 0.0


class _Text:
    """Seeded made-up words: consonant-vowel syllables, 2-3 of them."""

    def __init__(self, rng: random.Random, vocab_size: int = 4096) -> None:
        syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
        words = {"".join(rng.choices(syllables, k=rng.choice((2, 3)))) for _ in range(vocab_size)}
        self.vocab = sorted(words)
        self.rng = rng

    def words(self, n: int) -> str:
        return " ".join(self.rng.choices(self.vocab, k=n))


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 6))
        t += rng.expovariate(rate)
    return out


def _shared_system_prompt(
    rng: random.Random,
    text: _Text,
    *,
    requests: int = 400,
    system_len: int = 800,
    question_len: int = 60,
    max_tokens: int = 48,
    rate: float = 1.0,
) -> list[Session]:
    system = text.words(system_len)
    return [
        Session(
            f"ssp-{i}",
            "shared_system_prompt",
            system,
            [Turn(text.words(question_len), max_tokens)],
            t,
        )
        for i, t in enumerate(_arrivals(rng, requests, rate))
    ]


def _multi_turn_chat(
    rng: random.Random,
    text: _Text,
    *,
    sessions: int = 96,
    turns: int = 5,
    system_len: int = 600,
    user_len: int = 60,
    max_tokens: int = 64,
    rate: float = 0.2,
) -> list[Session]:
    system = text.words(system_len)
    return [
        Session(
            f"chat-{i}",
            "multi_turn_chat",
            system,
            [
                Turn(text.words(rng.randint(user_len // 2, user_len * 3 // 2)), max_tokens)
                for _ in range(turns)
            ],
            t,
        )
        for i, t in enumerate(_arrivals(rng, sessions, rate))
    ]


def _agents(
    rng: random.Random,
    text: _Text,
    *,
    agents: int = 6,
    sessions_per_agent: int = 12,
    steps: int = 5,
    tool_prompt_len: int = 1200,
    tool_output_len: int = 120,
    max_tokens: int = 48,
    rate: float = 0.2,
) -> list[Session]:
    prompts = [text.words(tool_prompt_len) for _ in range(agents)]
    owners = [a for a in range(agents) for _ in range(sessions_per_agent)]
    rng.shuffle(owners)
    return [
        Session(
            f"agent{a}-{i}",
            "agents",
            prompts[a],
            [
                Turn(text.words(rng.randint(tool_output_len // 2, tool_output_len * 2)), max_tokens)
                for _ in range(steps)
            ],
            t,
        )
        for i, (a, t) in enumerate(zip(owners, _arrivals(rng, len(owners), rate), strict=True))
    ]


def _doc_qa(
    rng: random.Random,
    text: _Text,
    *,
    docs: int = 48,
    doc_len: int = 1000,
    sessions: int = 240,
    questions: int = 2,
    question_len: int = 30,
    max_tokens: int = 40,
    zipf_s: float = 1.1,
    system_len: int = 100,
    rate: float = 0.5,
) -> list[Session]:
    system_head = text.words(system_len)
    documents = [text.words(doc_len) for _ in range(docs)]
    weights = [1 / (rank + 1) ** zipf_s for rank in range(docs)]
    picks = rng.choices(range(docs), weights=weights, k=sessions)
    return [
        Session(
            f"doc{d}-{i}",
            "doc_qa",
            f"{system_head} {documents[d]}",
            [Turn(text.words(question_len), max_tokens) for _ in range(questions)],
            t,
        )
        for i, (d, t) in enumerate(zip(picks, _arrivals(rng, sessions, rate), strict=True))
    ]


def _generated_shared_prefix(
    rng: random.Random,
    text: _Text,
    *,
    groups: int = 16,
    prompts_per_group: int = 16,
    system_prompt_len: int = 1024,
    question_len: int = 64,
    output_len: int = 64,
    rate: float = 1.0,
) -> list[Session]:
    systems = [text.words(system_prompt_len) for _ in range(groups)]
    order = [g for g in range(groups) for _ in range(prompts_per_group)]
    rng.shuffle(order)
    return [
        Session(
            f"gsp{g}-{i}",
            "generated_shared_prefix",
            systems[g],
            [Turn(text.words(question_len), output_len)],
            t,
        )
        for i, (g, t) in enumerate(zip(order, _arrivals(rng, len(order), rate), strict=True))
    ]


_GENERATORS: dict[str, Callable[..., list[Session]]] = {
    "shared_system_prompt": _shared_system_prompt,
    "multi_turn_chat": _multi_turn_chat,
    "agents": _agents,
    "doc_qa": _doc_qa,
    "generated_shared_prefix": _generated_shared_prefix,
}


def default_rate(kind: str) -> float:
    """The kind's default arrival rate (sessions per second)."""
    if kind not in _GENERATORS:
        raise ValueError(f"unknown workload kind {kind!r}; choose one of {list(KINDS)}")
    rate = inspect.signature(_GENERATORS[kind]).parameters["rate"].default
    return float(rate)


def generate(kind: str, *, seed: int = 0, **params: Any) -> list[Session]:
    """Sessions of ``kind`` (see the module doc), in arrival order, fully determined by
    ``seed`` and ``params``."""
    if kind not in _GENERATORS:
        raise ValueError(f"unknown workload kind {kind!r}; choose one of {list(KINDS)}")
    rng = random.Random(f"{kind}:{seed}")
    return _GENERATORS[kind](rng, _Text(rng), **params)


def save_jsonl(sessions: Iterable[Session], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for session in sessions:
            f.write(json.dumps(asdict(session), separators=(",", ":")) + "\n")


def load_jsonl(path: str | Path) -> list[Session]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                data = json.loads(line)
                data["turns"] = [Turn(**t) for t in data["turns"]]
                out.append(Session(**data))
    return out
