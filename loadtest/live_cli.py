"""``prefixgate bench live``: the live experiment's command-line options."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from types import FrameType

from loadtest.external_router import PYTHON_ENV, parse_spec
from loadtest.live import DEFAULT_POLICIES, DEFAULT_WORKLOADS, LiveConfig, run_live


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated")
    p.add_argument(
        "--workloads",
        default=DEFAULT_WORKLOADS,
        help="comma-separated: kinds of loadtest.workloads, or skewed_docs (single-turn "
        "documents sent without conversation ids)",
    )
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    p.add_argument("--concurrency", type=int, default=8, help="concurrent sessions")
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=1 / 3,
        help="each replica's KV cache as a fraction of the distinct prefix blocks",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="replays of every workload per policy, interleaved and pooled",
    )
    p.add_argument("--run-root", type=Path, default=Path("runs/live"), help="cluster logs")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--router-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a router threshold for the clusters' gateways (repeatable)",
    )
    p.add_argument(
        "--external-router",
        action="append",
        default=[],
        metavar="KIND:POLICY",
        help="another router as a comparison row, e.g. sglang:cache_aware (repeatable; "
        "run inside a loopback-only network namespace, see loadtest/external_router.py)",
    )
    p.add_argument(
        "--sglang-python",
        default=None,
        help=f"the Python with sglang-router installed (default: ${PYTHON_ENV}); "
        "without one, sglang rows are skipped",
    )
    p.add_argument(
        "--shared-replicas",
        action="store_true",
        help="one set of replicas and Redis for every policy: the first policy's cluster "
        "plus one `prefixgate gateway` per other policy joined to it (one cluster per "
        "policy otherwise); the memory of one cluster, as at 64 replicas",
    )
    p.add_argument(
        "--scale",
        type=_positive_int,
        default=1,
        help="multiply each workload's sessions (agent types for agents; documents and "
        "requests for skewed_docs) "
        "by K, so that many replicas see a user's load; the cache stays --cache-fraction "
        "of the larger working set",
    )
    p.add_argument("--no-report", action="store_true", help="skip tables and plots")


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(args: argparse.Namespace) -> int:
    policies = [p for p in args.policies.split(",") if p]
    if not policies:
        raise SystemExit("--policies: name at least one prefixgate policy")
    for spec in args.external_router:
        try:
            parse_spec(spec)
        except ValueError as exc:
            raise SystemExit(f"--external-router: {exc}") from None
    cfg = LiveConfig(
        replicas=args.replicas,
        model=args.model,
        policies=policies,
        workloads=[w for w in args.workloads.split(",") if w],
        out_dir=args.out_dir,
        concurrency=args.concurrency,
        fraction=args.cache_fraction,
        seed=args.seed,
        ready_timeout_s=args.ready_timeout_s,
        run_root=args.run_root,
        router_options=args.router_option,
        repeats=args.repeats,
        external_routers=args.external_router,
        sglang_python=args.sglang_python,
        shared_replicas=args.shared_replicas,
        scale=args.scale,
    )
    # SIGTERM unwinds like Ctrl-C, so that the clusters and gateways are stopped (and a
    # stopped gateway resumed) on the way out instead of being left behind.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    path = run_live(cfg)
    if not args.no_report:
        from loadtest.report import load, write_report

        sim = cfg.out_dir / "simulate.json"
        inputs = [path, *([sim] if sim.is_file() else [])]
        for p in write_report(load(inputs), cfg.out_dir):
            print(p)
    return 0
