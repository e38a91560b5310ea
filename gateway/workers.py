"""``prefixgate gateway --workers N``: N gateway processes serving one address.

One gateway process is one Python thread of work: past one core it queues requests.
Each request costs it the body's checks, the template's render, tokenizing and hashing
the prompt, and every streamed chunk relayed (docs/BENCHMARKS.md, "One gateway process, and
several"). A cluster of many replicas outgrows it, as vLLM's own front end does
(``--api-server-count``) and LiteLLM's (``--num_workers``).

The parent here serves nothing. It binds the address once, and for each worker one
loopback port of its own, then starts N workers (``python -m prefixgate gateway`` with the
same flags) that inherit the sockets and accept on the shared one: the kernel hands each
connection to one of them. The workers share what gateways share: Redis (the replicas'
blocks, routing hints, response ids, tenant caps and rates), each with its own gateway
id, so ``--workers`` needs ``--redis-url``, exactly as several gateways do.

The parent restarts a worker that dies once it has served (the others go on accepting on
the shared socket meanwhile), after a wait that doubles while it keeps dying (up to 30
s), and stops every worker and exits when one dies before it ever answered ``/health``
(a bad flag or file: restarting would fail the same way).
SIGTERM, SIGINT or SIGHUP to the parent sends each worker one SIGTERM (a second signal:
SIGKILL). Workers die with the parent on Linux (``PR_SET_PDEATHSIG``), so a killed
parent leaves no process serving alone.

``--workers auto``: one worker per CPU this process may use (``usable_cpus``: its CPU
affinity, bounded by its cgroup's CPU quota, a container's CPU limit, rounded up).

``/metrics`` on the shared address answers every worker's series, each with a ``worker``
label: the answering worker asks the others on their loopback ports (``MergedMetrics``),
since a scrape reaches one worker at random. Everything else is a
worker's own view (``/router/stats`` says which worker answered).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import math
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType

import httpx

log = logging.getLogger("prefixgate.gateway")

AUTO = "auto"


def worker_count(value: str) -> int | str:
    """``--workers``: a count, or ``auto``."""
    if value.strip().lower() == AUTO:
        return AUTO
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of processes, or auto") from None


def usable_cpus(cgroup: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may run on: its affinity, at most its cgroup's CPU quota
    (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) rounded
    up, at least 1. A container limited to 1.5 CPUs gets 2: together they use 1.5."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def _cgroup_quota(cgroup: str) -> float | None:
    """The CPU quota in CPUs, None when there is none (or no cgroup file to read): of
    this process's own cgroup (``/proc/self/cgroup``), else of the hierarchy's root (a
    container's own cgroup, seen through its cgroup namespace)."""
    own_v2, own_v1 = _own_cgroups()
    for directory in dict.fromkeys([os.path.join(cgroup, own_v2), cgroup]):
        try:
            with open(os.path.join(directory, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError):
            continue
    v1_root = os.path.join(cgroup, "cpu")
    for directory in dict.fromkeys([os.path.join(v1_root, own_v1), v1_root]):
        try:
            with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
                quota_us = int(f.read())
            with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
                period_us = int(f.read())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def _own_cgroups() -> tuple[str, str]:
    """This process's cgroup paths, relative: in the v2 hierarchy and in v1's ``cpu``
    controller ("" when unknown or the root)."""
    v2 = v1 = ""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path.lstrip("/")
        elif "cpu" in controllers.split(","):
            v1 = path.lstrip("/")
    return v2, v1


# Set by the parent for each worker: "INDEX;PUBLIC_FD,...;PRIVATE_FD;PORT,PORT,..." (the
# loopback ports of every worker, by index).
WORKER_ENV = "PREFIXGATE_GATEWAY_WORKER"
# A worker that keeps dying (a request that crashes it, sent again and again) is restarted
# after a wait that doubles with each death within the window, up to the cap: the other
# workers go on serving meanwhile. Stopping the gateway instead would let one client take
# every worker down.
RESTART_WINDOW_S = 60.0
FIRST_BACKOFF_S = 0.5  # the second death in the window; the first restarts at once
MAX_BACKOFF_S = 30.0
BACKLOG = 2048  # uvicorn's default
_POLL_S = 0.2  # how often the parent looks at its workers


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker is told by its parent."""

    index: int
    public_fds: tuple[int, ...]
    private_fd: int
    ports: tuple[int, ...]  # every worker's loopback port, by index

    def encode(self) -> str:
        fds = ",".join(map(str, self.public_fds))
        return f"{self.index};{fds};{self.private_fd};{','.join(map(str, self.ports))}"

    @classmethod
    def decode(cls, raw: str) -> WorkerSpec:
        index, fds, private, ports = raw.split(";")
        return cls(
            int(index),
            tuple(int(f) for f in fds.split(",")),
            int(private),
            tuple(int(p) for p in ports.split(",")),
        )

    def sockets(self) -> list[socket.socket]:
        """The inherited listening sockets: the shared ones, then this worker's own."""
        return [socket.socket(fileno=fd) for fd in (*self.public_fds, self.private_fd)]

    @property
    def port(self) -> int:
        """This worker's own loopback port."""
        return self.ports[self.index]


def worker_spec(environ: dict[str, str] | os._Environ[str] = os.environ) -> WorkerSpec | None:
    raw = environ.get(WORKER_ENV)
    return WorkerSpec.decode(raw) if raw else None


def bind_public(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names, as asyncio's ``create_server``
    binds them (a name such as ``localhost`` may be IPv4 and IPv6)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, type_, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            if port == 0:  # one port for every address, as create_server does
                port = sock.getsockname()[1]
        for sock in sockets:
            sock.listen(BACKLOG)
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_loopback() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Supervisor:
    """Starts the workers, restarts the ones that die, stops them all when told."""

    def __init__(
        self, argv: Sequence[str], workers: int, public: list[socket.socket], *, tls: bool
    ) -> None:
        self.argv = list(argv)
        self.public = public
        self.private = [bind_loopback() for _ in range(workers)]
        self.ports = tuple(s.getsockname()[1] for s in self.private)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * workers
        self.up = [False] * workers  # answered /health since it was last started
        self.served = [False] * workers  # answered /health once, in any of its lives
        self.deaths: list[list[float]] = [[] for _ in range(workers)]  # within the window
        self.due: dict[int, float] = {}  # worker -> when it is restarted
        self.stopping = False
        self.exit_code = 0
        self.tls = tls
        self.clock = time.monotonic

    def spec(self, index: int) -> WorkerSpec:
        return WorkerSpec(
            index,
            tuple(s.fileno() for s in self.public),
            self.private[index].fileno(),
            self.ports,
        )

    def spawn(self, index: int) -> None:
        spec = self.spec(index)
        env = {**os.environ, WORKER_ENV: spec.encode()}
        self.procs[index] = subprocess.Popen(
            [sys.executable, "-m", "prefixgate", "gateway", *self.argv],
            env=env,
            pass_fds=(*spec.public_fds, spec.private_fd),
            # Its own process group: a terminal's Ctrl-C reaches the parent only, which
            # passes on one SIGTERM (two signals make uvicorn drop its connections).
            start_new_session=True,
            preexec_fn=_die_with_parent,  # safe: the parent runs no threads
        )
        self.up[index] = False

    def signal_all(self, signum: int) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # SIGHUP too: it ends a one-process gateway (its default action), and forwarded
        # it would end each worker only for the parent to restart it.
        if self.stopping:  # a second request to stop: stop now
            self.signal_all(signal.SIGKILL)
            return
        self.stopping = True
        self.signal_all(signal.SIGTERM)

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        for index in range(len(self.procs)):
            self.spawn(index)
        log.info(
            "gateway: %d workers, pids %s, on %s",
            len(self.procs),
            [p.pid for p in self.procs if p is not None],
            ", ".join(_address(s) for s in self.public),
        )
        try:
            while not (self.stopping and all(p is None for p in self.procs)):
                time.sleep(_POLL_S)
                if self.stopping:
                    self.due.clear()
                for index, at in list(self.due.items()):
                    if at <= self.clock():
                        del self.due[index]
                        self.spawn(index)
                for index, proc in enumerate(self.procs):
                    if proc is None:
                        continue
                    if proc.poll() is not None:
                        self._exited(index, proc.returncode)
                    elif not self.up[index] and self._answers(index):
                        self.up[index] = self.served[index] = True
        finally:
            for sock in (*self.public, *self.private):
                sock.close()
        return self.exit_code

    def _answers(self, index: int) -> bool:
        """Whether the worker serves: its ``/health`` answers on its own port (the port
        accepts connections as soon as the parent binds it, so a connection says nothing)."""
        import urllib.request  # the parent's only HTTP: kept off the workers' start-up

        scheme = "https" if self.tls else "http"
        url = f"{scheme}://127.0.0.1:{self.ports[index]}/health"
        context = ssl._create_unverified_context() if self.tls else None  # loopback, ours
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )
        try:
            with opener.open(url, timeout=_POLL_S) as resp:
                return bool(resp.status == 200)
        except (OSError, ValueError):
            return False

    def _exited(self, index: int, code: int) -> None:
        self.procs[index] = None
        if self.stopping:
            self.exit_code = self.exit_code or (code if code > 0 else 0)
            return
        if not self.served[index]:
            log.error(
                "gateway worker %d exited (status %d) before it served (a restart would "
                "fail the same way): stopping",
                index,
                code,
            )
            self.exit_code = 1
            self.stopping = True
            self.signal_all(signal.SIGTERM)
            return
        now = self.clock()
        deaths = [t for t in self.deaths[index] if now - t < RESTART_WINDOW_S] + [now]
        self.deaths[index] = deaths
        wait = (
            0.0
            if len(deaths) == 1
            else min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (len(deaths) - 2))
        )
        when = f" in {wait:g} s ({len(deaths)} exits in {RESTART_WINDOW_S:g} s)" if wait else ""
        log.error("gateway worker %d exited (status %d): restarting it%s", index, code, when)
        self.due[index] = now + wait


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---- /metrics across workers ----------------------------------------------------------


def merged_metrics(texts: Iterable[tuple[int, str]]) -> bytes:
    """One Prometheus exposition from each worker's own (index, text): every sample gains
    a ``worker`` label; each family is written once, with its samples from every worker."""
    from prometheus_client.core import Metric
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for index, text in texts:
        worker = str(index)
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as exc:  # never seen: left out, as a worker that did not answer
            log.warning("gateway worker %d's metrics do not parse (%s): left out", index, exc)
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            for sample in family.samples:
                labels = {**sample.labels, "worker": worker}
                merged.samples.append(sample._replace(labels=labels))

    class _Merged:
        def collect(self) -> Iterable[Metric]:
            return families.values()

    return generate_latest(_Merged())  # type: ignore[arg-type]


class MergedMetrics:
    """``/metrics`` on the shared address: this worker's series and every other worker's,
    asked on its loopback port, merged (``merged_metrics``).

    A merge costs about nine times one worker's own scrape (5.8 against 0.67 ms of CPU,
    two workers, measured), and ``/metrics`` needs no key: a client asking in a loop
    would spend the workers' cores on it. So a merge is reused for ``max_age_s``, a
    scraper's interval being 15 s or more, and concurrent asks wait for the one merge
    being made. A worker that does not answer (being restarted) is left out of it."""

    def __init__(
        self,
        index: int,
        ports: Sequence[int],
        *,
        tls: bool,
        max_age_s: float = 1.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.ports = tuple(ports)
        self.tls = tls
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.merges = 0
        self._body: bytes | None = None
        self._at = 0.0
        self._lock: asyncio.Lock | None = None
        self._client: httpx.AsyncClient | None = None

    async def get(self, own: Callable[[], bytes]) -> bytes:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._body is None or self.clock() - self._at >= self.max_age_s:
                self._body = await self._merge(own())
                self._at = self.clock()
                self.merges += 1
            return self._body

    async def _merge(self, own: bytes) -> bytes:
        if self._client is None:
            # Loopback ports the parent bound and holds: nothing else can answer there,
            # and the served certificate names the public host, not 127.0.0.1.
            self._client = httpx.AsyncClient(verify=False, timeout=self.timeout_s, trust_env=False)
        client = self._client
        scheme = "https" if self.tls else "http"

        async def ask(port: int) -> str | None:
            try:
                resp = await client.get(f"{scheme}://127.0.0.1:{port}/metrics")
            except httpx.HTTPError as exc:
                log.debug("gateway worker on port %d gave no metrics: %r", port, exc)
                return None
            return resp.text if resp.status_code == 200 else None

        others = [i for i in range(len(self.ports)) if i != self.index]
        texts = await asyncio.gather(*(ask(self.ports[i]) for i in others))
        found = [(i, t) for i, t in zip(others, texts, strict=True) if t is not None]
        return merged_metrics(sorted([(self.index, own.decode()), *found]))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
