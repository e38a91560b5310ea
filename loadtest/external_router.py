"""Another project's router as a comparison row of the live experiment.

``--external-router sglang:cache_aware`` adds a row named ``sglang:cache_aware``:
sglang-router (PyPI ``sglang-router``, its HTTP mode, every setting at its default but
the addresses) in front of the replicas of the experiment's first prefixgate cluster,
replaying the same workloads in the same interleaved rounds. sglang-router is no
dependency of this project: it runs from its own Python (a separate virtual
environment), named by ``--sglang-python`` or ``PREFIXGATE_SGLANG_PYTHON``; when that
Python cannot import ``sglang_router`` the rows are skipped with a message.

It tries to reach the internet, so its rows run only inside a loopback-only network
namespace (replicas, Redis, gateways, routers and the load client all in it)::

    unshare -rn sh -c 'ip link set lo up && HF_HUB_OFFLINE=1 prefixgate bench live ...'

Each cell starts from empty caches, as for prefixgate's rows: the host cluster's gateway
empties every replica's prefix cache, and the router process is restarted, so its own
view of what each replica holds starts empty too. sglang-router names no replica in its
responses; a row's requests per replica come from the replicas' own count of finished
requests (``prefixgate:request_success_total`` on ``/metrics``) since the cell's reset,
and its hit rate, like every row's, from the replicas'
``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from loadtest.cluster import Cluster
from loadtest.replay import load_balance
from prefixgate.procs import ChildDied, free_port, stop_process

PYTHON_ENV = "PREFIXGATE_SGLANG_PYTHON"
# router kind -> its policies a row may name (sglang-router 0.3's --policy choices that
# need no extra configuration).
POLICIES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"sglang": ("cache_aware", "round_robin", "random", "power_of_two")}
)
READY_POLL_S = 0.1
FINISHED_METRIC = "prefixgate:request_success_total"
SERVED = "requests_served"  # the field cache_stats() adds: finished since the reset


class RouterSpec(NamedTuple):
    """One external row: which router, with which of its policies."""

    kind: str
    policy: str

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.policy}"


def parse_spec(text: str) -> RouterSpec:
    """``sglang:cache_aware`` → RouterSpec; a clear ValueError for anything else."""
    kind, sep, policy = text.partition(":")
    if not sep or kind not in POLICIES or policy not in POLICIES[kind]:
        choices = [f"{k}:{p}" for k, ps in POLICIES.items() for p in ps]
        raise ValueError(f"unknown external router {text!r}; choose one of {choices}")
    return RouterSpec(kind, policy)


def router_command(
    python: str, spec: RouterSpec, worker_urls: Sequence[str], port: int, metrics_port: int
) -> list[str]:
    """sglang-router's command line: the policy and addresses, nothing else changed."""
    return [
        python,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--policy",
        spec.policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # Its Prometheus server binds 0.0.0.0:29000 by default: two routers would clash.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    ]


def find_python(explicit: str | None) -> tuple[str | None, str]:
    """The Python that runs sglang-router (``explicit``, else ``$PREFIXGATE_SGLANG_PYTHON``)
    and, when there is none usable, why not."""
    python = explicit or os.environ.get(PYTHON_ENV) or None
    if python is None:
        return None, f"no sglang-router Python: pass --sglang-python or set {PYTHON_ENV}"
    try:
        probe = subprocess.run(
            [python, "-c", "import sglang_router"], capture_output=True, timeout=60
        )
    except OSError as exc:
        return None, f"sglang-router Python {python!r} cannot run: {exc}"
    if probe.returncode != 0:
        return None, f"{python!r} cannot import sglang_router (pip install sglang-router there)"
    return python, ""


def loopback_only(net_dev: Path = Path("/proc/self/net/dev")) -> bool:
    """Whether this process's network namespace has no interface but loopback (from
    /proc, which follows the namespace; /sys/class/net shows the mounter's)."""
    lines = net_dev.read_text().splitlines()[2:]  # two header lines
    return [line.split(":", 1)[0].strip() for line in lines] == ["lo"]


def skip_reason(python: str | None, why_no_python: str) -> str | None:
    """Why external rows cannot run here, or None when they can."""
    if python is None:
        return why_no_python
    if not loopback_only():
        return (
            "not in a loopback-only network namespace (sglang-router tries to reach the "
            "internet): run under `unshare -rn sh -c 'ip link set lo up && ...'`"
        )
    return None


@dataclass(slots=True)
class ExternalRouter:
    """A router process in front of ``host``'s replicas; restarted for every cell."""

    spec: RouterSpec
    python: str
    host: Cluster
    log_path: Path
    port: int
    ready_timeout_s: float
    proc: subprocess.Popen[bytes] | None = None
    finished_at_reset: dict[str, float] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        urls = list(self.host.replica_urls().values())
        cmd = router_command(self.python, self.spec, urls, self.port, free_port())
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.wait_ready(urls)

    def wait_ready(self, urls: Sequence[str]) -> None:
        """Poll ``GET /workers`` until every replica is registered there as healthy."""
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while not registered(self.workers(), urls):
            if self.proc.poll() is not None:
                raise ChildDied(f"{self.spec.name} exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.name} not ready; see {self.log_path}")
            time.sleep(READY_POLL_S)  # polling interval

    def workers(self) -> Any:
        try:
            url = f"http://127.0.0.1:{self.port}/workers"
            with urllib.request.urlopen(url, timeout=5) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=10.0)
            self.proc = None

    # What a cell needs of its target, as ``loadtest.cluster.Cluster`` offers it.

    def reset_prefix_cache(self) -> None:
        """Empty every replica's cache, and restart the router with no view of them."""
        self.stop()
        self.host.reset_prefix_cache()
        self.finished_at_reset = self.finished()
        self.start()

    def cache_stats(self) -> dict[str, dict[str, Any]]:
        """The replicas' /cache/stats, each with the requests it finished since the
        last reset (``SERVED``)."""
        stats = self.host.cache_stats()
        for name, count in self.finished().items():
            served = count - self.finished_at_reset.get(name, 0.0)
            stats[name][SERVED] = round(served)
        return stats

    def finished(self) -> dict[str, float]:
        """Every replica's finished requests so far, from its /metrics."""
        out = {}
        for name, url in self.host.replica_urls().items():
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
                out[name] = finished_requests(resp.read().decode())
        return out

    def replica_cpu_seconds(self) -> float | None:
        return self.host.replica_cpu_seconds()

    def names_by_address(self) -> dict[str, str]:
        return self.host.names_by_address()


