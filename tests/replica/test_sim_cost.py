"""The simulated engine's cost model and its time accounting.

The real scheduler and prefix cache run the steps; the backend's ``sleep`` advances a
fake clock that the scheduler also reads, so each request's timings must equal what the
profile says its steps cost, exactly.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from prefixgate.tokenizer import ChatTokenizer
from replica.prefix_cache import PrefixCache
from replica.request import RequestOutput, RequestState, SamplingParams
from replica.scheduler import Scheduler, SchedulerConfig
from replica.sim.backend import SimBackend, output_vocabulary, sim_backend
from replica.sim.profile import SimProfile
from replica.sim.profiles import PROFILE_NAMES, builtin_profiles, load_profile, summary

B = 16
BUDGET = 512
H100 = builtin_profiles()["llama3.1-8b-h100"]


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.for_model("sim")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Sink:
    def __init__(self) -> None:
        self.output: RequestOutput | None = None

    def deliver(self, delta: object) -> None:
        pass

    def close(self, output: RequestOutput) -> None:
        self.output = output


class Rig:
    def __init__(self, tokenizer: ChatTokenizer, profile: SimProfile = H100) -> None:
        self.clock = FakeClock()
        self.tokenizer = tokenizer
        self.backend: SimBackend = sim_backend(
            profile, tokenizer, B, num_blocks=512, sleep=self.clock.sleep
        )
        self.cache = PrefixCache(self.backend.pool.num_blocks, B, "sim")
        self.scheduler = Scheduler(
            self.cache,
            self.backend.pool,
            None,
            SchedulerConfig(max_prefill_tokens_per_step=BUDGET, max_running=64),
            max_context=profile.max_context,
            clock=self.clock,
            runner=self.backend,
        )

    def add(
        self, rid: str, prompt: list[int], max_tokens: int = 1, seed: int | None = None
    ) -> Sink:
        sink = Sink()
        request = RequestState(
            request_id=rid,
            prompt_token_ids=prompt,
            params=SamplingParams(max_tokens=max_tokens, seed=seed),
            salt="",
            stop_token_ids=frozenset(self.tokenizer.eos_token_ids),
            sink=sink,
            submitted_at=self.clock(),
        )
        self.scheduler.add(request, self.tokenizer)
        return sink

    def drain(self) -> None:
        while self.scheduler.has_work:
            self.scheduler.step()
            self.scheduler.check_invariants()


def prompt(n: int, offset: int = 1000) -> list[int]:
    return [offset + i % 20_000 for i in range(n)]


def test_a_one_step_prefill_takes_what_the_profile_says(tokenizer: ChatTokenizer) -> None:
    rig = Rig(tokenizer)
    sink = rig.add("a", prompt(150))
    rig.drain()
    out = sink.output
    assert out is not None and out.error is None and out.completion_tokens == 1
    step = H100.step_s([(0, 150)])  # under the ridge point: the weights' streaming time
    assert step == H100.step_overhead_s + H100.weights_s + H100.attn_pair_s * 150 * 75.5
    assert out.timings.prefill_s == pytest.approx(step, rel=1e-12)
    assert out.timings.first_token_s == pytest.approx(step, rel=1e-12)
    assert rig.backend.stats.busy_s == pytest.approx(rig.clock.now) and rig.backend.stats.steps == 1


def test_chunked_prefill_then_decode_steps_add_up(tokenizer: ChatTokenizer) -> None:
    rig = Rig(tokenizer)
    sink = rig.add("a", prompt(1200), max_tokens=5)
    rig.drain()
    out = sink.output
    assert out is not None and out.completion_tokens == 5
    chunks = H100.step_s([(0, 512)]) + H100.step_s([(512, 512)]) + H100.step_s([(1024, 176)])
    assert chunks == pytest.approx(H100.prefill_s(1200, chunk=BUDGET), rel=1e-12)
    assert out.timings.prefill_s == pytest.approx(chunks, rel=1e-12)
    decode = sum(H100.step_s([(1200 + i, 1)]) for i in range(4))  # tokens 2..5
    assert out.timings.decode_s == pytest.approx(decode, rel=1e-12)
    assert rig.clock.now == pytest.approx(chunks + decode, rel=1e-12)


def test_a_cached_prefix_is_not_paid_again(tokenizer: ChatTokenizer) -> None:
    rig = Rig(tokenizer)
    rig.add("first", prompt(800))
    rig.drain()
    sink = rig.add("second", prompt(800) + prompt(40, offset=30_000))
    rig.drain()
    out = sink.output
    assert out is not None and out.cached_tokens == 800
    assert out.timings.prefill_s == pytest.approx(H100.step_s([(800, 40)]), rel=1e-12)


def test_sequences_in_one_step_share_its_time(tokenizer: ChatTokenizer) -> None:
    rig = Rig(tokenizer)
    a = rig.add("a", prompt(100), max_tokens=3)
    b = rig.add("b", prompt(200, offset=25_000), max_tokens=3)
    rig.drain()
    assert a.output is not None and b.output is not None
    first = H100.step_s([(0, 100), (0, 200)])
    assert a.output.timings.first_token_s == b.output.timings.first_token_s == first
    decodes = H100.step_s([(100, 1), (200, 1)]) + H100.step_s([(101, 1), (201, 1)])
    assert rig.clock.now == pytest.approx(first + decodes, rel=1e-12)


def test_the_roofline_regions() -> None:
    p = H100
    small = p.step_s([(0, 8)])  # weights streaming, and reading 8 tokens of K/V
    assert small == pytest.approx(p.step_overhead_s + p.weights_s + p.kv_read_s * 8)
    ridge = int(p.weights_s / p.token_s) + 1  # past it, dense compute dominates
    big = p.step_s([(0, 4 * ridge)])
    assert big > p.step_overhead_s + p.token_s * 4 * ridge
    # Decode reads the whole context: a longer context costs more, linearly.
    short, long = p.decode_step_s(32, 32 * 1000), p.decode_step_s(32, 32 * 8000)
    assert long - short == pytest.approx(p.kv_read_s * 32 * 7000, rel=1e-6)
    assert p.step_s([]) == 0.0


def test_pool_sizes_follow_the_gpu_or_the_budget() -> None:
    p = H100
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert p.num_blocks(16) == p.kv_cache_bytes // (16 * p.kv_bytes_per_token)
    assert 20_000 < p.num_blocks(16) < 35_000  # an 80 GB card, 16 GB of weights
    assert p.num_blocks(16, kv_cache_mb=1024) == 512  # 2 MiB per block of 16
    assert p.num_blocks(16, num_blocks=7) == 7
    with pytest.raises(ValueError, match="holds no block"):
        p.num_blocks(16, kv_cache_mb=1)


def test_profiles_load_by_name_or_file_and_constants_override(tmp_path: Path) -> None:
    assert set(PROFILE_NAMES) == {"llama3.1-8b-h100", "llama3.1-8b-a100"}
    a100 = load_profile("llama3.1-8b-a100")
    assert a100.prefill_s(2048, chunk=512) > H100.prefill_s(2048, chunk=512)
    path = tmp_path / "measured.json"
    path.write_text(H100.to_json())
    assert load_profile(str(path)) == H100
    faster = H100.with_overrides(weights_s=0.001, token_s=None)
    assert faster.weights_s == 0.001 and faster.token_s == H100.token_s
    assert H100.with_overrides() is H100
    with pytest.raises(ValueError, match="unknown sim profile"):
        load_profile("h200")
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="must be >= 0 and finite"):
            dataclasses.replace(H100, token_s=bad)
    with pytest.raises(ValueError, match="host_copy_s_per_gb"):
        H100.with_overrides(host_copy_s_per_gb=math.inf)


def test_a_free_profile_is_described_not_divided_by() -> None:
    """Every cost 0 (a GPU that takes no time, for load on the gateway itself) is
    allowed; its start-up summary divided by its prefill time and the replica died."""
    free = H100.with_overrides(
        step_overhead_s=0.0, weights_s=0.0, token_s=0.0, attn_pair_s=0.0, kv_read_s=0.0
    )
    assert free.prefill_s(2048, chunk=512) == 0.0
    assert "prefill of 2,048 tokens 0 ms (free)" in summary(free)


def test_tokens_are_deterministic_real_and_never_special(tokenizer: ChatTokenizer) -> None:
    def reply(seed: int | None, offset: int = 1000) -> list[int]:
        rig = Rig(tokenizer)
        sink = rig.add("r", prompt(50, offset), max_tokens=40, seed=seed)
        rig.drain()
        assert sink.output is not None
        return sink.output.choices[0].token_ids

    first = reply(None)
    assert first == reply(None) and len(first) == 40
    assert reply(7) != first and reply(None, offset=2000) != first
    allowed = set(output_vocabulary(tokenizer))
    assert set(first) <= allowed and not allowed & set(tokenizer.eos_token_ids)
    assert tokenizer.decode(first).strip()  # real text
