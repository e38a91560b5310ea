"""TTFT p50 and hit rate against the number of replicas, per policy and workload, from
``prefixgate bench live`` results on sim replicas (one ``live.json`` per cluster size),
with the simulated oracle's hit rate beside them. Each size's workload scale (``--scale
K``: K times the sessions) is written under its tick, so that a reader sees whether
the sizes had the same load per replica.

    python benchmarks/sim_scale_plot.py docs/bench/sglang-compare/sim-4/live.json \\
        docs/bench/sim-scaled/sim-16/live.json docs/bench/sim-scaled/sim-64/live.json \\
        --out docs/bench/sim-scale-64.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter

from loadtest.report import POLICY_COLORS

TTFT_TICKS_MS = (100, 150, 200, 300, 500, 700, 1000, 2000, 3000, 5000, 10000, 20000)


@dataclass(slots=True)
class Points:
    """What the plot draws, read from the inputs."""

    # (workload, policy) -> [(replicas, ttft p50 s, hit rate)]
    runs: dict[tuple[str, str], list[tuple[int, float, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    oracle: dict[str, list[tuple[int, float]]] = field(  # workload -> (replicas, hit rate)
        default_factory=lambda: defaultdict(list)
    )
    ticks: dict[int, str] = field(default_factory=dict)  # replicas -> tick label

    def add(self, data: dict[str, Any], source: Path) -> None:
        config = data["config"]
        replicas = int(config["replicas"])
        if replicas in self.ticks:
            raise SystemExit(f"{source}: a second input with {replicas} replicas")
        scale = int(config.get("scale", 1))
        requests = [int(r["summary"]["requests"]) for r in data["runs"]]
        repeats = max(1, int(config.get("repeats", 1)))
        per_replica = max(requests) / repeats / replicas if requests else 0
        self.ticks[replicas] = f"{replicas}\n×{scale}, {per_replica:.0f} req/replica"
        workload_of = {}
        for run in data["runs"]:
            meta, summary = run["meta"], run["summary"]
            workload_of[meta["experiment"]] = meta["workload"]
            point = (replicas, summary["ttft_p50_s"], summary["hit_rate"])
            self.runs[(meta["workload"], meta["policy"])].append(point)
        for exp, oracle in data.get("oracle", {}).items():
            if exp in workload_of and oracle.get("hit_rate") is not None:
                self.oracle[workload_of[exp]].append((replicas, oracle["hit_rate"]))


def plot(points: Points, out: Path) -> None:
    workloads = sorted({w for w, _ in points.runs})
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7.5), squeeze=False)
    for col, workload in enumerate(workloads):
        for (w, policy), series in sorted(points.runs.items()):
            if w != workload:
                continue
            series.sort()
            xs = [n for n, _, _ in series]
            style = "--" if ":" in policy else "-"  # another project's router: dashed
            ttft = [1e3 * t if t is not None else float("nan") for _, t, _ in series]
            color = POLICY_COLORS.get(policy)  # the report's colours, learned once
            axes[0][col].plot(xs, ttft, style, marker="o", color=color, label=policy)
            hits = [h for _, _, h in series]
            axes[1][col].plot(xs, hits, style, marker="o", color=color, label=policy)
        oracle = sorted(points.oracle.get(workload, []))
        if oracle:
            axes[1][col].plot(
                [n for n, _ in oracle], [h for _, h in oracle], ":", color="black", label="oracle"
            )
        axes[0][col].set_yscale("log")  # a crowded row can be 30x the others
        drawn = [
            1e3 * t for (w, _), pts in points.runs.items() if w == workload for _, t, _ in pts if t
        ]
        ticks = [t for t in TTFT_TICKS_MS if min(drawn) / 1.2 <= t <= max(drawn) * 1.2]
        axes[0][col].set_yticks(ticks, [f"{t:g}" for t in ticks])
        axes[0][col].yaxis.set_minor_formatter(NullFormatter())
        axes[0][col].set_title(f"{workload}: TTFT p50 (ms, log scale)")
        axes[1][col].set_title(f"{workload}: hit rate")
        for row in axes:
            row[col].set_xscale("log", base=2)
            row[col].set_xticks(
                sorted(points.ticks), [points.ticks[n] for n in sorted(points.ticks)]
            )
            row[col].minorticks_off()
            row[col].set_xlabel("replicas (workload scale, requests per replica)")
            row[col].grid(alpha=0.3)
    axes[1][0].legend(fontsize="small")
    fig.suptitle("live on sim replicas (A100 profile x10)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    points = Points()
    for path in args.inputs:
        points.add(json.loads(path.read_text()), path)
    plot(points, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
