"""``prefixgate bench``: gen writes valid JSONL; run → report works end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.cli import main, parse_params
from prefixgate.procs import free_port, stop_process, wait_http_ok

# Written in parallel by another engineer; these tests run as soon as it lands.
workloads = pytest.importorskip("loadtest.workloads")


def test_parse_params_takes_both_spellings() -> None:
    assert parse_params(["--num-sessions", "20", "--turns=3", "--name", "x", "--p", "0.5"]) == {
        "num_sessions": 20,
        "turns": 3,
        "name": "x",
        "p": 0.5,
    }
    with pytest.raises(ValueError, match="needs a value"):
        parse_params(["--turns"])
    with pytest.raises(ValueError, match="expected --name value"):
        parse_params(["turns"])


@pytest.mark.parametrize("kind", ["multi_turn_chat", "agents"])
def test_gen_writes_valid_reproducible_jsonl(kind: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["gen", kind, "--out", str(a), "--seed", "7"]) == 0
    assert main(["gen", kind, "--out", str(b), "--seed", "7"]) == 0
    assert a.read_bytes() == b.read_bytes()  # seeded: the same file twice
    lines = a.read_text().splitlines()
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)
    sessions = workloads.load_jsonl(a)
    assert len(sessions) == len(lines)
    assert all(s.kind == kind and s.turns for s in sessions)
    assert len({s.session_id for s in sessions}) == len(sessions)


def test_gen_rejects_an_unknown_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gen", "no_such_kind", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "no_such_kind" in capsys.readouterr().err


def test_run_then_report(tmp_path: Path) -> None:
    workload = tmp_path / "chat.jsonl"
    assert main(["gen", "multi_turn_chat", "--out", str(workload)]) == 0
    sessions = workloads.load_jsonl(workload)[:3]
    small = tmp_path / "small.jsonl"

    workloads.save_jsonl(sessions, small)
    n_requests = sum(len(s.turns) for s in sessions)

    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "tests.support.stub_backend", "--port", str(port), "--chunks", "2"],
        start_new_session=True,
    )
    results = tmp_path / "results.json"
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30, procs=[stub])
        code = main(
            [
                "run",
                "--base-url",
                f"http://127.0.0.1:{port}/v1",
                "--workload",
                str(small),
                "--model",
                "stub-model",
                "--concurrency",
                "2",
                "--out",
                str(results),
                "--label",
                "direct",
                "--experiment",
                "stub",
                "--no-progress",
            ]
        )
    finally:
        stop_process(stub)
    assert code == 0
    data = json.loads(results.read_text())
    assert data["summary"]["requests"] == n_requests and data["summary"]["errors"] == 0
    assert data["summary"]["output_tokens"] == 2 * n_requests
    assert data["meta"] == {"workload": "small", "policy": "direct", "experiment": "stub"}

    out = tmp_path / "bench"
    assert main(["report", str(results), "--out-dir", str(out)]) == 0
    md = (out / "README.md").read_text()
    assert "## stub" in md and "| direct |" in md
    assert (out / "ttft_cdf.png").stat().st_size > 0


def test_report_of_a_missing_file_fails(tmp_path: Path) -> None:
    assert main(["report", str(tmp_path / "nope.json"), "--out-dir", str(tmp_path)]) == 2


def test_simulate_writes_a_comparison_the_report_reads(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    code = main(
        [
            "simulate",
            "--kinds",
            "multi_turn_chat",
            "--replicas",
            "2,4",
            "--policies",
            "cache_aware,round_robin",
            "--sweep",
            "0.25,1.0",
            "--sweep-replicas",
            "2",
            "--out",
            str(out),
            "--sessions",
            "8",
            "--turns",
            "2",
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    names = [e["name"] for e in data["experiments"]]
    assert names == ["sim: multi_turn_chat, 2 replicas", "sim: multi_turn_chat, 4 replicas"]
    for exp in data["experiments"]:
        assert [r["policy"] for r in exp["rows"]] == ["oracle", "cache_aware", "round_robin"]
        for row in exp["rows"]:
            assert row["requests"] == 16 and 0.0 <= row["hit_rate"] <= 1.0
            assert sum(row["requests_per_replica"].values()) == 16
    (sweep,) = data["capacity_sweep"]
    assert len(sweep["rows"]) == 2 * 3  # two sizes × (oracle + two policies)

    assert main(["report", str(out), "--out-dir", str(tmp_path / "bench")]) == 0
    assert (tmp_path / "bench" / "hit_rate_vs_capacity.png").is_file()
