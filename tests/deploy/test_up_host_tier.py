"""``prefixgate up --host-cache-mb N``: every replica gets a host KV tier of N MiB (the
command parses with the real replica parser; a sim cluster's replicas report the tier)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from prefixgate import up
from prefixgate.procs import free_port
from tests.conftest import wait_until
from tests.deploy.test_up import Listed, read_pids, stop_up, up_command, while_running


def test_the_flag_reaches_every_replica_command() -> None:
    from replica.cli import build_parser as replica_parser

    args = up.parse_args(["--replicas", "3", "--host-cache-mb", "512", "--num-blocks", "64"])
    for i in range(3):
        cmd = up.replica_command(args, i, 9000 + i, "redis://x")
        replica = replica_parser().parse_args(cmd[4:])
        assert replica.host_cache_mb == 512 and replica.num_blocks == 64
    unset = up.replica_command(up.parse_args([]), 0, 9000, "redis://x")
    assert "--host-cache-mb" not in unset  # the replica's own default (or env) applies
    off = up.replica_command(up.parse_args(["--host-cache-mb", "0"]), 0, 9000, "redis://x")
    assert off[off.index("--host-cache-mb") + 1] == "0"


@pytest.mark.parametrize(
    "bad", [["--host-cache-mb", "-1"], ["--engine", "vllm", "--host-cache-mb", "100"]]
)
def test_bad_host_cache_flags_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        up.parse_args(bad)
    assert exc.value.code == 2


def test_a_sim_cluster_runs_with_a_host_tier_on_every_replica(tmp_path: Path) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    out_path = tmp_path / "up.out"
    cmd = up_command(port, run_dir, "--replicas", "2", "--model", "sim")
    cmd += ["--sim-profile", "llama3.1-8b-a100", "--num-blocks", "64", "--host-cache-mb", "96"]
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    listed: list[Listed] = []
    try:
        wait_until(while_running((run_dir / "ready").exists, proc), 120, "run_dir/ready")
        listed = read_pids(run_dir)
        replicas = [p for p in listed if p.name.startswith("replica-")]
        assert len(replicas) == 2
        for replica in replicas:
            stats = httpx.get(f"http://127.0.0.1:{replica.port}/cache/stats", timeout=10).json()
            assert stats["total_blocks"] == 64
            assert stats["host_total_blocks"] == 48  # 96 MiB of 2 MiB blocks
    finally:
        stop_up(proc, out_path, listed)
