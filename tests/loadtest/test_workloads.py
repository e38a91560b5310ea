from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from loadtest.workloads import (
    KINDS,
    Session,
    Turn,
    default_rate,
    generate,
    load_jsonl,
    save_jsonl,
)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_deterministic_and_in_arrival_order(kind: str) -> None:
    a, b = generate(kind, seed=3), generate(kind, seed=3)
    assert a == b and a != generate(kind, seed=4)
    assert all(s.kind == kind and s.turns and s.system for s in a)
    arrivals = [s.arrival_s for s in a]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert len({s.session_id for s in a}) == len(a)


def test_generated_shared_prefix_follows_its_parameters() -> None:
    sessions = generate(
        "generated_shared_prefix",
        groups=3,
        prompts_per_group=5,
        system_prompt_len=40,
        question_len=7,
        output_len=9,
    )
    assert len(sessions) == 15 and len({s.system for s in sessions}) == 3
    assert Counter(s.system for s in sessions).most_common(1)[0][1] == 5
    assert all(len(s.system.split()) == 40 and len(s.turns) == 1 for s in sessions)
    assert all(len(s.turns[0].user.split()) == 7 and s.turns[0].max_tokens == 9 for s in sessions)


def test_shared_prompt_chat_and_agents_shapes() -> None:
    chat = generate("multi_turn_chat", sessions=10, turns=3)
    assert len({s.system for s in chat}) == 1 and all(len(s.turns) == 3 for s in chat)
    agents = generate("agents", agents=2, sessions_per_agent=4, steps=2, tool_prompt_len=50)
    assert len(agents) == 8 and len({s.system for s in agents}) == 2


def test_doc_qa_is_skewed() -> None:
    sessions = generate("doc_qa", docs=20, sessions=400, doc_len=20)
    counts = Counter(s.system for s in sessions).most_common()
    assert counts[0][1] > 4 * counts[len(counts) // 2][1]


def test_jsonl_round_trip(tmp_path: Path) -> None:
    sessions = [
        *generate("agents", agents=1, sessions_per_agent=2),
        Session("x", "k", "s", [Turn("u", 1)]),
    ]
    save_jsonl(sessions, tmp_path / "w.jsonl")
    assert load_jsonl(tmp_path / "w.jsonl") == sessions


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="doc_qa"):
        generate("nope")


def test_default_rate_scales_arrivals() -> None:
    assert default_rate("doc_qa") == 0.5
    slow = generate("doc_qa", seed=1)
    fast = generate("doc_qa", seed=1, rate=4 * default_rate("doc_qa"))
    assert fast[-1].arrival_s == pytest.approx(slow[-1].arrival_s / 4)
    with pytest.raises(ValueError, match="unknown workload kind"):
        default_rate("nope")
