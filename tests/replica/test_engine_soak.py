"""A few hundred mixed requests on a small pool with random cancellations: the engine
must finish every one, keep its invariants after every step, and leave nothing pinned."""

from __future__ import annotations

import random

from replica.engine import Engine, EngineConfig
from replica.handle import RequestHandle
from replica.models import load_model
from replica.request import SamplingParams

NUM_REQUESTS = 200


def test_soak_with_cancellations_and_pool_pressure() -> None:
    model = load_model("tiny-random", dtype="float32")
    rng = random.Random(1234)
    # 40 blocks x 16 tokens: a handful of requests fill it, so admission waits,
    # running requests preempt each other and cached prefixes get evicted.
    engine = Engine(
        model,
        EngineConfig(
            num_blocks=40,
            max_prefill_tokens_per_step=96,
            max_running=12,
            max_waiting=NUM_REQUESTS,
            check_invariants=True,
        ),
    )
    shared = [
        [rng.randrange(100, 40000) for _ in range(rng.choice([16, 23, 40]))] for _ in range(4)
    ]
    engine.start()
    handles: list[tuple[RequestHandle, int]] = []
    cancelled: set[str] = set()
    for i in range(NUM_REQUESTS):
        prompt = [
            *rng.choice(shared),
            *(rng.randrange(100, 40000) for _ in range(rng.randrange(1, 60))),
        ]
        n = rng.choice([1, 1, 1, 2, 3])
        params = SamplingParams(
            max_tokens=rng.randrange(1, 24),
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([None, 20]),
            seed=rng.choice([None, i]),
            n=n,
            stop=rng.choice([[], ["a"], ["the", "\n"]]),
            ignore_eos=rng.random() < 0.5,
        )
        handle = engine.submit(prompt, params, salt=rng.choice(["", "tenant-b"]))
        handles.append((handle, n))
        if rng.random() < 0.2:
            engine.cancel(handle.request_id)
            cancelled.add(handle.request_id)
        if i % 25 == 24 and handles:  # cancel something already running, too
            victim = rng.choice(handles)[0]
            engine.cancel(victim.request_id)
            cancelled.add(victim.request_id)
    outputs = [(h.wait(300), n) for h, n in handles]
    engine.run_until_idle(timeout=60)
    assert engine.alive and engine.error is None
    stats = engine.cache.stats()
    engine.cache.check_invariants()
    engine.scheduler.check_invariants()
    engine.stop(timeout=30)
    assert stats.pinned_blocks == 0
    assert stats.free_blocks + stats.evictable_blocks == stats.total_blocks
    assert engine.scheduler.num_preemptions > 0
    assert engine.load().running == 0 and engine.load().waiting == 0
    reasons = set()
    for output, n in outputs:
        assert len(output.choices) == n
        for choice in output.choices:
            reasons.add(choice.finish_reason)
            assert choice.finish_reason in ("stop", "length", "abort")
            if choice.finish_reason != "abort":
                assert output.request_id not in cancelled or choice.token_ids
    assert {"length", "abort"} <= reasons
    assert any(o.cached_tokens > 0 for o, _ in outputs)
