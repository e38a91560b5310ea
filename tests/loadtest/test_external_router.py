"""An external router as a live comparison row: its command line, the skip when
sglang-router or an isolated network is missing, the per-replica counts and the verdict
against it; and, where sglang-router is installed (``PREFIXGATE_SGLANG_PYTHON``) and
``unshare -rn`` works, a real live run with an sglang-router row."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from loadtest import external_router as ext
from loadtest.cluster import Cluster
from loadtest.replay import ReplayConfig, ReplayResult, RequestRecord

EXP = "live: skewed_docs"


def test_spec_names_a_known_router_and_policy() -> None:
    spec = ext.parse_spec("sglang:cache_aware")
    assert spec == ext.RouterSpec("sglang", "cache_aware")
    assert spec.name == "sglang:cache_aware"
    for bad in ("sglang", "sglang:", "sglang:consistent_hash", "vllm:cache_aware", ""):
        with pytest.raises(ValueError, match="choose one of"):
            ext.parse_spec(bad)


def test_command_sets_only_policy_and_addresses() -> None:
    spec = ext.parse_spec("sglang:round_robin")
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    cmd = ext.router_command("/venv/bin/python", spec, urls, 9100, 9101)
    assert cmd == [
        "/venv/bin/python",
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        "http://127.0.0.1:9001",
        "http://127.0.0.1:9002",
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
        "--port",
        "9100",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "9101",
    ]


def test_no_python_is_a_reason_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ext.PYTHON_ENV, raising=False)
    python, why = ext.find_python(None)
    assert python is None and "--sglang-python" in why and ext.PYTHON_ENV in why
    python, why = ext.find_python("/nonexistent/bin/python")
    assert python is None and "cannot run" in why
    monkeypatch.setenv(ext.PYTHON_ENV, "/nonexistent/bin/python")
    assert ext.find_python(None)[0] is None  # the variable is read when no flag is given


@pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is not None,
    reason="this Python has sglang_router",
)
def test_python_without_sglang_router_is_refused() -> None:
    python, why = ext.find_python(sys.executable)
    assert python is None and "cannot import sglang_router" in why


NET_DEV_HEADER = (
    "Inter-|   Receive                            |  Transmit\n"
    " face |bytes    packets errs drop fifo frame |bytes    packets errs\n"
)


def test_loopback_only_reads_the_namespace_interfaces(tmp_path: Path) -> None:
    net_dev = tmp_path / "dev"
    net_dev.write_text(NET_DEV_HEADER + "    lo:  0 0 0 0 0 0  0 0 0\n")
    assert ext.loopback_only(net_dev)
    net_dev.write_text(NET_DEV_HEADER + "    lo:  0 0 0 0 0 0  0 0 0\n  eth0: 5 1 0 0 0 0  2 1 0\n")
    assert not ext.loopback_only(net_dev)


def test_rows_are_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ext.PYTHON_ENV, raising=False)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    host = Cluster(done, tmp_path, "http://127.0.0.1:1/v1")  # never reached when skipped
    routers, reason = ext.start_routers(["sglang:cache_aware"], None, host, tmp_path / "x", 5)
    assert routers == {} and reason is not None and "--sglang-python" in reason
    assert not (tmp_path / "x").exists()  # nothing started, no log written
    with pytest.raises(ValueError, match="unknown external router"):
        ext.start_routers(["sglang:nope"], None, host, tmp_path / "x", 5)
    assert ext.start_routers([], None, host, tmp_path / "x", 5) == ({}, None)


def test_finished_requests_sums_the_replica_counter_over_labels() -> None:
    registry = CollectorRegistry()
    finished = Counter(
        "prefixgate:request_success", "Finished.", ["finished_reason"], registry=registry
    )
    finished.labels(finished_reason="length").inc(5)
    finished.labels(finished_reason="stop").inc(2)
    errors = Counter("prefixgate:request_errors", "Failed.", ["code"], registry=registry)
    errors.labels(code="x").inc(9)
    assert ext.finished_requests(generate_latest(registry).decode()) == 7.0


def _cell(policy: str, repeat: int, total_s: float, served: dict[str, int]) -> dict[str, Any]:
    """A replay cell as live.replay_on makes it; external rows name no replica."""
    records = [
        RequestRecord(
            f"s{i}",
            0,
            0.01 * i,
            ttft_s=0.05,
            e2e_s=0.1,
            prompt_tokens=100,
            cached_tokens=60,
            output_tokens=4,
        )
        for i in range(4)
    ]
    config = ReplayConfig(base_url="http://127.0.0.1:1/v1", model="m", concurrency=2)
    meta = {"experiment": EXP, "policy": policy, "workload": "skewed_docs", "repeat": repeat}
    data = ReplayResult(config, records, total_time_s=total_s, n_sessions=4).to_json(meta)
    data["cache_stats"] = {n: {"queries": 99, ext.SERVED: k} for n, k in served.items()}
    return data


def test_counts_come_from_what_replicas_served() -> None:
    from loadtest.pooling import pool_cells

    cells = [
        _cell("sglang:cache_aware", 0, 3.0, {"r0": 3, "r1": 1, "r2": 0}),
        _cell("sglang:cache_aware", 1, 2.0, {"r0": 2, "r1": 2}),
    ]
    for cell in cells:
        ext.counts_from_stats(cell)
    assert cells[0]["summary"]["requests_per_replica"] == {"r0": 3, "r1": 1}
    assert cells[0]["summary"]["load_max_over_mean"] == 1.5
    (run,) = pool_cells(cells)
    assert run["summary"]["requests_per_replica"] == {}  # no record names a replica
    ext.pool_counts([run], cells)
    assert run["summary"]["requests_per_replica"] == {"r0": 5, "r1": 3}
    assert run["summary"]["load_max_over_mean"] == 1.25  # median of 1.5 and 1.0
    assert run["summary"]["load_max_over_mean_worst"] == 1.5


def test_versus_external_compares_cache_aware_total_time() -> None:
    from loadtest.pooling import pool_cells

    cells = [
        _cell("cache_aware", 0, 2.0, {"r0": 4}),
        _cell("sglang:cache_aware", 0, 3.0, {"r0": 4}),
        _cell("sglang:round_robin", 0, 1.0, {"r0": 4}),
        _cell("cache_aware", 1, 4.0, {"r0": 4}),
        _cell("sglang:cache_aware", 1, 3.5, {"r0": 4}),
        _cell("sglang:round_robin", 1, 5.0, {"r0": 4}),
    ]
    verdict = ext.versus_external(pool_cells(cells), cells)[EXP]
    assert set(verdict) == {"sglang:cache_aware", "sglang:round_robin"}
    ca = verdict["sglang:cache_aware"]  # medians: 3.0 against 3.25
    assert ca["total_time_s"] == [3.0, 3.25] and ca["total_time_target_met"]
    assert ca["total_time_ratio"] == pytest.approx(3.0 / 3.25)
    assert ca["total_time_met_in_repeats"] == "1/2"
    rr = verdict["sglang:round_robin"]  # 3.0 against 3.0: at most counts as met
    assert rr["total_time_target_met"] and rr["total_time_met_in_repeats"] == "1/2"


def _isolation_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    return probe.returncode == 0


SGLANG_PYTHON = os.environ.get(ext.PYTHON_ENV, "")


@pytest.mark.slow
@pytest.mark.skipif(not SGLANG_PYTHON, reason=f"sglang-router not installed ({ext.PYTHON_ENV})")
@pytest.mark.skipif(not _isolation_works(), reason="unshare -rn not permitted here")
def test_live_run_with_an_sglang_row(tmp_path: Path) -> None:
    """Two sim replicas, cache_aware and sglang-router's cache_aware in front of them,
    the skewed document workload once each, all in one loopback-only namespace."""
    out = tmp_path / "out"
    bench = (
        f"{sys.executable} -m prefixgate bench live --replicas 2 --model sim "
        f"--policies cache_aware --external-router sglang:cache_aware "
        f"--sglang-python {SGLANG_PYTHON} --workloads skewed_docs --repeats 1 "
        f"--out-dir {out} --run-root {tmp_path / 'runs'} --no-report"
    )
    done = subprocess.run(
        ["unshare", "-rn", "sh", "-c", f"ip link set lo up && {bench}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "live.json").read_text())
    assert data["external_skipped"] is None
    runs = {r["meta"]["policy"]: r["summary"] for r in data["runs"]}
    sglang = runs["sglang:cache_aware"]
    assert sglang["errors"] == 0 and sglang["requests"] == 128
    assert sglang["hit_rate"] > 0.3  # the replicas' cached_tokens, through sglang-router
    assert sum(sglang["requests_per_replica"].values()) == 128
    verdict = data["versus_external"][next(iter(data["versus_external"]))]
    assert set(verdict) == {"sglang:cache_aware"}
