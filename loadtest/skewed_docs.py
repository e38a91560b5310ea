"""Skewed single-turn document traffic: document Q&A as a plain API client sends it.

Each request is one long document and one short question, sent once, with no
conversation id (no ``prompt_cache_key``, no session header): the router sees only the
prompt. A few documents take most requests (Zipf popularity), so the hot ones must be
replicated as load needs, and the cold tail must not push them out of the caches.

Variants (``VARIANTS``) differ in the document-length mix and the skew; every size is a
parameter of ``generate``. Sessions are ``loadtest.workloads.Session`` objects of one
turn each, so the simulator and the replay client take them as they are; route them
without conversation keys (``simulate(..., conversation_keys=False)``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from loadtest.workloads import Session, Turn, _Text

KIND = "skewed_docs"

# name -> generate() parameters: length mixes (short, long, mixed) and skews.
VARIANTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "docs_short_hot": {"lengths": (300, 500, 800), "zipf_s": 1.3},
        "docs_long_hot": {"lengths": (1500, 2000, 3000), "zipf_s": 1.3, "rate": 0.5},
        "docs_mixed_hot": {"lengths": (200, 600, 1200, 2500), "zipf_s": 1.6},
        "docs_mixed_flat": {"lengths": (200, 600, 1200, 2500), "zipf_s": 0.8},
    }
)


def generate(
    *,
    seed: int = 0,
    docs: int = 40,
    lengths: Sequence[int] = (200, 600, 1200, 2500),
    zipf_s: float = 1.3,
    requests: int = 400,
    question_len: int = 30,
    max_tokens: int = 40,
    rate: float = 1.0,
) -> list[Session]:
    """``requests`` single-turn requests over ``docs`` documents whose lengths (words ≈
    tokens) are drawn from ``lengths``; document k (by popularity rank) is asked with
    weight 1 / (k + 1) ** ``zipf_s``; Poisson arrivals at ``rate`` per second."""
    rng = random.Random(f"{KIND}:{seed}")
    text = _Text(rng)
    documents = [text.words(rng.choice(lengths)) for _ in range(docs)]
    weights = [1 / (rank + 1) ** zipf_s for rank in range(docs)]
    picks = rng.choices(range(docs), weights=weights, k=requests)
    sessions, t = [], 0.0
    for i, d in enumerate(picks):
        sessions.append(
            Session(
                f"doc{d}-{i}", KIND, documents[d], [Turn(text.words(question_len), max_tokens)], t
            )
        )
        t = round(t + rng.expovariate(rate), 6)
    return sessions


def variant(name: str, *, seed: int = 0, rate_scale: float = 1.0) -> list[Session]:
    """The sessions of one of ``VARIANTS`` at ``rate_scale`` × its default rate."""
    if name not in VARIANTS:
        raise ValueError(f"unknown document variant {name!r}; choose one of {list(VARIANTS)}")
    params = dict(VARIANTS[name])
    params["rate"] = params.get("rate", 1.0) * rate_scale
    return generate(seed=seed, **params)
