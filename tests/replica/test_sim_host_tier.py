"""The simulated engine's host KV tier: the profile's host bandwidth, the torch-free mover
and the time a step pays for its copies.

The real scheduler and two-tier prefix cache run the steps; the backend's ``sleep``
advances a fake clock the scheduler also reads, so a request's prefill time must equal
the profile's step time plus its swap-in time, exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixgate.tokenizer import ChatTokenizer
from replica.config import EngineConfig
from replica.engine import Engine
from replica.prefix_cache import PrefixCache
from replica.request import RequestState, SamplingParams
from replica.scheduler import Scheduler, SchedulerConfig
from replica.sim.backend import SimBackend, SimModel, sim_backend
from replica.sim.host import SimHostPool
from replica.sim.profile import GB, SimProfile
from replica.sim.profiles import builtin_profiles
from tests.replica.test_sim_cost import FakeClock, Sink, prompt

B = 16
BUDGET = 512
DEVICE_BLOCKS = 64
A100 = builtin_profiles()["llama3.1-8b-a100"]
H100 = builtin_profiles()["llama3.1-8b-h100"]
BLOCK_BYTES = A100.block_bytes(B)  # 2 MiB: 32 layers x 8 KV heads x 128 x 2 (K, V) x bf16


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.for_model("sim")


class TierRig:
    """A scheduler over a sim backend with a host tier, on a fake clock."""

    def __init__(self, tokenizer: ChatTokenizer, profile: SimProfile, host_mb: int) -> None:
        self.clock = FakeClock()
        self.tokenizer = tokenizer
        self.profile = profile
        self.backend: SimBackend = sim_backend(
            profile,
            tokenizer,
            B,
            num_blocks=DEVICE_BLOCKS,
            host_cache_mb=host_mb,
            sleep=self.clock.sleep,
        )
        host = self.backend.host_pool
        assert host is not None
        self.host: SimHostPool = host
        self.cache = PrefixCache(DEVICE_BLOCKS, B, "sim", host_blocks=host.num_blocks, mover=host)
        self.scheduler = Scheduler(
            self.cache,
            self.backend.pool,
            None,
            SchedulerConfig(max_prefill_tokens_per_step=BUDGET, max_running=8),
            max_context=profile.max_context,
            clock=self.clock,
            runner=self.backend,
        )

    def run(self, rid: str, ids: list[int]) -> Sink:
        sink = Sink()
        request = RequestState(
            request_id=rid,
            prompt_token_ids=ids,
            params=SamplingParams(max_tokens=1),
            salt="",
            stop_token_ids=frozenset(self.tokenizer.eos_token_ids),
            sink=sink,
            submitted_at=self.clock(),
        )
        self.scheduler.add(request, self.tokenizer)
        while self.scheduler.has_work:
            self.scheduler.step()
            self.scheduler.check_invariants()
        assert sink.output is not None and sink.output.error is None
        return sink


def test_profiles_carry_the_cited_host_bandwidth() -> None:
    # 80% of one direction of PCIe: Gen4 x16 (A100) 32 GB/s, Gen5 x16 (H100) 64 GB/s.
    assert A100.host_gb_per_s == pytest.approx(25.6)
    assert H100.host_gb_per_s == pytest.approx(51.2)
    assert A100.demote_charge == H100.demote_charge == 0.0
    assert A100.swap_in_s(10, B) == pytest.approx(10 * BLOCK_BYTES / 25.6e9, rel=1e-12)
    # A block copied back costs far less than computing its 16 tokens (dense part alone).
    assert A100.swap_in_s(1, B) * 10 < A100.token_s * B
    slower = A100.with_overrides(host_copy_s_per_gb=0.5, demote_charge=0.25)
    assert slower.host_gb_per_s == 2.0 and slower.swap_in_s(1, B) == 0.5 * BLOCK_BYTES / GB
    assert slower.demote_s(4, B) == pytest.approx(0.25 * slower.swap_in_s(4, B), rel=1e-12)
    assert A100.with_overrides(host_copy_s_per_gb=0.0).host_gb_per_s is None
    with pytest.raises(ValueError, match="demote_charge"):
        A100.with_overrides(demote_charge=1.5)
    with pytest.raises(ValueError, match="host_copy_s_per_gb"):
        A100.with_overrides(host_copy_s_per_gb=-1.0)


def test_profile_files_keep_the_host_constants(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    changed = A100.with_overrides(host_copy_s_per_gb=0.1, demote_charge=0.5)
    path.write_text(changed.to_json())
    assert SimProfile.from_json_file(path) == changed


def test_the_mover_accrues_copy_time_until_a_step_takes_it() -> None:
    charged = A100.with_overrides(demote_charge=0.5)
    host = SimHostPool.from_budget(charged, B, 100)  # 100 MiB of 2 MiB blocks
    assert host.num_blocks == 50 and host.block_bytes == BLOCK_BYTES
    host.promote([0, 1, 2], [7, 8, 9])
    host.demote([3, 4], [10, 11])
    expected = charged.swap_in_s(3, B) + 0.5 * charged.swap_in_s(2, B)
    assert host.take_pending_s() == pytest.approx(expected, rel=1e-12)
    assert host.take_pending_s() == 0.0
    assert (host.stats.promoted_blocks, host.stats.demoted_blocks) == (3, 2)
    assert host.stats.swap_in_s == charged.swap_in_s(3, B)
    with pytest.raises(ValueError, match="distinct target"):
        host.promote([0, 1], [5, 5])
    with pytest.raises(ValueError, match="distinct target"):
        host.demote([0, 1], [5])
    with pytest.raises(ValueError, match="holds no block"):
        SimHostPool.from_budget(A100, B, 1)


def test_a_host_hit_pays_the_swap_in_in_its_prefill_step(tokenizer: ChatTokenizer) -> None:
    rig = TierRig(tokenizer, A100, host_mb=128)  # 64 host blocks
    rig.run("a", prompt(800))  # 50 blocks
    rig.run("b", prompt(800, offset=30_000))  # needs 50 of 64: 36 of a's go to the host
    stats = rig.cache.stats()
    assert stats.demotions == 36 and stats.host_cached_blocks == 36
    assert rig.host.stats.demote_s == 0.0  # demotions overlap compute
    before = rig.clock.now
    again = rig.run("a2", prompt(800) + prompt(40, offset=45_000)).output
    assert again is not None and again.cached_tokens == 800
    stats = rig.cache.stats()
    assert stats.host_hit_tokens == 36 * B and stats.promotions == 36
    assert stats.bytes_to_device == 36 * BLOCK_BYTES
    swap = A100.swap_in_s(36, B)
    assert rig.host.stats.swap_in_s == pytest.approx(swap, rel=1e-12)
    step = A100.step_s([(800, 40)])  # the 40 new tokens after 800 cached ones
    assert again.timings.prefill_s == pytest.approx(swap + step, rel=1e-12)
    assert rig.clock.now - before == pytest.approx(swap + step, rel=1e-12)
    assert rig.backend.stats.copy_s == pytest.approx(swap, rel=1e-12)
    assert rig.backend.stats.busy_s == pytest.approx(rig.clock.now, rel=1e-12)
    assert stats.pinned_blocks == 0


def test_a_demotion_charge_is_paid_by_the_step_that_evicts(tokenizer: ChatTokenizer) -> None:
    profile = A100.with_overrides(demote_charge=0.5)
    rig = TierRig(tokenizer, profile, host_mb=128)
    rig.run("a", prompt(800))
    out = rig.run("b", prompt(800, offset=30_000)).output  # demotes 36 blocks of a
    assert out is not None
    chunks = profile.step_s([(0, 512)]) + profile.step_s([(512, 288)])
    demote = 0.5 * profile.swap_in_s(36, B)
    assert out.timings.prefill_s == pytest.approx(chunks + demote, rel=1e-12)
    assert rig.host.stats.demote_s == pytest.approx(demote, rel=1e-12)


def test_without_a_host_tier_the_evicted_prefix_is_computed_again(
    tokenizer: ChatTokenizer,
) -> None:
    """The same sequence on a sim engine with no host tier: a's evicted blocks are gone."""
    clock = FakeClock()
    backend = sim_backend(A100, tokenizer, B, num_blocks=DEVICE_BLOCKS, sleep=clock.sleep)
    assert backend.host_pool is None
    model = SimModel("sim", tokenizer, A100.max_context)
    engine = Engine(model, EngineConfig(num_blocks=DEVICE_BLOCKS), backend=backend)
    engine.start()
    try:
        params = SamplingParams(max_tokens=1)
        engine.generate(prompt(800), params)
        engine.generate(prompt(800, offset=30_000), params)
        again = engine.generate(prompt(800) + prompt(40, offset=45_000), params)
    finally:
        engine.stop(10)
    assert again.cached_tokens == 14 * B  # only the head blocks left on the device
    assert engine.cache_stats().host_total_blocks == 0 and backend.stats.copy_s == 0.0


