"""The scheduler with a host tier: a prompt whose prefix was demoted is admitted by
copying its blocks back first, and the copy is charged to the step's prefill budget."""

from __future__ import annotations

import pytest
import torch

from replica.host_pool import HostPool
from replica.pool import BlockPool, PoolShape
from replica.prefix_cache import PrefixCache
from replica.scheduler import Scheduler, SchedulerConfig
from tests.replica.test_scheduler import B, CountUp, add, drain, step, tokens


def make(forward: CountUp, swap_in_token_cost: float) -> Scheduler:
    pool = BlockPool(PoolShape(1, 1, 2, B, torch.float32), 20, "cpu")
    host = HostPool(pool, 16)
    cache = PrefixCache(20, B, "m", host_blocks=host.num_blocks, mover=host)
    config = SchedulerConfig(max_prefill_tokens_per_step=16, swap_in_token_cost=swap_in_token_cost)
    return Scheduler(cache, pool, forward, config, max_context=256)


@pytest.mark.parametrize(("cost", "first_step"), [(0.1, [2]), (0.5, [])])
def test_a_host_hit_is_copied_in_and_charged_to_the_step(
    cost: float, first_step: list[int]
) -> None:
    forward = CountUp()
    sched = make(forward, cost)
    prompt = list(range(100, 141))  # 10 full blocks + 1 token
    add(sched, "a", prompt, max_tokens=1)
    drain(sched)
    add(sched, "pressure", list(range(300, 372)), max_tokens=1)  # 18 blocks: a's tail
    drain(sched)  # blocks are demoted (LRU: tails first), its head stays on the device
    before = sched.cache.stats()
    assert before.host_cached_blocks >= 8
    forward.sizes.clear()
    sink = add(sched, "again", [*prompt, 7, 8], max_tokens=2)
    step(sched)
    stats = sched.cache.stats()
    swapped = stats.host_hit_tokens - before.host_hit_tokens
    blocks_in = stats.promotions - before.promotions
    assert swapped >= 32 and blocks_in == -(-swapped // B)  # a's partial tail came back too
    assert sched.swapped_in_tokens == blocks_in * B  # the scheduler charges whole blocks
    # 41 tokens cached, ``blocks_in`` x 4 of them charged x cost of the 16 budget tokens.
    # At 0.1 the 2 uncached tokens still fit this step; at 0.5 the copy takes it.
    assert forward.sizes == first_step
    drain(sched)
    assert tokens(sink) == [[9, 10]]
    assert sched.cache.stats().pinned_blocks == 0


def test_a_host_hit_that_cannot_be_admitted_yet_is_not_copied_in() -> None:
    # A prompt whose prefix is on the host waits while a running request holds most of
    # the pool. Copying its blocks in before the rest of the prompt fits would evict
    # idle device blocks for nothing, and the running request's growth would demote the
    # copies again before the prompt starts (copied twice). Nothing is copied until the
    # whole prompt fits; then it is copied once and answered as before.
    forward = CountUp()
    sched = make(forward, 0.1)
    prompt = list(range(100, 141))  # 10 full blocks + 1 token
    add(sched, "a", prompt, max_tokens=1)
    drain(sched)
    add(sched, "pressure", list(range(300, 372)), max_tokens=1)  # a's tail to the host
    drain(sched)
    on_host = sched.cache.stats().host_cached_blocks
    assert on_host >= 8
    runner = add(sched, "runner", list(range(500, 556)), max_tokens=12)  # 14 blocks, growing
    step(sched)
    before = sched.cache.stats().promotions
    sink = add(sched, "again", [*prompt, 7, 8], max_tokens=2)  # 11 blocks: cannot fit yet
    while sched.running and sched.running[0].request.request_id == "runner":
        step(sched)
        if not any(s.request.request_id == "again" for s in sched.running):
            assert sched.cache.stats().promotions == before  # waiting: nothing copied
    drain(sched)
    assert tokens(sink) == [[9, 10]] and len(tokens(runner)[0]) == 12
    assert sched.cache.stats().promotions - before <= on_host  # each block copied once