def registered(answer: Any, urls: Sequence[str]) -> bool:
    """Whether sglang-router's ``/workers`` answer lists every URL as healthy."""
    if not isinstance(answer, dict):
        return False
    healthy = {w.get("url") for w in answer.get("workers", []) if w.get("is_healthy")}
    return set(urls) <= healthy


def finished_requests(metrics_text: str) -> float:
    """The sum of ``prefixgate:request_success_total`` over its labels."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(FINISHED_METRIC + "{") or line.startswith(FINISHED_METRIC + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def counts_from_stats(cell: dict[str, Any]) -> None:
    """For a cell whose responses named no replica: requests per replica (and max/mean)
    from what the replicas say they served (``SERVED`` in ``cell["cache_stats"]``); like
    the counts from response headers, only replicas that served appear."""
    summary = cell["summary"]
    stats = cell["cache_stats"]
    if summary.get("requests_per_replica") or not all(SERVED in s for s in stats.values()):
        return
    counts = {name: int(s[SERVED]) for name, s in sorted(stats.items()) if s[SERVED] > 0}
    summary["requests_per_replica"] = counts
    summary["load_max_over_mean"] = load_balance(counts)


def pool_counts(runs: Sequence[dict[str, Any]], cells: Sequence[dict[str, Any]]) -> None:
    """``counts_from_stats`` for pooled runs: the counts summed over the run's cells,
    max/mean as their median and worst (as ``loadtest.pooling`` does)."""
    for run in runs:
        summary = run["summary"]
        if summary.get("requests_per_replica"):
            continue
        meta = run["meta"]
        mine = [
            c["summary"]
            for c in cells
            if (c["meta"]["experiment"], c["meta"]["policy"])
            == (meta["experiment"], meta["policy"])
            and c["summary"].get("requests_per_replica")
        ]
        if not mine:
            continue
        counts: dict[str, int] = {}
        for s in mine:
            for name, n in s["requests_per_replica"].items():
                counts[name] = counts.get(name, 0) + n
        loads = [s["load_max_over_mean"] for s in mine if s["load_max_over_mean"] is not None]
        summary["requests_per_replica"] = counts
        summary["load_max_over_mean"] = statistics.median(loads) if loads else None
        summary["load_max_over_mean_worst"] = max(loads) if loads else None


def start_routers(
    specs: Sequence[str],
    python_flag: str | None,
    host: Cluster,
    run_root: Path,
    ready_timeout_s: float,
) -> tuple[dict[str, ExternalRouter], str | None]:
    """One started router per spec, all in front of ``host``'s replicas; or none and the
    reason they are skipped (printed, and kept in the results)."""
    parsed = [parse_spec(s) for s in specs]
    if not parsed:
        return {}, None
    python, why = find_python(python_flag)
    reason = skip_reason(python, why)
    if reason is not None:
        print(f"[live] external routers {list(specs)} skipped: {reason}", flush=True)
        return {}, reason
    assert python is not None
    run_root.mkdir(parents=True, exist_ok=True)
    routers: dict[str, ExternalRouter] = {}
    try:
        for spec in parsed:
            log = run_root / f"{spec.kind}-{spec.policy}.log"
            router = ExternalRouter(spec, python, host, log, free_port(), ready_timeout_s)
            routers[spec.name] = router
            router.start()
    except BaseException:
        for router in routers.values():
            router.stop()
        raise
    return routers, None


def versus_external(
    runs: Sequence[dict[str, Any]], cells: Sequence[dict[str, Any]] = ()
) -> dict[str, dict[str, Any]]:
    """Per experiment and external row: prefixgate cache_aware's total time and TTFT p50
    over that row's (pooled), whether its total time is at most the row's, and in how
    many repeats it was."""
    rows = {name for kind, ps in POLICIES.items() for name in (f"{kind}:{p}" for p in ps)}
    by_exp: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_exp.setdefault(run["meta"]["experiment"], {})[run["meta"]["policy"]] = run["summary"]
    per_repeat: dict[tuple[str, int], dict[str, float]] = {}
    for cell in cells:
        key = (cell["meta"]["experiment"], cell["meta"].get("repeat", 0))
        per_repeat.setdefault(key, {})[cell["meta"]["policy"]] = cell["summary"]["total_time_s"]
    out: dict[str, dict[str, Any]] = {}
    for exp, policies in by_exp.items():
        ca = policies.get("cache_aware")
        if ca is None:
            continue
        for row in sorted(rows & policies.keys()):
            ext = policies[row]
            rounds = [t for (e, _), t in sorted(per_repeat.items()) if e == exp]
            paired = [t for t in rounds if "cache_aware" in t and row in t]
            wins = sum(t["cache_aware"] <= t[row] for t in paired)
            out.setdefault(exp, {})[row] = {
                "total_time_s": [ca["total_time_s"], ext["total_time_s"]],
                "total_time_ratio": _ratio(ca["total_time_s"], ext["total_time_s"]),
                "ttft_p50_ratio": _ratio(ca["ttft_p50_s"], ext["ttft_p50_s"]),
                "hit_rate": [ca["hit_rate"], ext["hit_rate"]],
                "total_time_target_met": ca["total_time_s"] <= ext["total_time_s"],
                "total_time_met_in_repeats": f"{wins}/{len(paired)}",
            }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
