"""No request stops the engine: a failing request fails alone, a failing step fails its
requests, and a dead engine thread refuses work, ends what it held and takes the replica
process down with a non-zero status.

Failures that no valid input causes (a forward, a sampler or bookkeeping that raises)
are injected by replacing one function, in the real replica processes through a wrapper
script that patches it before ``replica.cli.main``; everything else is the real engine
on tiny-random.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from prefixgate.procs import free_port, stop_process, wait_http_ok
from replica.attention import PagedBatch
from replica.engine import Engine, EngineConfig
from replica.models import LoadedModel, load_model
from replica.request import EngineStopped, SamplingParams
from tests.conftest import wait_until
from tests.replica.conftest import REPO

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random", dtype="float32")


@contextmanager
def running(model: LoadedModel) -> Iterator[Engine]:
    engine = Engine(model, EngineConfig(num_blocks=64, check_invariants=True))
    engine.start()
    try:
        yield engine
    finally:
        engine.stop(timeout=30)


def _unpinned(engine: Engine) -> None:
    engine.run_until_idle(timeout=60)
    assert engine.cache.stats().pinned_blocks == 0
    engine.cache.check_invariants()


def test_a_request_whose_sampling_fails_fails_alone(tiny: LoadedModel) -> None:
    with running(tiny) as engine:
        expected = engine.generate(PROMPT, GREEDY)
        long = engine.submit(PROMPT, SamplingParams(max_tokens=30, temperature=0.0))
        # A bias on a token id past the vocabulary gets through the engine's own checks
        # (the server checks the vocabulary) and raises while sampling.
        poison = engine.submit(
            [*PROMPT, 1], SamplingParams(max_tokens=5, logit_bias={10**9: 1.0})
        ).wait(60)
        assert poison.error is not None and "sampling" in poison.error
        assert [c.finish_reason for c in poison.choices] == ["abort"]
        assert long.wait(60).error is None
        assert engine.alive and engine.error is None
        assert engine.generate(PROMPT, GREEDY).choices[0].token_ids == expected.choices[0].token_ids
        _unpinned(engine)


def test_a_request_whose_prompt_scoring_fails_fails_alone(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scoring a prompt's tokens (prompt log probabilities) raising fails that request
    alone, in the step that computed it; its blocks go back, the others go on."""
    with running(tiny) as engine:
        expected = engine.generate(PROMPT, GREEDY)
        real = engine.scheduler.runner.logprobs

        def failing(rows: Any, token_ids: Any, k: int) -> Any:
            if len(token_ids) > 1:  # prompt rows (a sampled token is scored alone)
                raise RuntimeError("scoring failed (injected)")
            return real(rows, token_ids, k)

        monkeypatch.setattr(engine.scheduler.runner, "logprobs", failing)
        long = engine.submit(PROMPT, SamplingParams(max_tokens=30, temperature=0.0, logprobs=1))
        scored = engine.submit(
            [*PROMPT, 1], SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=1)
        ).wait(60)
        assert scored.error is not None and "prompt log probabilities" in scored.error
        assert long.wait(60).error is None
        assert engine.alive and engine.error is None
        assert engine.generate(PROMPT, GREEDY).choices[0].token_ids == expected.choices[0].token_ids
        _unpinned(engine)


def test_tiny_temperatures_are_greedy(tiny: LoadedModel) -> None:
    with running(tiny) as engine:
        greedy = engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
        for temperature in (1e-40, 5e-324, 9e-6):
            out = engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=temperature))
            assert out.error is None
            assert out.choices[0].token_ids == greedy.choices[0].token_ids
        _unpinned(engine)


def test_seeds_outside_int64_are_refused_and_the_edges_work(tiny: LoadedModel) -> None:
    with running(tiny) as engine:
        for seed in (2**63, 2**64, -(2**63) - 1):
            with pytest.raises(ValueError, match="seed"):
                engine.submit(PROMPT, SamplingParams(seed=seed))
        for seed in (2**63 - 1, -(2**63)):  # choice i draws with seed + i: wraps to 64 bits
            out = engine.generate(PROMPT, SamplingParams(max_tokens=4, seed=seed, n=3))
            assert out.error is None and len(out.choices) == 3
        _unpinned(engine)


