"""Property-based fuzz of both servers' completion bodies, against real processes.

One ``tiny-random`` replica and one gateway in front of it. Hypothesis (fixed seed) draws
request bodies for ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``,
``/tokenize``, ``/v1/messages`` and vLLM's token API (``/inference/v1/generate`` and
its aborts), valid and hostile (``tests.support.fuzz_bodies``), and
each body goes to both servers.

The property, for every body on every server: an answer within the client timeout, never
a 5xx, a 4xx that is an OpenAI error envelope, and a 200 stream that ends (``[DONE]``,
or a Responses stream's ``response.completed``, a Messages stream's ``message_stop``)
and carries no error event. Every violation is collected (with the body that caused it)
and the test fails once at the end listing them all, grouped by input class.
When a body leaves the replica unhealthy (its engine stopped), both servers are
restarted so that the remaining bodies still test something; the wedging body is a
violation of its own.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from prefixgate.procs import free_port, http_ok, stop_process, wait_http_ok
from tests.support.fuzz_bodies import CLIENT_TIMEOUT_S, MODEL, Case, cases, check

EXAMPLES = 1_500  # each body goes to both servers: 3,000 requests
BUDGET_S = 240.0  # a bound on the whole run even when servers wedge; normally ~1 min
MAX_RESTARTS = 4
REPLICA_FLAGS = ("--num-blocks", "512", "--log-level", "warning")
GATEWAY_FLAGS = ("--probe-interval-s", "0.5", "--log-level", "warning")


# ------------------------------------------------------------------------------ servers


@dataclass(slots=True)
class Servers:
    """One replica and one gateway that knows only it, restartable."""

    workdir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)  # "replica" / "gateway" → base URL
    restarts: int = 0

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        replica_port, gateway_port = free_port(), free_port()
        replica = f"http://127.0.0.1:{replica_port}"
        self.urls = {"replica": replica, "gateway": f"http://127.0.0.1:{gateway_port}"}
        base = [sys.executable, "-m", "prefixgate"]
        self.procs = [
            self._spawn(
                "replica",
                [*base, "replica", "--model", MODEL, "--port", str(replica_port), *REPLICA_FLAGS],
            ),
            self._spawn(
                "gateway",
                [
                    *base,
                    "gateway",
                    "--port",
                    str(gateway_port),
                    "--replica",
                    replica,
                    *GATEWAY_FLAGS,
                ],
            ),
        ]
        wait_http_ok(f"{replica}/health", 120, procs=self.procs)
        wait_http_ok(f"{self.urls['gateway']}/ready", 60, procs=self.procs)

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def healthy(self) -> bool:
        return all(p.poll() is None for p in self.procs) and http_ok(
            f"{self.urls['replica']}/health", timeout=2.0
        )

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc, grace_s=5)

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    pair = Servers(tmp_path)
    pair.start()
    yield pair
    pair.stop()


# --------------------------------------------------------------------------------- check


@dataclass(slots=True)
class Finding:
    server: str
    case: Case
    outcome: str

    def line(self) -> str:
        body = re.sub(rb"(.)\1{9,}", lambda m: b"%s{x%d}" % (m[1], len(m[0])), self.case.body)
        shown = body[:240].decode("utf-8", "backslashreplace")
        return f"{self.case.path} [{self.case.label}] {shown}"


def test_no_body_gets_a_5xx_or_a_hang(servers: Servers) -> None:
    findings: list[Finding] = []
    sent = Counter[str]()
    started = time.monotonic()
    client = httpx.Client(timeout=CLIENT_TIMEOUT_S)

    @seed(20261201)
    @settings(
        max_examples=EXAMPLES,
        database=None,
        deadline=None,
        phases=[Phase.generate],  # every violation is collected; no shrinking
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def fuzz(case: Case) -> None:
        if time.monotonic() - started > BUDGET_S or servers.restarts > MAX_RESTARTS:
            return
        for server in ("replica", "gateway"):
            problem = check(client, server, servers.urls[server], case)
            sent[server] += 1
            if problem is not None:
                findings.append(Finding(server, case, problem))
            if not servers.healthy():
                findings.append(Finding(server, case, "the replica was unhealthy afterwards"))
                servers.restart()
                return

    with client:
        fuzz()
    elapsed = time.monotonic() - started
    first: dict[str, Finding] = {}
    by_class = Counter[str]()
    for f in findings:
        key = f"{f.server}: {f.outcome[:70]!r}"
        by_class[key] += 1
        first.setdefault(key, f)
    report = [f"{n}× {key}\n    e.g. {first[key].line()}" for key, n in by_class.most_common()]
    assert not findings, (
        f"{len(findings)} violations in {sum(sent.values())} requests ({dict(sent)}) in "
        f"{elapsed:.0f} s, {servers.restarts} restarts:\n" + "\n".join(report)
    )
    assert sum(sent.values()) >= 2_000, f"only {dict(sent)} requests within {BUDGET_S:.0f} s"
