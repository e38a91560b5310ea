"""Chaos and soak: what clients see when parts of a local cluster fail under load.

    .venv/bin/python benchmarks/chaos.py [--scenario kill|restart|stop|redis|gateway|soak|fuzz ...]
        [--replicas 3] [--clients 16] [--soak-requests 10000] [--stop-s 20]
        [--redis-down-s 60] [--soak-max-s 1800] [--fuzz-examples 20000]
        [--out runs/chaos/chaos.json]

Each scenario starts its own cluster on loopback (Redis, ``--replicas`` tiny-random
replicas, one gateway: ``loadtest.chaos_cluster``), drives it with ``--clients``
concurrent clients (``loadtest.chaos_load``), breaks something on a fixed timeline,
and prints one row: requests sent / succeeded / failed / hung, what the clients saw, and
the scenario's own checks, each a fact with its number, and whether the scenario passed.

* ``kill``: SIGKILL the busiest replica. Every non-streaming request must succeed (retried
  elsewhere); a stream cut midway must end with an error event and ``[DONE]``.
* ``restart``: SIGKILL the busiest replica and start it again at once under the same id
  (a pod's container restarted in place). As ``kill``, and afterwards the gateway's view
  of it holds no block it does not (the dead life's blocks are gone) and it serves again.
  Whether its record expired in between (5 s) depends on the model's start-up:
  ``--model sim`` is back well within it.
* ``stop``: SIGSTOP the busiest replica for ``--stop-s`` (hung, not dead), then SIGCONT. No
  request may wait much longer than the gateway's upstream timeout; the breaker opens,
  traffic moves, and the replica serves again after SIGCONT.
* ``redis``: SIGKILL Redis for ``--redis-down-s``, then restart it (empty). No request
  may fail; afterwards the gateway's view of each replica holds no block the replica
  does not (its index rebuilt from the replicas' snapshots).
* ``gateway``: restart the gateway. Clients may see connection errors only while it is
  down; routing is warm again (cached prompt tokens) right after.
* ``soak``: ``--soak-requests`` requests, some abandoned midway (streaming or not), some
  hostile (``loadtest.chaos_requests``). At the end: no pinned block, nothing in flight
  at the gateway, every engine alive; resident memory of every process, start and end.
* ``fuzz``: ``--fuzz-examples`` hypothesis-drawn bodies, each to the gateway and to a
  replica: no 5xx, no hang (benchmarks/chaos_fuzz.py, the fuzz test's bodies).

Every wait on the timeline is the experiment's schedule; readiness is always polled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.chaos_cluster import ChaosCluster  # noqa: E402
from loadtest.chaos_load import Tally, run_load  # noqa: E402
from loadtest.chaos_requests import honest, mixed  # noqa: E402
from loadtest.chaos_row import HEADER, Row  # noqa: E402
from prefixgate.procs import http_ok  # noqa: E402

SCENARIOS = ("kill", "restart", "stop", "redis", "gateway", "soak", "fuzz")


async def _launch(cfg: argparse.Namespace, name: str) -> ChaosCluster:
    gateway_flags = [
        *("--upstream-timeout-s", str(cfg.upstream_timeout_s)),
        *("--connect-timeout-s", "1", "--probe-interval-s", "0.5"),
    ]
    return await asyncio.to_thread(
        ChaosCluster.launch,
        cfg.run_root / name,
        cfg.model,
        cfg.replicas,
        cfg.num_blocks,
        gateway_flags,
    )


def _load(
    cfg: argparse.Namespace, cluster: ChaosCluster, stop: asyncio.Event
) -> asyncio.Task[Tally]:
    make = honest(cfg.model)
    coroutine = run_load(cluster.gateway_url, make, cfg.clients, cfg.client_timeout_s, stop)
    return asyncio.create_task(coroutine)


# --------------------------------------------------------------------------- scenarios


async def kill(cfg: argparse.Namespace, cluster: ChaosCluster) -> Row:
    stop = asyncio.Event()
    load = _load(cfg, cluster, stop)
    await asyncio.sleep(cfg.warm_s)
    victim = await asyncio.to_thread(cluster.busiest_replica)
    killed_at = time.perf_counter()
    cluster.signal_replica(victim, signal.SIGKILL)
    await asyncio.sleep(cfg.after_s)
    stop.set()
    tally = await load
    row = Row.of(f"SIGKILL 1 of {cfg.replicas} replicas, {cfg.clients} clients", tally)
    t_kill, rid = tally.since_start(killed_at), cluster.replica_id(victim)
    before = sum(o.replica == rid and o.start_s < t_kill for o in tally.outcomes)
    row.checks.append(f"the killed replica had served {before}")
    _check_failures_are_cut_streams(row, tally)
    row.check(row.hung == 0, f"hung: {row.hung}")
    return row


async def restart(cfg: argparse.Namespace, cluster: ChaosCluster) -> Row:
    stop = asyncio.Event()
    load = _load(cfg, cluster, stop)
    await asyncio.sleep(cfg.warm_s)
    victim = await asyncio.to_thread(cluster.busiest_replica)
    rid = cluster.replica_id(victim)
    killed_at = time.perf_counter()
    cluster.signal_replica(victim, signal.SIGKILL)
    await asyncio.to_thread(cluster.start_replica, victim)  # the same port: the same id
    back_at = time.perf_counter()
    await asyncio.sleep(cfg.after_s)
    stop.set()
    tally = await load
    row = Row.of(f"SIGKILL 1 of {cfg.replicas} replicas, started again under its id", tally)
    row.checks.append(f"down {back_at - killed_at:.1f} s (its record lives 5 s)")
    after = tally.since_start(back_at)
    served = sum(o.kind == "ok" and o.replica == rid and o.start_s > after for o in tally.outcomes)
    row.check(served > 0, f"served by it after the restart: {served}")
    stale = await asyncio.to_thread(cluster.stale_blocks)
    row.check(all(n == 0 for n in stale.values()), f"gateway blocks beyond replica's: {stale}")
    _check_failures_are_cut_streams(row, tally)
    row.check(row.hung == 0, f"hung: {row.hung}")
    return row


# How a stream cut by a fault ends when the gateway ends it well (chat and completions;
# the Responses API, whose streams have no ``[DONE]``).
CLEAN_CUTS = ("stream: error event then [DONE]", "responses stream: error event")


def _check_failures_are_cut_streams(row: Row, tally: Tally) -> None:
    """Non-streaming requests are retried before their first byte, so none may fail; a
    stream already under way can only be ended, with an error event and ``[DONE]``."""
    plain_failed = [o for o in tally.outcomes if o.kind == "failed" and not o.stream]
    cut = [o for o in tally.outcomes if o.kind == "failed" and o.stream]
    clean = [o for o in cut if o.saw in CLEAN_CUTS]
    row.check(not plain_failed, f"non-streaming failed: {len(plain_failed)}")
    row.check(len(clean) == len(cut), f"streams cut: {len(cut)}, {len(clean)} ended error+[DONE]")


async def pause(cfg: argparse.Namespace, cluster: ChaosCluster) -> Row:
    stop = asyncio.Event()
    load = _load(cfg, cluster, stop)
    await asyncio.sleep(cfg.warm_s)
    victim = await asyncio.to_thread(cluster.busiest_replica)
    rid = cluster.replica_id(victim)
    paused_at = time.perf_counter()
    cluster.signal_replica(victim, signal.SIGSTOP)
    watch = asyncio.create_task(_watch_replica(cluster, rid, stop))
    await asyncio.sleep(cfg.stop_s)
    cluster.signal_replica(victim, signal.SIGCONT)
    resumed_at = time.perf_counter()
    await asyncio.sleep(cfg.after_s)
    stop.set()
    tally, states = await load, await watch
    row = Row.of(f"SIGSTOP 1 replica {cfg.stop_s:g} s, then SIGCONT", tally)
    during = sum(
        o.replica == rid and o.start_s < tally.since_start(paused_at) for o in tally.outcomes
    )
    row.checks.append(f"it had served {during}")
    slowest = tally.max_latency_s()
    row.check(
        slowest <= cfg.upstream_timeout_s + 5.0,
        f"slowest request {slowest:.1f} s (upstream timeout {cfg.upstream_timeout_s:g} s)",
    )
    opened = next((t - paused_at for t, healthy in states if not healthy), None)
    row.check(opened is not None, f"out of routing at +{_fmt(opened)} s")
    back = next((t - paused_at for t, ok in states if ok and t > resumed_at), None)
    row.check(
        back is not None,
        f"routed again at +{_fmt(back)} s (SIGCONT at +{resumed_at - paused_at:.0f} s)",
    )
    after = tally.since_start(resumed_at)
    served = sum(o.kind == "ok" and o.replica == rid and o.start_s > after for o in tally.outcomes)
    row.check(served > 0, f"served by it after SIGCONT: {served}")
    _check_failures_are_cut_streams(row, tally)
    row.check(row.hung == 0, f"hung: {row.hung}")
    return row


async def _watch_replica(
    cluster: ChaosCluster, rid: str, stop: asyncio.Event
) -> list[tuple[float, bool]]:
    """(time.perf_counter(), routable?) whenever the gateway's view of ``rid`` changes."""
    seen: list[tuple[float, bool]] = []
    while not stop.is_set():
        try:
            stats = await asyncio.to_thread(cluster.router_stats)
            view = stats["replicas"].get(rid, {})
            healthy = bool(view.get("healthy")) and view.get("breaker") in ("closed", None)
        except OSError:
            healthy = False
        if not seen or seen[-1][1] != healthy:
            seen.append((time.perf_counter(), healthy))
        await asyncio.sleep(0.25)  # the watcher's sampling interval
    return seen