def test_a_sim_engine_thread_serves_a_host_hit(tokenizer: ChatTokenizer) -> None:
    """The engine (its own thread, as in a replica) with the sim backend's host tier."""
    clock = FakeClock()
    backend = sim_backend(
        A100, tokenizer, B, num_blocks=DEVICE_BLOCKS, host_cache_mb=128, sleep=clock.sleep
    )
    model = SimModel("sim", tokenizer, A100.max_context)
    config = EngineConfig(num_blocks=DEVICE_BLOCKS, host_cache_mb=128, check_invariants=True)
    engine = Engine(model, config, backend=backend)
    engine.start()
    try:
        params = SamplingParams(max_tokens=2)
        engine.generate(prompt(800), params)
        engine.generate(prompt(800, offset=30_000), params)
        again = engine.generate(prompt(800) + prompt(40, offset=45_000), params)
        stats = engine.cache_stats()
    finally:
        engine.stop(10)
    assert again.cached_tokens == 800 and again.error is None
    assert stats.host_total_blocks == 64 and stats.host_hit_tokens > 0
    assert stats.bytes_to_device == stats.promotions * BLOCK_BYTES > 0
    assert backend.stats.copy_s == pytest.approx(A100.swap_in_s(stats.promotions, B), rel=1e-12)
    assert stats.pinned_blocks == 0


def test_the_cli_builds_a_sim_host_tier_from_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from replica.cli import build_parser
    from replica.sim.setup import build_sim

    monkeypatch.setenv("PREFIXGATE_SIM_HOST_COPY_S_PER_GB", "0.5")
    flags = ["--model", "sim", "--sim-profile", "llama3.1-8b-a100", "--host-cache-mb", "64"]
    args = build_parser().parse_args([*flags, "--sim-demote-charge", "0.25", "--num-blocks", "32"])
    _model, backend = build_sim(args, "sim")
    host = backend.host_pool
    assert host is not None and host.num_blocks == 32  # 64 MiB of 2 MiB blocks
    assert host.profile.host_copy_s_per_gb == 0.5 and host.profile.demote_charge == 0.25
    assert host.profile == A100.with_overrides(host_copy_s_per_gb=0.5, demote_charge=0.25)
    assert backend.pool.num_blocks == 32
