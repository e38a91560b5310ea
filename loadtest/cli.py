"""``prefixgate bench``: generate workloads, replay them, simulate clusters, report.

    prefixgate bench gen KIND --out FILE.jsonl [--seed S] [--PARAM VALUE ...]
    prefixgate bench run --base-url URL --workload FILE [--concurrency N | --rate R] ...
    prefixgate bench simulate --workload FILE ... --out sim.json
    prefixgate bench report RESULTS.json ... --out-dir docs/bench
    prefixgate bench live --replicas 4 --model tiny-random --policies ... --out-dir DIR

Each subcommand imports only what it needs, so ``gen`` and ``report`` stay quick.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def parse_value(text: str) -> int | float | str:
    """A kind parameter from the command line: int, else float, else the string."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_params(extra: list[str]) -> dict[str, Any]:
    """``--num-sessions 20 --turns=3`` → ``{"num_sessions": 20, "turns": 3}``."""
    params: dict[str, Any] = {}
    i = 0
    while i < len(extra):
        item = extra[i]
        if not item.startswith("--") or item == "--":
            raise ValueError(f"expected --name value, got {item!r}")
        name, eq, value = item[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra):
                raise ValueError(f"{item} needs a value")
            i += 1
            value = extra[i]
        params[name.replace("-", "_")] = parse_value(value)
        i += 1
    return params


# ----------------------------------------------------------------------------- gen


def cmd_gen(args: argparse.Namespace, extra: list[str]) -> int:
    from loadtest import workloads

    try:
        params = parse_params(extra)
    except ValueError as exc:
        print(f"prefixgate bench gen: {exc}", file=sys.stderr)
        return 2
    try:
        sessions = workloads.generate(args.kind, seed=args.seed, **params)
    except (TypeError, ValueError, KeyError) as exc:
        print(f"prefixgate bench gen {args.kind}: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    workloads.save_jsonl(sessions, args.out)
    turns = sum(len(s.turns) for s in sessions)
    print(f"wrote {len(sessions)} sessions, {turns} requests of {args.kind!r} to {args.out}")
    return 0


def _gen_epilog() -> str:
    try:
        from loadtest import workloads
    except ImportError:
        return ""
    lines = ["kinds and their parameters (pass as --name value):"]
    for kind, fn in sorted(getattr(workloads, "_GENERATORS", {}).items()):
        names = [
            f"{p.name}={p.default!r}"
            for p in inspect.signature(fn).parameters.values()
            if p.default is not inspect.Parameter.empty and p.name != "seed"
        ]
        lines.append(f"  {kind}: {', '.join(names)}")
    return "\n".join(lines) if len(lines) > 1 else ""


# ----------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    from loadtest.replay import ReplayConfig, run_replay, write_result
    from loadtest.workloads import load_jsonl

    sessions = load_jsonl(args.workload)
    config = ReplayConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        concurrency=args.concurrency,
        rate=args.rate,
        max_sessions=args.max_sessions,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout_s,
        progress=not args.no_progress,
    )
    result = run_replay(sessions, config)
    meta = {"workload": args.workload.stem, "policy": args.label or args.base_url}
    if args.experiment:
        meta["experiment"] = args.experiment
    write_result(result, args.out, meta)
    print_summary(result.summary())
    print(f"results in {args.out}")
    return 1 if result.summary()["errors"] == len(result.requests) and result.requests else 0


def print_summary(s: dict[str, Any]) -> None:
    def ms(v: float | None) -> str:
        return "—" if v is None else f"{v * 1000:.1f} ms"

    hit = "—" if s["hit_rate"] is None else f"{s['hit_rate']:.3f}"
    tps = "—" if s["output_tokens_per_s"] is None else f"{s['output_tokens_per_s']:.1f}"
    print(f"requests {s['requests']} ({s['errors']} errors) in {s['total_time_s']:.2f} s")
    print(f"hit rate {hit}  (cached {s['cached_tokens']} / prompt {s['prompt_tokens']} tokens)")
    print(f"TTFT p50 {ms(s['ttft_p50_s'])}  p99 {ms(s['ttft_p99_s'])}  output tok/s {tps}")
    if s["requests_per_replica"]:
        print(f"requests per replica {s['requests_per_replica']}")
    for message, count in s["error_counts"].items():
        print(f"  {count}× {message}")


# -------------------------------------------------------------------------- report


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from loadtest.report import load, write_report

    missing = [p for p in args.results if not p.is_file()]
    if missing:
        print(f"prefixgate bench report: no such file: {missing[0]}", file=sys.stderr)
        return 2
    paths = write_report(load(args.results), args.out_dir)
    for p in paths:
        print(p)
    return 0


# ------------------------------------------------------------------------- simulate


SIM_POLICIES = "cache_aware,round_robin,consistent_hash,least_loaded"
MIN_SIM_BLOCKS = 64


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--workload",
        type=Path,
        action="append",
        default=None,
        help="JSONL from `bench gen` (repeatable)",
    )
    src.add_argument(
        "--kinds",
        default=None,
        help="comma-separated kinds to generate (default agents,multi_turn_chat)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=SIM_POLICIES, help="comma-separated")
    p.add_argument("--replicas", default="8,16,64", help="comma-separated replica counts")
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=1 / 3,
        help="each replica's cache as a fraction of the distinct prefix blocks",
    )
    p.add_argument(
        "--blocks-per-replica",
        type=int,
        default=None,
        help="fixed cache size per replica (instead of --cache-fraction)",
    )
    p.add_argument(
        "--sweep",
        default="0.05,0.1,0.2,0.33,0.5,1.0",
        help="cache fractions for the capacity sweep ('' to skip)",
    )
    p.add_argument("--sweep-replicas", type=int, default=8)
    p.epilog = "Other --name value options go to the workload generator (see `bench gen -h`)."
    p.add_argument("--out", type=Path, default=Path("docs/bench/simulate.json"))