async def redis_outage(cfg: argparse.Namespace, cluster: ChaosCluster) -> Row:
    stop = asyncio.Event()
    load = _load(cfg, cluster, stop)
    await asyncio.sleep(cfg.warm_s)
    logs = _log_paths(cluster)
    offsets = {name: path.stat().st_size for name, path in logs.items()}
    cluster.kill_redis()
    await asyncio.sleep(cfg.redis_down_s)
    await asyncio.to_thread(cluster.start_redis)
    await asyncio.sleep(cfg.after_s)
    stop.set()
    tally = await load
    row = Row.of(f"Redis killed {cfg.redis_down_s:g} s, restarted", tally)
    row.check(row.failed == 0 and row.hung == 0, f"failed+hung: {row.failed + row.hung}")
    stale = await asyncio.to_thread(cluster.stale_blocks)
    gaps = (await asyncio.to_thread(cluster.router_stats)).get("sequence_gaps")
    row.checks.append(f"event sequence gaps seen by the gateway: {gaps}")
    since = {name: _read_from(path, offsets[name]) for name, path in logs.items()}
    resynced = _GATEWAY_RESYNC in since.pop("gateway")
    republished = sum(_REPLICA_REPUBLISH in text for text in since.values())
    row.check(resynced, f"gateway resynced every replica from its snapshot: {resynced}")
    row.check(
        republished == cfg.replicas,
        f"replicas that re-published a snapshot: {republished}/{cfg.replicas}",
    )
    row.check(all(n == 0 for n in stale.values()), f"gateway blocks beyond replica's: {stale}")
    return row


