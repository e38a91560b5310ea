"""Markdown tables and PNG plots from replay, live and simulation result files.

Every input file is JSON with a ``kind``:

* ``replay``: one run of ``prefixgate bench run`` (``meta`` may name experiment/policy);
* ``live``: ``prefixgate bench live`` — ``runs`` (replay results with meta), ``oracle``;
* ``simulation``: ``prefixgate bench simulate`` — ``experiments`` (rows per policy) and
  ``capacity_sweep`` (hit rate per policy and cache size).

All of them become :class:`PolicyRun` rows grouped by experiment, so one table and one
set of plots serve live and simulated numbers alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator

ORACLE = "oracle"
PLAIN_NUMBER = FuncFormatter(lambda value, _pos: f"{value:g}")


@dataclass(slots=True)
class PolicyRun:
    """One policy's numbers in one experiment (a live run or a simulated one)."""

    experiment: str
    policy: str
    summary: dict[str, Any]
    ttfts_s: list[float] = field(default_factory=list)

    @property
    def requests_per_replica(self) -> dict[str, int]:
        return dict(self.summary.get("requests_per_replica") or {})


@dataclass(slots=True)
class Report:
    runs: list[PolicyRun] = field(default_factory=list)
    # experiment -> policy -> [(cache blocks per replica, hit rate)]
    capacity: dict[str, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # experiment -> one line of context

    def experiments(self) -> list[str]:
        return list(dict.fromkeys(r.experiment for r in self.runs))

    def runs_of(self, experiment: str) -> list[PolicyRun]:
        return [r for r in self.runs if r.experiment == experiment]


# ------------------------------------------------------------------------------ loading


def _replay_run(data: dict[str, Any], default_experiment: str) -> PolicyRun:
    meta = data.get("meta") or {}
    experiment = str(meta.get("experiment") or default_experiment)
    policy = str(meta.get("policy") or meta.get("label") or "run")
    ttfts = [r["ttft_s"] for r in data.get("requests", []) if r.get("ttft_s") is not None]
    summary = dict(data["summary"])
    if "cluster_hit_rate" in data:
        summary["cluster_hit_rate"] = data["cluster_hit_rate"]
    return PolicyRun(experiment, policy, summary, ttfts)


def add_file(report: Report, path: Path) -> None:
    data = json.loads(path.read_text())
    kind = data.get("kind")
    if kind == "replay":
        report.runs.append(_replay_run(data, path.stem))
    elif kind == "live":
        for run in data["runs"]:
            report.runs.append(_replay_run(run, path.stem))
        for experiment, oracle in (data.get("oracle") or {}).items():
            report.runs.append(PolicyRun(experiment, ORACLE, dict(oracle)))
        report.notes.update(data.get("notes") or {})
    elif kind == "simulation":
        for exp in data.get("experiments", []):
            for row in exp["rows"]:
                report.runs.append(PolicyRun(exp["name"], row["policy"], dict(row)))
            if exp.get("note"):
                report.notes[exp["name"]] = exp["note"]
        for sweep in data.get("capacity_sweep", []):
            curves = report.capacity.setdefault(sweep["name"], {})
            for row in sweep["rows"]:
                curves.setdefault(row["policy"], []).append(
                    (float(row["blocks_per_replica"]), float(row["hit_rate"]))
                )
    else:
        raise ValueError(f"{path}: unknown result kind {kind!r}")


def load(paths: Iterable[Path]) -> Report:
    report = Report()
    for p in paths:
        add_file(report, p)
    return report


# ------------------------------------------------------------------------------- tables


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    if value is None:
        return "—"
    return f"{value * scale:.{digits}f}"


COLUMNS: list[tuple[str, str, float, int]] = [
    # header, summary field, scale, digits
    ("hit rate", "hit_rate", 1.0, 3),
    ("TTFT p50 (ms)", "ttft_p50_s", 1000.0, 1),
    ("TTFT p99 (ms)", "ttft_p99_s", 1000.0, 1),
    ("output tok/s", "output_tokens_per_s", 1.0, 1),
    ("total time (s)", "total_time_s", 1.0, 2),
    ("requests", "requests", 1.0, 0),
    ("max/mean load", "load_max_over_mean", 1.0, 2),
    ("busy replicas", "busy_replicas_mean", 1.0, 2),
    ("replica CPU (s)", "replica_cpu_s", 1.0, 1),
    ("gateway CPU (s)", "gateway_cpu_s", 1.0, 1),
    ("idle gateways' CPU (s)", "other_gateways_cpu_s", 1.0, 1),
    ("errors", "errors", 1.0, 0),
]


def markdown_table(runs: Sequence[PolicyRun]) -> str:
    """One row per policy; a column only appears when some row has a value for it."""
    cols = [c for c in COLUMNS if any(r.summary.get(c[1]) is not None for r in runs)]
    lines = [
        "| policy | " + " | ".join(c[0] for c in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for r in runs:
        cells = [_fmt(r.summary.get(key), scale, digits) for _, key, scale, digits in cols]
        lines.append(f"| {r.policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(report: Report, plots: Sequence[Path] = ()) -> str:
    parts = ["# Routing comparison", ""]
    for exp in report.experiments():
        parts += [f"## {exp}", ""]
        if exp in report.notes:
            parts += [report.notes[exp], ""]
        parts += [markdown_table(report.runs_of(exp)), ""]
    for name, curves in report.capacity.items():
        parts += [f"## Hit rate against cache capacity: {name}", ""]
        sizes = sorted({x for pts in curves.values() for x, _ in pts})
        parts.append("| policy | " + " | ".join(f"{s:g} blocks" for s in sizes) + " |")
        parts.append("|---|" + "---:|" * len(sizes))
        for policy, pts in curves.items():
            by_size = dict(pts)
            parts.append(
                f"| {policy} | " + " | ".join(_fmt(by_size.get(s), 1.0, 3) for s in sizes) + " |"
            )
        parts.append("")
    if plots:
        parts += ["## Plots", ""]
        parts += [f"![{p.stem}]({p.name})" for p in plots]
        parts.append("")
    return "\n".join(parts)


# -------------------------------------------------------------------------------- plots

# One colour per policy across every plot, so a reader learns them once.
POLICY_COLORS = {
    "cache_aware": "tab:green",
    "round_robin": "tab:blue",
    "consistent_hash": "tab:orange",
    "least_loaded": "tab:purple",
    "random": "tab:brown",
    "sglang:cache_aware": "tab:red",
    "sglang:round_robin": "tab:cyan",
    ORACLE: "tab:gray",
}


def _color(policy: str) -> str | None:
    return POLICY_COLORS.get(policy)


def _policies(runs: Iterable[PolicyRun]) -> list[str]:
    return list(dict.fromkeys(r.policy for r in runs))


def _grouped_bars(
    report: Report, field_name: str, scale: float, ylabel: str, title: str, path: Path
) -> Path | None:
    """Bars of one summary field: a group per experiment, a bar per policy."""
    experiments = [
        e
        for e in report.experiments()
        if any(r.summary.get(field_name) is not None for r in report.runs_of(e))
    ]
    if not experiments:
        return None
    policies = _policies(r for r in report.runs if r.experiment in experiments)
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(experiments) + 3), 4.5))
    for i, policy in enumerate(policies):
        xs, ys = [], []
        for j, exp in enumerate(experiments):
            run = next((r for r in report.runs_of(exp) if r.policy == policy), None)
            if run is not None and run.summary.get(field_name) is not None:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(run.summary[field_name] * scale)
        bars = ax.bar(
            xs,
            ys,
            width,
            label=policy,
            color=_color(policy),
            hatch="//" if policy == ORACLE else None,
            edgecolor="white",
        )
        ax.bar_label(bars, fmt="%.2f" if scale == 1.0 else "%.0f", fontsize=7, padding=1)
    ax.set_xticks(range(len(experiments)), experiments, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, ncols=min(len(policies), 3))
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _subplots(n: int, width: float = 5.5, height: float = 4.0) -> tuple[Any, list[Any]]:
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def plot_ttft_cdf(report: Report, path: Path) -> Path | None:
    experiments = [e for e in report.experiments() if any(r.ttfts_s for r in report.runs_of(e))]
    if not experiments:
        return None
    fig, axes = _subplots(len(experiments))
    for ax, exp in zip(axes, experiments, strict=True):
        for run in report.runs_of(exp):
            if not run.ttfts_s:
                continue
            xs = sorted(t * 1000.0 for t in run.ttfts_s)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=run.policy, color=_color(run.policy))
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(PLAIN_NUMBER)  # "200", not "2×10²"
        # Labelled minor ticks at 2×, 3× and 5× each decade only: all eight overlap.
        ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 3.0, 5.0)))
        ax.xaxis.set_minor_formatter(PLAIN_NUMBER)
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.set_xlabel("time to first token (ms, log scale)")
        ax.set_ylabel("fraction of requests ≤ x")
        ax.set_title(f"TTFT CDF — {exp}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_requests_per_replica(report: Report, path: Path) -> Path | None:
    experiments = [
        e
        for e in report.experiments()
        if any(r.requests_per_replica and r.policy != ORACLE for r in report.runs_of(e))
    ]
    if not experiments:
        return None
    fig, axes = _subplots(len(experiments))
    for ax, exp in zip(axes, experiments, strict=True):
        runs = [r for r in report.runs_of(exp) if r.requests_per_replica and r.policy != ORACLE]
        replicas = sorted({k for r in runs for k in r.requests_per_replica}, key=_natural)
        if len(replicas) <= 16:
            width = 0.8 / len(runs)
            for i, run in enumerate(runs):
                xs = [j - 0.4 + width * (i + 0.5) for j in range(len(replicas))]
                ys = [run.requests_per_replica.get(k, 0) for k in replicas]
                ax.bar(xs, ys, width, label=run.policy, color=_color(run.policy))
            ax.set_xticks(range(len(replicas)), replicas, fontsize=7, rotation=30, ha="right")
            ax.set_xlabel("replica")
        else:  # too many replicas for bars: each policy's counts, busiest first
            for run in runs:
                ys = sorted(run.requests_per_replica.values(), reverse=True)
                ax.plot(range(len(ys)), ys, label=run.policy, color=_color(run.policy))
            ax.set_xlabel("replica rank (busiest first)")
        repeats = max(int(r.summary.get("repeats") or 1) for r in runs)
        ax.set_ylabel("requests served" + (f" (sum of {repeats} repeats)" if repeats > 1 else ""))
        ax.set_title(f"Requests per replica — {exp}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _natural(name: str) -> tuple[Any, ...]:
    """Sort key that puts replica-2 before replica-10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def plot_capacity(report: Report, path: Path) -> Path | None:
    if not report.capacity:
        return None
    fig, axes = _subplots(len(report.capacity))
    for ax, (name, curves) in zip(axes, report.capacity.items(), strict=True):
        for policy, pts in curves.items():
            pts = sorted(pts)
            ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                marker="o",
                label=policy,
                color=_color(policy),
                linestyle="--" if policy == ORACLE else "-",
            )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(PLAIN_NUMBER)
        ax.set_xlabel("KV cache per replica (blocks, log scale)")
        ax.set_ylabel("token hit rate (cached / prompt tokens)")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"Hit rate against cache capacity — {name}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(report: Report, out_dir: Path) -> list[Path]:
    """Write the PNGs and ``README.md`` (tables + plots) into ``out_dir``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [
        _grouped_bars(
            report,
            "hit_rate",
            1.0,
            "token hit rate (cached / prompt tokens)",
            "Prefix cache hit rate by policy",
            out_dir / "hit_rate.png",
        ),
        _grouped_bars(
            report,
            "ttft_p50_s",
            1000.0,
            "TTFT p50 (ms)",
            "Median time to first token by policy",
            out_dir / "ttft_p50.png",
        ),
        plot_ttft_cdf(report, out_dir / "ttft_cdf.png"),
        plot_requests_per_replica(report, out_dir / "requests_per_replica.png"),
        plot_capacity(report, out_dir / "hit_rate_vs_capacity.png"),
    ]
    plots = [p for p in made if p is not None]
    md = out_dir / "README.md"
    md.write_text(markdown(report, plots))
    return [*plots, md]