def test_a_failing_forward_fails_its_step_and_the_engine_goes_on(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running(tiny) as engine:
        expected = engine.generate(PROMPT, GREEDY)
        real_forward = engine.scheduler.forward
        assert real_forward is not None
        calls = 0

        def forward_failing_once(
            input_ids: torch.Tensor, batch: PagedBatch, rows: torch.Tensor
        ) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("CUDA out of memory (injected)")
            return real_forward(input_ids, batch, rows)

        monkeypatch.setattr(engine.scheduler, "forward", forward_failing_once)
        failed = engine.submit(PROMPT, GREEDY).wait(60)
        assert failed.error is not None and "running the model" in failed.error
        assert engine.alive
        assert engine.generate(PROMPT, GREEDY).choices[0].token_ids == expected.choices[0].token_ids
        _unpinned(engine)


def test_a_dead_engine_thread_refuses_work_and_ends_what_it_held(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running(tiny) as engine:
        died: list[BaseException] = []
        engine.on_death(died.append)
        in_flight = engine.submit(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        wait_until(lambda: engine.load().running == 1, what="the request is running")

        def broken_publish() -> None:  # bookkeeping outside any step: nothing to blame
            raise RuntimeError("bookkeeping failed (injected)")

        monkeypatch.setattr(engine, "_publish", broken_publish)
        output = in_flight.wait(60)
        assert output.error is not None
        wait_until(lambda: not engine.alive, what="the engine thread ended")
        assert isinstance(engine.error, RuntimeError) and died == [engine.error]
        with pytest.raises(EngineStopped, match="internal error"):
            engine.submit(PROMPT, GREEDY)
        late: list[BaseException] = []
        engine.on_death(late.append)  # registered after the death: called at once
        assert late == [engine.error]


def _start_wrapped(tmp_path: Path, patch: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """A real replica process (``replica.cli.main``) with ``patch`` applied first."""
    port = free_port()
    args = ["--model", "tiny-random", "--port", str(port), "--num-blocks", "64"]
    script = f"import sys\n{patch}\nfrom replica.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    log_path = tmp_path / "replica.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/health", timeout=180, procs=[proc])
    except Exception:
        stop_process(proc)
        raise AssertionError(log_path.read_text()[-3000:]) from None
    return proc, url, log_path


POISON_TOKEN = 4242
POISONED_SAMPLING = f"""
import replica.sampling as sampling
real = sampling.adjust_logits

def adjust_logits(scores, params, token_ids, num_prompt, banned=()):
    if token_ids and token_ids[0] == {POISON_TOKEN}:  # only requests that start with it
        raise RuntimeError("sampling failed (injected)")
    return real(scores, params, token_ids, num_prompt, banned)

sampling.adjust_logits = adjust_logits
"""


def test_a_failed_request_is_an_openai_error_and_the_process_serves_on(tmp_path: Path) -> None:
    proc, url, _ = _start_wrapped(tmp_path, POISONED_SAMPLING)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        poisoned = [POISON_TOKEN, *PROMPT]
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(
                model="tiny-random", prompt=poisoned, max_tokens=5, temperature=1.0
            )
        assert info.value.code == "engine_error" and "goes on" in info.value.message
        with pytest.raises(openai.APIError, match="failed while sampling"):
            for _ in client.completions.create(
                model="tiny-random", prompt=poisoned, max_tokens=5, stream=True, temperature=1.0
            ):
                pass
        body = {"model": "tiny-random", "prompt": poisoned, "max_tokens": 5, "stream": True}
        body["temperature"] = 1.0
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]", events
        out = client.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=5)
        assert out.choices[0].finish_reason == "length"
        stats = httpx.get(url + "/cache/stats", timeout=10).json()
        assert stats["pinned_blocks"] == 0
        assert proc.poll() is None
    finally:
        stop_process(proc)


DYING_BOOKKEEPING = """
from replica.engine import Engine
real = Engine._publish

def _publish(self):  # the engine's bookkeeping fails once a request is running
    if self.scheduler.running:
        raise RuntimeError("bookkeeping failed (injected)")
    real(self)

Engine._publish = _publish
"""


def test_the_replica_process_exits_non_zero_when_its_engine_dies(tmp_path: Path) -> None:
    proc, url, log_path = _start_wrapped(tmp_path, DYING_BOOKKEEPING)
    try:
        body: dict[str, Any] = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 50}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 500, log_path.read_text()
        assert resp.json()["error"]["type"] == "server_error"
        assert proc.wait(timeout=60) == 1, log_path.read_text()[-3000:]
    finally:
        stop_process(proc)
    assert "engine thread died" in log_path.read_text()