def _csv(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def sim_row(result: Any) -> dict[str, Any]:
    """A ``simulate.SimResult`` in the report's field names."""
    return {
        "policy": result.policy,
        "requests": result.requests,
        "hit_rate": result.hit_rate,
        "ttft_p50_s": result.ttft_p50_s,
        "ttft_p99_s": result.ttft_p99_s,
        "total_time_s": result.total_time_s,
        "load_max_over_mean": result.load_imbalance,
        "requests_per_replica": {
            f"replica-{i}": n for i, n in enumerate(result.requests_per_replica)
        },
        "decisions": result.decisions,
    }


def cmd_simulate(args: argparse.Namespace, extra: list[str]) -> int:
    """Policies × replica counts on each workload, and a cache-capacity sweep, to JSON."""
    import json
    import time

    from loadtest import simulate, workloads

    params = parse_params(extra)
    if args.workload:
        named = [(p.stem, workloads.load_jsonl(p)) for p in args.workload]
    else:
        kinds = _csv(args.kinds or "agents,multi_turn_chat")
        named = [(k, workloads.generate(k, seed=args.seed, **params)) for k in kinds]
    policies = _csv(args.policies)
    experiments, sweeps = [], []
    for name, sessions in named:
        working_set = simulate.working_set_blocks(sessions)
        # The simulator's own floor: smaller caches cannot hold one long request.
        blocks = args.blocks_per_replica or max(
            MIN_SIM_BLOCKS, round(working_set * args.cache_fraction)
        )
        n_requests = sum(len(s.turns) for s in sessions)
        for n in (int(x) for x in _csv(args.replicas)):
            started = time.monotonic()
            results = simulate.run_comparison(
                sessions, policies, n_replicas=n, blocks_per_replica=blocks, seed=args.seed
            )
            experiments.append(
                {
                    "name": f"sim: {name}, {n} replicas",
                    "rows": [sim_row(r) for r in results],
                    "note": f"{len(sessions)} sessions, {n_requests} requests; {blocks} blocks "
                    f"per replica = {blocks / working_set:.2f} of the {working_set}-block "
                    "working set; oracle = one replica with N× blocks and compute.",
                }
            )
            print(
                f"simulated {name} on {n} replicas in {time.monotonic() - started:.1f} s",
                flush=True,
            )
        sweep_rows = []
        for fraction in (float(x) for x in _csv(args.sweep)):
            size = max(MIN_SIM_BLOCKS, round(working_set * fraction))
            for r in simulate.run_comparison(
                sessions,
                policies,
                n_replicas=args.sweep_replicas,
                blocks_per_replica=size,
                seed=args.seed,
            ):
                sweep_rows.append(
                    {"policy": r.policy, "blocks_per_replica": size, "hit_rate": r.hit_rate}
                )
        if sweep_rows:
            sweeps.append({"name": f"{name}, {args.sweep_replicas} replicas", "rows": sweep_rows})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {"kind": "simulation", "experiments": experiments, "capacity_sweep": sweeps}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"results in {args.out}")
    return 0


def cmd_live(args: argparse.Namespace, extra: list[str]) -> int:
    from loadtest.live_cli import main as live_main

    return live_main(args)


# ------------------------------------------------------------------------- parsing


Command = Callable[[argparse.Namespace, list[str]], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixgate bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "gen",
        help="generate a workload as JSONL",
        epilog=_gen_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("kind", help="workload kind, e.g. agents, multi_turn_chat")
    gen.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_gen, allow_extra=True)

    run = sub.add_parser("run", help="replay a workload against an OpenAI base_url")
    run.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    run.add_argument("--workload", type=Path, required=True, help="JSONL from `bench gen`")
    run.add_argument("--model", default="tiny-random", help="model name sent in requests")
    loop = run.add_mutually_exclusive_group()
    loop.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop: N sessions at a time (default 1)",
    )
    loop.add_argument(
        "--rate", type=float, default=None, help="open loop: Poisson session arrivals per second"
    )
    run.add_argument("--api-key", default="EMPTY")
    run.add_argument("--out", type=Path, default=Path("results.json"))
    run.add_argument("--max-sessions", type=int, default=None)
    run.add_argument("--seed", type=int, default=0, help="seeds the open-loop arrivals")
    run.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to generate exactly max_tokens (vLLM extension)",
    )
    run.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    run.add_argument("--label", default=None, help="name of this run in reports (a policy)")
    run.add_argument("--experiment", default=None, help="experiment name in reports")
    run.add_argument("--no-progress", action="store_true")
    run.set_defaults(func=cmd_run, allow_extra=False)

    report = sub.add_parser("report", help="Markdown tables and PNG plots from results")
    report.add_argument("results", type=Path, nargs="+")
    report.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    report.set_defaults(func=cmd_report, allow_extra=False)

    sim = sub.add_parser("simulate", help="compare routing policies on a simulated cluster")
    add_simulate_arguments(sim)
    sim.set_defaults(func=cmd_simulate, allow_extra=True)

    from loadtest.live_cli import add_arguments as live_arguments

    live = sub.add_parser("live", help="the headline experiment on real local clusters")
    live_arguments(live)
    live.set_defaults(func=cmd_live, allow_extra=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra and not args.allow_extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    func: Command = args.func
    return func(args, extra)


if __name__ == "__main__":
    sys.exit(main())
