"""``prefixgate gateway --workers N`` (gateway/workers.py): several processes on one port.

Real processes throughout: Redis, two built-in tiny-random replicas publishing their
blocks, a gateway whose parent starts two workers, and the official ``openai`` client.
Which worker a connection reached is read from ``/router/stats`` on that connection.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway import workers
from gateway.cli import build_parser
from gateway.workers import (
    MergedMetrics,
    Supervisor,
    WorkerSpec,
    bind_loopback,
    merged_metrics,
    usable_cpus,
)
from prefixgate import up
from prefixgate.procs import free_port, stop_process
from tests.conftest import RedisServer, wait_until
from tests.gateway.conftest import Server, start_gateway, start_replica, start_stub
from tests.support.proc_tree import alive, children

MODEL = "tiny-random"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")


def worker_of(client: openai.DefaultHttpxClient, url: str) -> int:
    """The worker serving ``client``'s one connection."""
    return int(client.get(url + "/router/stats").json()["worker"]["index"])


def one_connection() -> openai.DefaultHttpxClient:
    """An HTTP client of one connection: its requests all reach one worker."""
    return openai.DefaultHttpxClient(timeout=30, limits=httpx2.Limits(max_connections=1))


def connection_to(url: str, index: int, tries: int = 200) -> openai.DefaultHttpxClient:
    """A client whose one connection reached worker ``index`` (the kernel picks)."""
    for _ in range(tries):
        client = one_connection()
        if worker_of(client, url) == index:
            return client
        client.close()
    raise AssertionError(f"no connection reached worker {index} in {tries} tries")