# What the gateway (router/sync.py) and each replica's publisher log once Redis is back.
_GATEWAY_RESYNC = "Redis reachable again; resyncing"
_REPLICA_REPUBLISH = "is back; re-publishing a fresh snapshot"


def _log_paths(cluster: ChaosCluster) -> dict[str, Path]:
    names = ["gateway", *(f"replica-{i}" for i in range(cluster.args.replicas))]
    return {name: cluster.run_dir / f"{name}.log" for name in names}


def _read_from(path: Path, offset: int) -> str:
    """What ``path`` gained after ``offset`` (logs are appended to across runs)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


async def gateway_restart(cfg: argparse.Namespace, cluster: ChaosCluster) -> Row:
    stop = asyncio.Event()
    load = _load(cfg, cluster, stop)
    await asyncio.sleep(cfg.warm_s)
    down_at = time.perf_counter()
    await asyncio.to_thread(cluster.stop_gateway)
    await asyncio.to_thread(cluster.start_gateway)
    up_at = time.perf_counter()
    await asyncio.sleep(cfg.after_s)
    stop.set()
    tally = await load
    row = Row.of("gateway restarted under load", tally)
    t_down, t_up = tally.since_start(down_at), tally.since_start(up_at)
    outside = [o for o in tally.outcomes if o.kind != "ok" and not t_down - 1 <= o.start_s <= t_up]
    row.check(not outside, f"failures outside the {t_up - t_down:.1f} s restart: {len(outside)}")
    before, after = tally.hit_rate(t_down - 5, t_down), tally.hit_rate(t_up, t_up + 5)
    row.check(
        after is not None and before is not None and after >= 0.8 * before,
        f"hit rate 5 s before {_fmt(before)}, 5 s after {_fmt(after)}",
    )
    row.check(row.hung == 0, f"hung: {row.hung}")
    return row


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


async def soak(cfg: argparse.Namespace, cluster: ChaosCluster) -> Row:
    warm = asyncio.Event()
    await run_load(cluster.gateway_url, honest(cfg.model), 4, cfg.client_timeout_s, warm, 40)
    rss_start = cluster.rss_kib()
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(cfg.soak_max_s, stop.set)  # the time bound
    make = mixed(cfg.model, hostile_share=0.15, disconnect_share=0.15)
    tally = await run_load(
        cluster.gateway_url, make, cfg.clients, cfg.client_timeout_s, stop, cfg.soak_requests
    )
    row = Row.of(f"soak: {cfg.soak_requests} requests, 15% hostile, 15% abandoned", tally)
    sent = len(tally.outcomes)
    row.check(sent == cfg.soak_requests, f"{sent} sent within {cfg.soak_max_s:g} s")
    hostile = sum(o.hostile is not None for o in tally.outcomes)
    left = tally.count("disconnected")
    row.checks.append(f"hostile {hostile}, abandoned {left}")
    pinned, in_flight, waited = await asyncio.to_thread(cluster.wait_quiet)
    row.check(not any(pinned.values()), f"pinned blocks {pinned} after {waited:.1f} s")
    row.check(in_flight == 0, f"in flight at the gateway {in_flight}")
    alive = [http_ok(f"{url}/health", timeout=2.0) for url in cluster.replica_urls]
    row.check(all(alive), f"engines alive {sum(alive)}/{len(alive)}")
    rss_end = cluster.rss_kib()
    growth = {
        name: f"{(rss_start[name] or 0) // 1024}→{(rss_end.get(name) or 0) // 1024} MiB"
        for name in rss_start
    }
    row.checks.append(f"RSS {growth}")
    row.check(row.failed == 0 and row.hung == 0, f"failed+hung: {row.failed + row.hung}")
    return row


async def fuzz(cfg: argparse.Namespace, cluster: ChaosCluster) -> Row:
    from chaos_fuzz import fuzz_scenario  # hypothesis: a dev dependency, like this script

    return await asyncio.to_thread(fuzz_scenario, cfg, cluster)


Scenario = Callable[[argparse.Namespace, ChaosCluster], Awaitable[Row]]
RUNNERS: dict[str, Scenario] = {
    "kill": kill,
    "restart": restart,
    "stop": pause,
    "redis": redis_outage,
    "gateway": gateway_restart,
    "soak": soak,
    "fuzz": fuzz,
}


async def run(cfg: argparse.Namespace) -> list[Row]:
    rows = []
    print(HEADER, flush=True)
    for name in cfg.scenario or SCENARIOS:
        started = time.monotonic()
        cluster = await _launch(cfg, name)
        try:
            row = await RUNNERS[name](cfg, cluster)
        finally:
            await asyncio.to_thread(cluster.stop)
        row.seconds = time.monotonic() - started
        rows.append(row)
        print(row.markdown(), flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="repeatable; default all")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--client-timeout-s", type=float, default=60.0, help="beyond it: hung")
    p.add_argument("--upstream-timeout-s", type=float, default=10.0, help="the gateway's")
    p.add_argument("--warm-s", type=float, default=8.0, help="load before the fault")
    p.add_argument("--after-s", type=float, default=15.0, help="load after the fault")
    p.add_argument("--stop-s", type=float, default=20.0, help="how long SIGSTOP lasts")
    p.add_argument("--redis-down-s", type=float, default=60.0)
    p.add_argument("--soak-requests", type=int, default=10_000)
    p.add_argument("--soak-max-s", type=float, default=1800.0, help="the soak stops then")
    p.add_argument("--fuzz-examples", type=int, default=20_000, help="bodies, each sent twice")
    p.add_argument("--fuzz-seed", type=int, default=1)
    p.add_argument("--fuzz-max-s", type=float, default=900.0, help="the fuzz stops then")
    p.add_argument("--run-root", type=Path, default=Path("runs/chaos"), help="logs")
    p.add_argument("--out", type=Path, default=Path("runs/chaos/chaos.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    cfg = build_parser().parse_args(argv)
    rows = asyncio.run(run(cfg))
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    print(f"\n{HEADER}\n" + "\n".join(r.markdown() for r in rows))
    return 0 if all(not r.failures for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
