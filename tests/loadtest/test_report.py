"""Report: tables and PNGs from small replay, live and simulation result files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.replay import (
    ReplayConfig,
    ReplayResult,
    RequestRecord,
    busy_replicas,
    percentile,
)
from loadtest.report import ORACLE, load, markdown_table, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(policy: str, ttft_ms: float, cached: int, replicas: list[str]) -> dict[str, Any]:
    records = [
        RequestRecord(
            session_id=f"s{i}",
            turn=0,
            start_s=0.01 * i,
            ttft_s=(ttft_ms + i) / 1000,
            e2e_s=(ttft_ms + i + 20) / 1000,
            itl_s=[0.002, 0.003],
            prompt_tokens=100,
            cached_tokens=cached,
            output_tokens=3,
            replica=replicas[i % len(replicas)],
        )
        for i in range(8)
    ]
    config = ReplayConfig(base_url="http://127.0.0.1:1/v1", model="m", concurrency=2)
    result = ReplayResult(config, records, total_time_s=0.5, n_sessions=8)
    return result.to_json({"experiment": "live: agents", "policy": policy, "workload": "agents"})


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_summary_of_a_replay_is_consistent() -> None:
    s = _result("cache_aware", 10.0, 80, ["r0", "r1"])["summary"]
    assert s["requests"] == 8 and s["errors"] == 0
    assert s["prompt_tokens"] == 800 and s["cached_tokens"] == 640
    assert s["hit_rate"] == pytest.approx(0.8)
    assert s["output_tokens_per_s"] == pytest.approx(24 / 0.5)
    assert s["requests_per_replica"] == {"r0": 4, "r1": 4}
    assert s["load_max_over_mean"] == pytest.approx(1.0)
    assert s["ttft_p50_s"] == pytest.approx(0.0135)
    # r0 serves from 0 to 96 ms, r1 from 10 to 107 ms, of a 0.5 s run.
    assert s["busy_replicas_mean"] == pytest.approx((0.096 + 0.097) / 0.5)


def test_busy_replicas_counts_each_replica_once_and_skips_its_gaps() -> None:
    def rec(start: float, e2e: float, replica: str | None) -> RequestRecord:
        return RequestRecord("s", 0, start, e2e_s=e2e, replica=replica)

    records = [rec(0.0, 1.0, "a"), rec(0.5, 1.0, "a"), rec(3.0, 1.0, "a"), rec(0.0, 4.0, "b")]
    assert busy_replicas(records, 4.0) == pytest.approx((1.5 + 1.0 + 4.0) / 4.0)
    assert busy_replicas([rec(0.0, 1.0, None)], 4.0) is None


def test_report_writes_tables_and_pngs(tmp_path: Path) -> None:
    live = {
        "kind": "live",
        "runs": [
            _result("cache_aware", 10.0, 80, ["r0", "r1"]),
            _result("round_robin", 30.0, 20, ["r0", "r1", "r1"]),
        ],
        "oracle": {"live: agents": {"hit_rate": 0.82}},
        "notes": {"live: agents": "2 replicas, 40 blocks each"},
    }
    sim = {
        "kind": "simulation",
        "experiments": [
            {
                "name": "sim: agents, 8 replicas",
                "rows": [
                    {
                        "policy": "cache_aware",
                        "hit_rate": 0.7,
                        "ttft_p50_s": 0.01,
                        "requests_per_replica": {str(i): 10 + i for i in range(8)},
                    },
                    {
                        "policy": "round_robin",
                        "hit_rate": 0.2,
                        "ttft_p50_s": 0.05,
                        "requests_per_replica": {str(i): 12 for i in range(8)},
                    },
                ],
            }
        ],
        "capacity_sweep": [
            {
                "name": "agents, 8 replicas",
                "rows": [
                    {"policy": p, "blocks_per_replica": b, "hit_rate": h}
                    for p, b, h in [
                        ("cache_aware", 64, 0.3),
                        ("cache_aware", 256, 0.7),
                        ("round_robin", 64, 0.1),
                        ("round_robin", 256, 0.3),
                    ]
                ],
            }
        ],
    }
    (tmp_path / "live.json").write_text(json.dumps(live))
    (tmp_path / "sim.json").write_text(json.dumps(sim))
    report = load([tmp_path / "live.json", tmp_path / "sim.json"])
    assert report.experiments() == ["live: agents", "sim: agents, 8 replicas"]
    assert [r.policy for r in report.runs_of("live: agents")] == [
        "cache_aware",
        "round_robin",
        ORACLE,
    ]

    out = tmp_path / "bench"
    paths = write_report(report, out)
    names = {p.name for p in paths}
    assert names == {
        "hit_rate.png",
        "ttft_p50.png",
        "ttft_cdf.png",
        "requests_per_replica.png",
        "hit_rate_vs_capacity.png",
        "README.md",
    }
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000

    md = (out / "README.md").read_text()
    assert "## live: agents" in md and "2 replicas, 40 blocks each" in md
    assert "| cache_aware | 0.800 | 13.5 |" in md  # hit rate, TTFT p50 in ms
    assert "| oracle | 0.820 |" in md
    assert "| round_robin | 0.100 | 0.300 |" in md  # capacity sweep row
    assert "![hit_rate](hit_rate.png)" in md


def test_table_leaves_out_empty_columns() -> None:
    report_runs = load_runs_from_rows([{"policy": "a", "hit_rate": 0.5}])
    table = markdown_table(report_runs)
    assert table.splitlines()[0] == "| policy | hit rate |"
    assert table.splitlines()[2] == "| a | 0.500 |"


def load_runs_from_rows(rows: list[dict[str, Any]]) -> list[Any]:
    from loadtest.report import PolicyRun

    return [PolicyRun("e", r["policy"], r) for r in rows]


def test_unknown_kind_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"kind": "nope"}))
    with pytest.raises(ValueError, match="unknown result kind"):
        load([path])