def chat_requests(metrics: str) -> dict[str, float]:
    """Chat requests answered, by worker, from a /metrics text."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name == "prefixgate_gateway_requests":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("endpoint") == "chat":
                    worker = s.labels["worker"]
                    counts[worker] = counts.get(worker, 0.0) + s.value
    return counts


@pytest.fixture(scope="module")
def cluster(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("workers")
    flags = ["--redis-url", module_redis.url]
    replicas = [start_replica(root, f"replica-{i}", *flags) for i in range(2)]
    gateway = None
    try:
        gateway = start_gateway(root, "gateway", [], *flags, "--workers", "2", ready=False)
        url = gateway.url
        wait_until(
            lambda: all(
                httpx.get(url + "/ready?min_replicas=2").status_code == 200 for _ in range(8)
            ),
            timeout_s=60,
            what="both workers seeing both replicas",
        )
        yield gateway
    finally:
        for server in [gateway, *replicas]:
            if server is not None:
                server.stop()


def test_connections_reach_both_workers_and_metrics_count_every_request(
    cluster: Server,
) -> None:
    seen: set[int] = set()
    before = chat_requests(httpx.get(cluster.url + "/metrics").text)
    sent = 0
    deadline = time.monotonic() + 60
    while (len(seen) < 2 or sent < 12) and time.monotonic() < deadline:
        with one_connection() as http:
            seen.add(worker_of(http, cluster.url))
            client = openai.OpenAI(
                base_url=cluster.url + "/v1", api_key="unused", http_client=http, max_retries=0
            )
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hi {sent}"}], max_tokens=2
            )
            assert reply.choices[0].message.content is not None
            sent += 1
    assert seen == {0, 1}

    def counted() -> str | None:  # a merge is reused for a second (MergedMetrics)
        text = httpx.get(cluster.url + "/metrics").text
        return text if sum(chat_requests(text).values()) - sum(before.values()) == sent else None

    text = wait_until(counted, what=f"{sent} chat requests counted")
    assert text is not None
    after = chat_requests(text)
    assert set(after) == {"0", "1"}, text[:2000]
    # Each family once, whichever worker answered the scrape.
    assert text.count("# TYPE prefixgate_gateway_requests_total counter") == 1


def test_a_worker_routes_by_what_the_other_placed(cluster: Server) -> None:
    """A prompt sent through worker 0 is cached on one replica; the same prompt through
    worker 1 goes there, by blocks both learned through Redis."""
    prompt = f"A shared document about prefix caches, {time.time()}. " + "Caches hold. " * 60
    messages: list[Any] = [{"role": "user", "content": prompt}]

    def through(index: int) -> Any:
        with closing(connection_to(cluster.url, index)) as http:
            client = openai.OpenAI(
                base_url=cluster.url + "/v1", api_key="unused", http_client=http, max_retries=0
            )
            return client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=1
            )

    holder = through(0).headers["x-prefixgate-replica"]
    raw = through(1)
    route = raw.headers["x-prefixgate-route"]
    assert raw.headers["x-prefixgate-replica"] == holder, route
    matched, blocks = map(int, route.rsplit("matched=", 1)[1].split(";")[0].split("/"))
    assert blocks >= 8 and matched >= blocks - 1, route
    usage = raw.parse().usage
    details = usage.prompt_tokens_details if usage is not None else None
    assert details is not None and (details.cached_tokens or 0) >= 16 * (blocks - 1)


def test_a_killed_worker_is_restarted_and_the_port_keeps_serving(cluster: Server) -> None:
    workers = children(cluster.proc.pid)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    for i in range(6):  # new connections: the shared socket's other worker takes them
        with one_connection() as http:
            c = client.with_options(http_client=http)
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"on {i}"}], max_tokens=1
            )

    def replaced() -> list[int] | None:
        now = children(cluster.proc.pid)
        return now if len(now) == 2 and workers[0] not in now else None

    now = wait_until(replaced, timeout_s=30, what="the killed worker replaced")
    assert now is not None and workers[1] in now

    def both_answer() -> bool:
        seen = set()
        for _ in range(20):
            with one_connection() as http:
                seen.add(worker_of(http, cluster.url))
        return seen == {0, 1}

    wait_until(both_answer, timeout_s=30, what="both workers answering again")
    assert "exited (status -9): restarting it" in cluster.log_text()


@pytest.fixture
def lone_gateway(tmp_path: Path, module_redis: RedisServer) -> Iterator[Server]:
    stub = start_stub(tmp_path, "stub")
    gateway = None
    try:
        gateway = start_gateway(
            tmp_path, "gateway", [stub.url], "--redis-url", module_redis.url, "--workers", "2"
        )
        wait_until(lambda: len(children(gateway.proc.pid)) == 2, what="two workers")
        yield gateway
    finally:
        for server in (gateway, stub):
            if server is not None:
                server.stop()


def test_sigterm_stops_every_worker(lone_gateway: Server) -> None:
    workers = children(lone_gateway.proc.pid)
    lone_gateway.proc.send_signal(signal.SIGTERM)
    assert lone_gateway.proc.wait(timeout=30) == 0
    wait_until(lambda: not any(alive(p) for p in workers), what="the workers gone")


def test_workers_die_with_their_parent(lone_gateway: Server) -> None:
    workers = children(lone_gateway.proc.pid)
    lone_gateway.proc.kill()
    lone_gateway.proc.wait(timeout=10)
    wait_until(lambda: not any(alive(p) for p in workers), what="the orphaned workers gone")


def test_workers_without_redis_or_with_a_taken_port_do_not_start(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "prefixgate", "gateway", "--workers", "2"]
    out = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--workers above 1 needs --redis-url" in out.stdout
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [*base, "--redis-url", "redis://127.0.0.1:1", "--port", str(port)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in out.stdout


def test_a_worker_that_cannot_start_stops_the_gateway(tmp_path: Path) -> None:
    """A worker exiting before it served is not restarted in a loop: the parent stops."""
    args = [sys.executable, "-m", "prefixgate", "gateway", "--workers", "2", "--port"]
    args += [str(free_port()), "--redis-url", "redis://127.0.0.1:1"]
    # An unreadable keys file passes the parent's flag checks (a path) and fails the
    # workers' start-up, as a file removed between the two would.
    args += ["--api-keys", str(tmp_path / "missing.json")]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "before it served" in out.stdout + out.stderr
    assert "restarting it" not in out.stdout + out.stderr


def test_a_worker_that_keeps_dying_waits_longer_and_the_gateway_goes_on() -> None:
    """A request that crashes a worker, sent again and again, must not take the gateway
    down: the worker is restarted after a wait that doubles (the others serve); a worker
    that never served (its first start failed) stops the gateway."""
    public = [bind_loopback()]
    supervisor = Supervisor([], 2, public, tls=False)
    now = [100.0]
    supervisor.clock = lambda: now[0]
    supervisor.served[0] = True
    waits = []
    for _ in range(9):
        supervisor._exited(0, -11)
        waits.append(supervisor.due.pop(0) - now[0])
        now[0] += 1.0
    assert waits == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert not supervisor.stopping
    now[0] += 120.0  # a quiet minute: the next death restarts at once again
    supervisor._exited(0, -11)
    assert supervisor.due.pop(0) == now[0]
    supervisor._exited(1, 1)  # worker 1 never served
    assert supervisor.stopping and supervisor.exit_code == 1
    for sock in (*public, *supervisor.private):
        sock.close()


def test_merged_metrics_label_each_workers_series() -> None:
    a = (
        '# HELP x_total things\n# TYPE x_total counter\nx_total{k="a"} 2.0\n'
        "# HELP g a gauge\n# TYPE g gauge\ng 1.0\n"
    )
    b = '# HELP x_total things\n# TYPE x_total counter\nx_total{k="a"} 3.0\n'
    text = merged_metrics([(0, a), (1, b)]).decode()
    assert 'x_total{k="a",worker="0"} 2.0' in text
    assert 'x_total{k="a",worker="1"} 3.0' in text
    assert 'g{worker="0"} 1.0' in text
    assert text.count("# TYPE x_total counter") == 1
    # A text that does not parse is left out, not a failed scrape.
    assert merged_metrics([(0, a), (1, "x_total{k=")]).decode().count("worker=") == 2


def test_a_merge_is_reused_for_a_second_and_a_silent_worker_left_out() -> None:
    """``/metrics`` needs no key: a client asking in a loop gets one merge a second, not
    a round of asks to every worker each time."""
    now = [0.0]
    renders = []

    def own() -> bytes:
        renders.append(now[0])
        return b"# HELP x_total things\n# TYPE x_total counter\nx_total 1.0\n"

    async def scenario() -> None:
        # Worker 1's port answers nothing (a worker being restarted): left out.
        merged = MergedMetrics(0, (free_port(), free_port()), tls=False, clock=lambda: now[0])
        try:
            first = await merged.get(own)
            assert b'x_total{worker="0"} 1.0' in first and b'worker="1"' not in first
            assert await merged.get(own) == first and renders == [0.0]
            now[0] = 1.5
            await merged.get(own)
            assert renders == [0.0, 1.5] and merged.merges == 2
        finally:
            await merged.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_worker_spec_round_trip_and_up_passes_workers() -> None:
    spec = WorkerSpec(1, (5, 6), 7, (4001, 4002, 4003))
    assert WorkerSpec.decode(spec.encode()) == spec and spec.port == 4002
    for given in ("3", "auto"):
        args = up.parse_args(["--gateway-workers", given])
        command = up.gateway_command(args, [], "redis://x")
        assert command[command.index("--workers") + 1] == given
    assert "--workers" not in up.gateway_command(up.parse_args([]), [], "redis://x")
    assert build_parser().parse_args(["--workers", "AUTO"]).workers == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--workers", "many"])


def test_usable_cpus_are_the_affinity_at_most_the_cgroups_quota_rounded_up(
    tmp_path: Path,
) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(str(tmp_path)) == affinity  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(str(tmp_path)) == affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # a limit of 1.5 CPUs
    assert usable_cpus(str(tmp_path)) == min(affinity, 2)
    (tmp_path / "cpu.max").write_text("20000 100000\n")
    assert usable_cpus(str(tmp_path)) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(str(tmp_path)) == affinity
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert usable_cpus(str(tmp_path)) == 1


def test_usable_cpus_read_the_process_own_cgroup_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a host (no cgroup namespace) the process's cgroup is below the root."""
    affinity = len(os.sched_getaffinity(0))
    own = tmp_path / "kubepods" / "pod-a"
    own.mkdir(parents=True)
    (own / "cpu.max").write_text("100000 100000\n")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    monkeypatch.setattr(workers, "_own_cgroups", lambda: ("kubepods/pod-a", ""))
    assert usable_cpus(str(tmp_path)) == 1
    monkeypatch.setattr(workers, "_own_cgroups", lambda: ("elsewhere", ""))
    assert usable_cpus(str(tmp_path)) == affinity  # not there: the root's, no quota


