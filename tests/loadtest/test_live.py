"""The live experiment's bookkeeping: repeats pooled into one run, targets checked on the
pooled figures and counted per repeat; one set of sim replicas shared by two policies'
gateways. (``prefixgate up`` itself is exercised by tests/deploy/test_up.py and the
gateway and replica suites.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from loadtest.cluster import Cluster
from loadtest.pooling import pool_cells
from loadtest.replay import ReplayConfig, ReplayResult, RequestRecord
from loadtest.targets import check_targets

EXP = "live: agents"


def _cell(
    policy: str, repeat: int, ttft_ms: float, total_s: float, replicas: list[str]
) -> dict[str, Any]:
    records = [
        RequestRecord(
            session_id=f"s{i}",
            turn=0,
            start_s=0.01 * i,
            ttft_s=(ttft_ms + i) / 1000,
            e2e_s=(ttft_ms + i + 20) / 1000,
            prompt_tokens=100,
            cached_tokens=50 + 10 * repeat,
            output_tokens=4,
            replica=replicas[i % len(replicas)],
        )
        for i in range(6)
    ]
    config = ReplayConfig(base_url="http://127.0.0.1:1/v1", model="m", concurrency=2)
    meta = {"experiment": EXP, "policy": policy, "workload": "agents", "repeat": repeat}
    data = ReplayResult(config, records, total_time_s=total_s, n_sessions=6).to_json(meta)
    data["cache_stats"] = {r: {"hit_tokens": 10, "query_tokens": 40} for r in replicas}
    return data


def test_repeats_pool_into_one_run_per_policy() -> None:
    cells = [
        _cell("cache_aware", 0, 10, 2.0, ["r0", "r1"]),
        _cell("round_robin", 0, 30, 3.0, ["r0", "r1", "r2"]),
        _cell("cache_aware", 1, 20, 1.0, ["r0", "r1", "r2"]),
        _cell("round_robin", 1, 5, 4.0, ["r0", "r1", "r2"]),
        _cell("cache_aware", 2, 30, 9.0, ["r0", "r1", "r2"]),
        _cell("round_robin", 2, 40, 5.0, ["r0", "r1", "r2"]),
    ]
    ca, rr = pool_cells(cells)
    assert (ca["meta"]["policy"], rr["meta"]["policy"]) == ("cache_aware", "round_robin")
    assert "repeat" not in ca["meta"]
    s = ca["summary"]
    assert s["repeats"] == 3 and s["requests"] == 18 and s["sessions"] == 18
    assert s["hit_rate"] == pytest.approx((300 + 360 + 420) / 1800)  # every request
    assert s["total_time_s"] == 2.0 and s["total_time_s_range"] == [1.0, 9.0]  # the median
    assert s["output_tokens_per_s"] == pytest.approx(24 / 2.0)
    assert s["requests_per_replica"] == {"r0": 7, "r1": 7, "r2": 4}
    assert s["load_max_over_mean"] == 1.0 and s["load_max_over_mean_worst"] == 1.0
    # The TTFT median is over all 18 requests, not a median of medians.
    assert s["ttft_p50_s"] == pytest.approx(0.0225)
    assert sorted({r["repeat"] for r in ca["requests"]}) == [0, 1, 2]
    assert ca["cache_stats"]["r0"]["hit_tokens"] == 30
    assert ca["cluster_hit_rate"] == pytest.approx(0.25)

    targets = check_targets([ca, rr], {EXP: {"hit_rate": 0.7}}, cells)[EXP]
    assert targets["hit_rate_over_oracle"] == pytest.approx(0.6 / 0.7)
    assert not targets["hit_rate_target_met"]
    assert targets["ttft_p50_best"]  # pooled: 22.5 ms against 32.5 ms
    assert targets["total_time_best"]  # medians: 2.0 s against 4.0 s
    assert targets["ttft_p50_best_in_repeats"] == "2/3"  # repeat 1: 22.5 against 7.5
    assert targets["total_time_best_in_repeats"] == "2/3"  # repeat 2: 9.0 against 5.0


def test_a_missing_figure_never_counts_as_best() -> None:
    ca = _cell("cache_aware", 0, 10, 2.0, ["r0"])
    other = _cell("round_robin", 0, 30, 3.0, ["r0"])
    ca["summary"]["ttft_p50_s"] = None  # every request failed before its first token
    targets = check_targets([ca, other], {})[EXP]
    assert not targets["ttft_p50_best"] and targets["total_time_best"]
    assert targets["hit_rate_over_oracle"] is None and "ttft_p50_best_in_repeats" not in targets


def test_replica_cpu_seconds_reads_the_replicas_from_the_pids_file(tmp_path: Path) -> None:
    # A stand-in replica that burns some CPU, says so, then idles until killed.
    work = "sum(i * i for i in range(3_000_000)); print('done', flush=True); input()"
    child = subprocess.Popen(
        [sys.executable, "-c", work], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        (tmp_path / "pids").write_text(
            f"redis {os.getpid()} 1\nreplica-0 {child.pid} 2\ngateway {os.getpid()} 3\n"
        )
        cluster = Cluster(child, tmp_path, "http://127.0.0.1:3/v1")  # type: ignore[arg-type]
        used = cluster.replica_cpu_seconds()
        # Only the replica is counted: this test process has used far more than it.
        assert used is not None and 0.05 <= used < time.process_time()
        (tmp_path / "pids").write_text("replica-0 999999999 2\n")  # gone: unknown
        assert cluster.replica_cpu_seconds() is None
    finally:
        child.kill()
        child.wait()


def test_scale_multiplies_sessions_and_documents() -> None:
    from loadtest.live import LIVE_PARAMS, live_params

    agents = live_params("agents", 3)
    assert (agents["agents"], agents["sessions_per_agent"], agents["steps"]) == (12, 8, 4)
    assert live_params("multi_turn_chat", 2)["sessions"] == 64
    docs = live_params("skewed_docs", 4)
    assert (docs["requests"], docs["docs"], docs["lengths"]) == (512, 64, (300, 600, 1000))
    assert live_params("multi_turn_chat") == LIVE_PARAMS["multi_turn_chat"]
    assert LIVE_PARAMS["agents"]["agents"] == 4  # the table itself untouched


def test_shared_replicas_one_cluster_and_a_gateway_per_policy(tmp_path: Path) -> None:
    """Two policies on one set of 2 sim replicas: the second policy's gateway joins the
    first's cluster; each cell's requests land on the shared replicas, through its own
    gateway (round robin spreads, and the idle gateway, stopped, routes nothing), and
    each cell's reset empties every replica first."""
    from loadtest.cache_sizing import Sizing
    from loadtest.cluster import Cluster, JoinedGateway, rss_mb
    from loadtest.live import LiveConfig, Workload, run_cells, start_clusters
    from loadtest.workloads import generate

    cfg = LiveConfig(
        replicas=2,
        model="sim",
        policies=["consistent_hash", "round_robin"],
        workloads=["multi_turn_chat"],
        out_dir=tmp_path / "out",
        concurrency=2,
        fraction=1 / 3,
        seed=0,
        ready_timeout_s=60,
        run_root=tmp_path / "runs",
        router_options=[],
        repeats=1,
        shared_replicas=True,
    )
    sessions = generate(
        "multi_turn_chat", sessions=4, turns=2, system_len=40, user_len=8, max_tokens=2
    )
    workload = Workload("multi_turn_chat", sessions, [], Sizing(0, 64, 0.0, 0), True)
    started = start_clusters(cfg, num_blocks=64)
    try:
        host, joined = started.targets["consistent_hash"], started.targets["round_robin"]
        assert isinstance(host, Cluster) and isinstance(joined, JoinedGateway)
        assert joined.host is host and joined.base_url != host.base_url
        assert set(started.gateway_pids) == {"consistent_hash", "round_robin"}
        assert len(set(started.gateway_pids.values())) == 2
        assert rss_mb(started.processes) > 0 and started.startup_s > 0
        cells = run_cells(cfg, started.targets, [workload], started.gateway_pids)
        replicas = set(host.replica_urls())
        for cell in cells:
            s = cell["summary"]
            assert s["errors"] == 0 and s["requests"] == 8
            assert set(s["requests_per_replica"]) <= replicas
            assert sum(s["requests_per_replica"].values()) == 8
            served = sum(int(st["queries"]) for st in cell["cache_stats"].values())
            assert served >= 8  # the replicas' own counters saw this cell's requests
            assert s["gateway_cpu_s"] > 0  # it routed the cell
            assert s["other_gateways_cpu_s"] == 0  # the idle gateway was stopped meanwhile
        pooled = pool_cells(cells)[0]["summary"]
        assert pooled["gateway_cpu_s"] == cells[0]["summary"]["gateway_cpu_s"]
        assert pooled["other_gateways_cpu_s"] == cells[0]["summary"]["other_gateways_cpu_s"]
        rr = next(c for c in cells if c["meta"]["policy"] == "round_robin")
        assert rr["summary"]["requests_per_replica"] == {r: 4 for r in replicas}
        for target in (host, joined):  # each gateway routed its own cell's 8, no more
            url = target.base_url.removesuffix("/v1") + "/router/stats"
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert sum(json.loads(resp.read())["decisions"].values()) == 8
        assert any(st["cached_blocks"] for st in host.cache_stats().values())
        joined.reset_prefix_cache()  # through the joined gateway: every replica emptied
        assert not any(st["cached_blocks"] for st in host.cache_stats().values())
    finally:
        for row in reversed(started.targets.values()):
            row.stop()
    assert host.proc.poll() is not None and joined.proc.poll() is not None


def test_a_cell_waits_until_its_gateway_sees_the_previous_cells_load_leave() -> None:
    # A stand-in for a gateway's /router/stats: the replicas' reports still show the
    # previous cell's requests for the first polls, then none.
    import http.server
    import threading

    from loadtest.cluster import wait_router_idle

    polls: list[int] = []
    lingering = {"r0": (2, 1650), "r1": (1, 0)}

    class Stats(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            polls.append(1)
            busy = len(polls) <= 3 or self.server.stuck  # type: ignore[attr-defined]
            replicas = {
                r: {"load": load if busy else 0, "queued_tokens": queued if busy else 0}
                for r, (load, queued) in lingering.items()
            }
            body = json.dumps({"replicas": replicas}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stats)
    server.stuck = False  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gateway = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        wait_router_idle(gateway, timeout_s=10)
        assert len(polls) == 4  # three busy answers, then the idle one
        server.stuck = True  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="still sees load"):
            wait_router_idle(gateway, timeout_s=0.3)
    finally:
        server.shutdown()
