"""The host tier in the real engine (tiny-random): a prefix served from the host tier
gives the same greedy output as one served from the device or computed, and host hits
under pool pressure leak no device block (invariants checked after every step)."""

from __future__ import annotations

import random

import pytest

from replica.engine import Engine, EngineConfig
from replica.models import LoadedModel, load_model
from replica.request import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random", dtype="float32")


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _engine(model: LoadedModel, num_blocks: int, host_cache_mb: int) -> Engine:
    engine = Engine(
        model,
        EngineConfig(num_blocks=num_blocks, host_cache_mb=host_cache_mb, check_invariants=True),
    )
    engine.start()
    return engine


def _stop(engine: Engine) -> None:
    engine.run_until_idle(timeout=60)
    assert engine.cache.stats().pinned_blocks == 0
    engine.cache.check_invariants()
    engine.stop(timeout=30)
    assert engine.error is None


@pytest.mark.parametrize("head_len", [48, 37])
def test_greedy_equal_from_device_host_or_computed(tiny: LoadedModel, head_len: int) -> None:
    head = _prompt(1, head_len)
    prompt = [*head, *_prompt(2, 21)]
    cold = _engine(tiny, 128, 0)
    try:
        expected = cold.generate(prompt, GREEDY)
    finally:
        _stop(cold)
    assert expected.cached_tokens == 0

    engine = _engine(tiny, 16, 4)
    try:
        engine.generate(head, SamplingParams(max_tokens=1, temperature=0.0))
        on_device = engine.generate(prompt, GREEDY)
        assert on_device.cached_tokens == head_len
        assert engine.cache.stats().host_hit_tokens == 0
        # Two long unrelated requests take the whole device pool: the prompt's blocks
        # are demoted to the host tier, not dropped.
        for seed in (3, 4):
            engine.generate(_prompt(seed, 200), GREEDY)
        engine.run_until_idle(timeout=60)
        demoted = engine.cache.stats()
        assert demoted.demotions > 0 and demoted.host_cached_blocks > 0
        on_host = engine.generate(prompt, GREEDY)
        stats = engine.cache.stats()
    finally:
        _stop(engine)
    host_tokens = stats.host_hit_tokens
    # Every full block of the prompt was cached (the partial one holds other tokens).
    assert on_host.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert host_tokens == on_host.cached_tokens  # all of it from the host tier
    assert stats.promotions == -(-host_tokens // 16)
    assert stats.bytes_to_device == stats.promotions * engine.pool.shape.block_bytes  # type: ignore[attr-defined]
    want = expected.choices[0].token_ids
    assert on_device.choices[0].token_ids == want
    assert on_host.choices[0].token_ids == want


def test_host_hits_under_pool_pressure_leak_no_device_block(tiny: LoadedModel) -> None:
    """Many conversations sharing heads, a device pool far smaller than their prefixes,
    all submitted at once: promotions compete with admissions and decodes for blocks."""
    heads = [_prompt(100 + h, 40 + 9 * h) for h in range(4)]
    prompts = [[*heads[i % 4], *_prompt(200 + i, 5 + i)] for i in range(24)]
    big = _engine(tiny, 256, 0)
    try:
        expected = [big.generate(p, GREEDY).choices[0].token_ids for p in prompts]
    finally:
        _stop(big)
    engine = _engine(tiny, 20, 8)
    try:
        for _ in range(2):  # the second round finds the first round's blocks
            handles = [engine.submit(p, GREEDY) for p in prompts]
            got = [h.wait(120).choices[0].token_ids for h in handles]
            assert got == expected
        stats = engine.cache.stats()
    finally:
        _stop(engine)
    assert stats.promotions > 0 and stats.demotions > 0, stats
    assert stats.free_blocks + stats.evictable_blocks == stats.total_blocks
    assert stats.host_cached_blocks + stats.cached_blocks <= 20 + stats.host_total_blocks