def test_workers_auto_starts_one_per_usable_cpu_or_one_without_redis(
    tmp_path: Path, module_redis: RedisServer
) -> None:
    """``PREFIXGATE_WORKERS=auto`` (the flag's variable, as a container sets it)."""
    expected = usable_cpus()
    stub = start_stub(tmp_path, "stub")
    servers = [stub]
    try:
        auto = {"PREFIXGATE_WORKERS": "auto"}
        flags = ["--redis-url", module_redis.url]
        shared = start_gateway(tmp_path, "shared", [stub.url], *flags, env=auto)
        servers.append(shared)
        workers = expected if expected > 1 else 0  # one: the process serves alone
        wait_until(lambda: len(children(shared.proc.pid)) == workers, what="the workers")
        assert f"--workers auto: {expected} (the CPUs" in shared.log_text()
        alone = start_gateway(tmp_path, "alone", [stub.url], env=auto)
        servers.append(alone)
        assert children(alone.proc.pid) == []
        assert "--workers auto: 1 (several workers share state" in alone.log_text()
        for server in (shared, alone):
            assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
    finally:
        for server in reversed(servers):
            server.stop()


def test_workers_behind_tls_serve_and_merge_their_metrics(
    tmp_path: Path, module_redis: RedisServer
) -> None:
    """HTTPS (vLLM's ``--ssl-certfile``): the parent sees its workers up on their own
    loopback ports, and ``/metrics`` merges every worker's series over TLS too."""
    from tests.support.certs import make_certs

    certs = make_certs(tmp_path / "certs")
    stub = start_stub(tmp_path, "stub")
    port = free_port()
    args = [sys.executable, "-m", "prefixgate", "gateway", "--port", str(port)]
    args += ["--replica", stub.url, "--redis-url", module_redis.url, "--workers", "2"]
    args += ["--ssl-certfile", certs.server_cert, "--ssl-keyfile", certs.server_key]
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    try:
        context = ssl.create_default_context(cafile=certs.ca)
        with openai.DefaultHttpxClient(verify=context, timeout=10) as http:

            def ready() -> bool:
                assert proc.poll() is None, log.read_text()
                try:
                    return http.get(url + "/ready").status_code == 200
                except httpx2.HTTPError:
                    return False

            wait_until(ready, timeout_s=60, what="the TLS gateway ready")
            client = openai.OpenAI(
                base_url=url + "/v1", api_key="unused", http_client=http, max_retries=0
            )
            reply = client.chat.completions.create(
                model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
            assert reply.choices
            wait_until(
                lambda: (
                    'worker="1"' in (text := http.get(url + "/metrics").text)
                    and 'worker="0"' in text
                ),
                timeout_s=30,
                what="both workers' series over TLS",
            )
        assert "before it served" not in log.read_text()
    finally:
        stop_process(proc, grace_s=10)
        stub.stop()
