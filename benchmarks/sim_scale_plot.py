"""TTFT p50 and hit rate against the number of replicas, per policy and workload, from
``prefixgate bench live`` results on sim replicas (one ``live.json`` per cluster size).

    python benchmarks/sim_scale_plot.py docs/bench/sim-4/live.json \\
        docs/bench/sim-16/live.json --out docs/bench/sim-scale.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    # (workload, policy) -> [(replicas, ttft p50 s, hit rate)]
    points: dict[tuple[str, str], list[tuple[int, float, float]]] = defaultdict(list)
    for path in args.inputs:
        data = json.loads(path.read_text())
        replicas = int(data["config"]["replicas"])
        for run in data["runs"]:
            meta, summary = run["meta"], run["summary"]
            key = (meta["workload"], meta["policy"])
            points[key].append((replicas, summary["ttft_p50_s"], summary["hit_rate"]))
    workloads = sorted({w for w, _ in points})
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7), squeeze=False)
    for col, workload in enumerate(workloads):
        for (w, policy), series in sorted(points.items()):
            if w != workload:
                continue
            series.sort()
            xs = [n for n, _, _ in series]
            axes[0][col].plot(xs, [1e3 * t for _, t, _ in series], marker="o", label=policy)
            axes[1][col].plot(xs, [h for _, _, h in series], marker="o", label=policy)
        axes[0][col].set_title(f"{workload}: TTFT p50 (ms)")
        axes[1][col].set_title(f"{workload}: hit rate")
        for row in axes:
            row[col].set_xscale("log", base=2)
            row[col].set_xlabel("replicas")
            row[col].grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle("live on sim replicas (A100 profile x10)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
