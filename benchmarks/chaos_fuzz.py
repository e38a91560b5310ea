"""The chaos benchmark's ``fuzz`` scenario: the fuzz test's bodies, many more of them.

``tests/test_fuzz_servers.py`` sends 1,500 hypothesis-drawn bodies (fixed seed) to one
replica and a gateway as part of ``make test``; this sends ``--fuzz-examples`` of them
(another seed by default, so new bodies) to a chaos cluster's gateway and one of its
replicas, within ``--fuzz-max-s``. One row: requests sent, answered as the property
requires, failed (5xx, a 4xx that is no OpenAI error, a broken 200 stream), hung; what
was wrong, counted; and whether every engine is alive at the end. It stops early when a
replica becomes unhealthy (the remaining bodies would only hang).
"""

from __future__ import annotations

import argparse
import time

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings

from loadtest.chaos_cluster import ChaosCluster
from loadtest.chaos_load import Kind, Outcome, Tally
from loadtest.chaos_row import Row
from prefixgate.procs import http_ok
from tests.support.fuzz_bodies import CLIENT_TIMEOUT_S, Case, cases, check


def fuzz_scenario(cfg: argparse.Namespace, cluster: ChaosCluster) -> Row:
    """Blocking: run it in a thread."""
    started = time.perf_counter()
    deadline = time.monotonic() + cfg.fuzz_max_s
    targets = {"replica": cluster.replica_urls[0], "gateway": cluster.gateway_url}
    outcomes: list[Outcome] = []
    wedged: list[str] = []
    client = httpx.Client(timeout=CLIENT_TIMEOUT_S)

    @seed(cfg.fuzz_seed)
    @settings(
        max_examples=cfg.fuzz_examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def send(case: Case) -> None:
        if wedged or time.monotonic() > deadline:
            return
        for server, base in targets.items():
            t0 = time.perf_counter()
            problem = check(client, server, base, case)
            outcomes.append(_outcome(server, case, problem, t0 - started))
        if not all(http_ok(f"{url}/health", timeout=2.0) for url in cluster.replica_urls):
            wedged.append(case.body[:200].decode("utf-8", "backslashreplace"))

    with client:
        send()
    tally = Tally(outcomes, started)
    row = Row.of(f"fuzz: {len(outcomes)} requests, hypothesis seed {cfg.fuzz_seed}", tally)
    row.check(row.failed == 0 and row.hung == 0, f"failed+hung: {row.failed + row.hung}")
    row.check(not wedged, "replicas healthy throughout" if not wedged else f"wedged by {wedged[0]}")
    return row


def _outcome(server: str, case: Case, problem: str | None, start_s: float) -> Outcome:
    if problem is None:
        return Outcome("ok", "ok", start_s, 0.0, False, None)
    kind: Kind = "hung" if problem.startswith("no answer") else "failed"
    body = case.body[:300].decode("utf-8", "backslashreplace")
    return Outcome(kind, f"{server}: {problem[:60]}", start_s, 0.0, False, case.label, detail=body)
