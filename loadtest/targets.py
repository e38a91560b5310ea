"""The live experiment's targets, as facts: met or not, with the numbers.

cache_aware's hit rate within 5% of the simulated oracle's, its load max/mean at most
1.15, and whether its TTFT p50 and total time are the lowest of all policies, on the
pooled figures and counted per repeat.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

HIT_RATE_OVER_ORACLE_TARGET = 0.95
LOAD_MAX_OVER_MEAN_TARGET = 1.15


def _beats(ca: dict[str, Any], others: Sequence[dict[str, Any]], field: str) -> bool:
    """cache_aware's figure is below every other policy's (a missing figure loses)."""
    return ca[field] is not None and all(o[field] is None or ca[field] < o[field] for o in others)


def _wins(rounds: Sequence[dict[str, dict[str, Any]]], field: str) -> str:
    """In how many repeats (policy → summary each) cache_aware's ``field`` was lowest."""
    mine = [r for r in rounds if "cache_aware" in r]
    wins = sum(
        _beats(r["cache_aware"], [s for p, s in r.items() if p != "cache_aware"], field)
        for r in mine
    )
    return f"{wins}/{len(mine)}"


def check_targets(
    runs: list[dict[str, Any]], oracle: dict[str, Any], cells: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """The targets per experiment, as facts: met or not, with the numbers. With
    ``cells`` (the single repeats), also in how many repeats cache_aware was fastest."""
    out: dict[str, Any] = {}
    by_exp: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_exp.setdefault(run["meta"]["experiment"], {})[run["meta"]["policy"]] = run["summary"]
    per_repeat: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for cell in cells:
        key = (cell["meta"]["experiment"], cell["meta"].get("repeat", 0))
        per_repeat.setdefault(key, {})[cell["meta"]["policy"]] = cell["summary"]
    for exp, policies in by_exp.items():
        ca = policies.get("cache_aware")
        if ca is None:
            continue
        others = [s for p, s in policies.items() if p != "cache_aware"]
        oracle_hit = (oracle.get(exp) or {}).get("hit_rate")
        ratio = ca["hit_rate"] / oracle_hit if oracle_hit and ca["hit_rate"] is not None else None
        targets: dict[str, Any] = {
            "hit_rate_over_oracle": ratio,
            "hit_rate_target_met": ratio is not None and ratio >= HIT_RATE_OVER_ORACLE_TARGET,
            "ttft_p50_best": _beats(ca, others, "ttft_p50_s"),
            "total_time_best": _beats(ca, others, "total_time_s"),
            "load_max_over_mean": ca["load_max_over_mean"],
            "load_target_met": ca["load_max_over_mean"] is not None
            and ca["load_max_over_mean"] <= LOAD_MAX_OVER_MEAN_TARGET,
        }
        rounds = [ps for (e, _), ps in sorted(per_repeat.items()) if e == exp]
        if rounds:
            targets["ttft_p50_best_in_repeats"] = _wins(rounds, "ttft_p50_s")
            targets["total_time_best_in_repeats"] = _wins(rounds, "total_time_s")
        out[exp] = targets
    return out
