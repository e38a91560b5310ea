"""Replay client against a real server process: the stub OpenAI backend under uvicorn."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.replay import ReplayConfig, poisson_arrivals, run_replay, write_result
from prefixgate.procs import free_port, stop_process, wait_http_ok

# Written in parallel by another engineer; these tests run as soon as it lands.
workloads = pytest.importorskip("loadtest.workloads")

STUB_CHUNKS = 3  # the stub streams "tok0 ", "tok1 ", ... and reports 8 prompt tokens
STUB_PROMPT_TOKENS = 8


def start_stub(*flags: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.stub_backend",
            "--port",
            str(port),
            "--chunks",
            str(STUB_CHUNKS),
            *flags,
        ],
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", 30, procs=[proc])
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    proc, url = start_stub()
    yield url
    stop_process(proc)


def sessions(n: int, turns: int) -> list[Any]:
    return [
        workloads.Session(
            session_id=f"s{i}",
            kind="multi_turn_chat",
            system=f"system prompt {i}",
            turns=[workloads.Turn(user=f"question {i}.{t}", max_tokens=5) for t in range(turns)],
        )
        for i in range(n)
    ]


def stub_requests(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/stub/requests", timeout=5) as resp:
        body: list[dict[str, Any]] = json.loads(resp.read())
    return body


def test_closed_loop_replays_every_turn_with_history(stub: str, tmp_path: Path) -> None:
    config = ReplayConfig(base_url=f"{stub}/v1", model="stub-model", concurrency=2, progress=False)
    result = run_replay(sessions(3, 2), config)

    assert len(result.requests) == 6
    assert all(r.error is None for r in result.requests)
    for r in result.requests:
        assert r.ttft_s is not None and r.e2e_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == STUB_CHUNKS - 1
        assert (r.prompt_tokens, r.cached_tokens, r.output_tokens) == (8, 0, STUB_CHUNKS)
        assert r.replica is None  # a bare backend sends no x-prefixgate-replica
    s = result.summary()
    assert s["requests"] == 6 and s["errors"] == 0 and s["sessions"] == 3
    assert s["prompt_tokens"] == 6 * STUB_PROMPT_TOKENS
    assert s["output_tokens"] == 6 * STUB_CHUNKS
    assert s["hit_rate"] == 0.0
    assert s["requests_per_replica"] == {} and s["load_max_over_mean"] is None

    # The second turn resends system + first question + the reply actually received.
    seen = {
        (r["body"]["prompt_cache_key"], len(r["body"]["messages"])): r["body"]
        for r in stub_requests(stub)
    }
    second = seen[("s1", 4)]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][2]["content"] == "tok0 tok1 tok2 "
    assert second["messages"][3]["content"] == "question 1.1"
    assert second["stream"] is True and second["stream_options"] == {"include_usage": True}
    assert second["max_tokens"] == 5

    out = tmp_path / "results.json"
    write_result(result, out, {"policy": "direct", "workload": "tiny"})
    data = json.loads(out.read_text())
    assert data["kind"] == "replay" and data["meta"]["policy"] == "direct"
    assert data["config"]["concurrency"] == 2 and len(data["requests"]) == 6
    assert {
        "ttft_s",
        "itl_s",
        "e2e_s",
        "prompt_tokens",
        "cached_tokens",
        "output_tokens",
        "replica",
        "error",
        "session_id",
        "turn",
    } <= set(data["requests"][0])
    assert data["summary"]["requests"] == 6


def test_open_loop_starts_sessions_on_a_poisson_schedule(stub: str) -> None:
    config = ReplayConfig(
        base_url=f"{stub}/v1", model="stub-model", rate=40.0, seed=3, progress=False, max_sessions=5
    )
    result = run_replay(sessions(8, 2), config)

    assert config.mode == "open"
    assert result.n_sessions == 5 and len(result.requests) == 10
    assert all(r.error is None for r in result.requests)
    firsts = {r.session_id: r.start_s for r in result.requests if r.turn == 0}
    arrivals = poisson_arrivals(5, 40.0, 3)
    for i, at in enumerate(arrivals):
        assert firsts[f"s{i}"] >= at - 0.005  # never before its arrival time
    assert result.total_time_s >= arrivals[-1]


def test_errors_are_recorded_and_end_the_session() -> None:
    proc, url = start_stub("--fail-status", "503")
    try:
        config = ReplayConfig(
            base_url=f"{url}/v1", model="stub-model", concurrency=4, progress=False
        )
        result = run_replay(sessions(3, 3), config)
    finally:
        stop_process(proc)
    # Each session stops at its first failure: its later turns would need that reply.
    assert len(result.requests) == 3
    s = result.summary()
    assert s["errors"] == 3 and s["prompt_tokens"] == 0 and s["hit_rate"] is None
    assert all(r.error is not None and r.error.startswith("HTTP 503") for r in result.requests)
    assert list(s["error_counts"].values()) == [3]


def test_config_rejects_both_loops() -> None:
    with pytest.raises(ValueError, match="not both"):
        ReplayConfig(base_url="http://x/v1", model="m", concurrency=2, rate=1.0)
    assert ReplayConfig(base_url="http://x/v1", model="m").concurrency == 1


def test_serving_replica_comes_from_the_gateway_header(stub: str) -> None:
    other, other_url = start_stub()
    port = free_port()
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixgate",
            "gateway",
            "--port",
            str(port),
            "--replica",
            stub,
            "--replica",
            other_url,
            "--policy",
            "round_robin",
            "--model",
            "stub-model",
            "--log-level",
            "warning",
        ],
        start_new_session=True,
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/ready", 60, procs=[gateway])
        config = ReplayConfig(
            base_url=f"http://127.0.0.1:{port}/v1",
            model="stub-model",
            concurrency=2,
            progress=False,
        )
        result = run_replay(sessions(4, 2), config)
    finally:
        stop_process(gateway)
        stop_process(other)
    s = result.summary()
    assert s["errors"] == 0 and s["requests"] == 8
    per_replica = s["requests_per_replica"]
    assert set(per_replica) == {stub.removeprefix("http://"), other_url.removeprefix("http://")}
    assert sum(per_replica.values()) == 8
    assert s["load_max_over_mean"] == pytest.approx(1.0)  # round robin alternates
