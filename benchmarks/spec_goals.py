"""Issue 19's goals over bench_spec.py's rows (its runs, or several runs' rounds pooled with
`bench_spec.py --pool`): adaptive budgets against no speculation and against full blocks, per
setting, with how far one run's share of full's speedup can be trusted."""

from __future__ import annotations

import json
import statistics

import numpy as np
from common import print_table

ARMS = ("none", "full", "adaptive")  # bench_spec's arms (each also "-sync" with --sync-arms)


def share_interval(full_rounds: list[float], paired_rounds: list[float], resamples: int = 2000) -> str:
    """The share of full's speedup (as goals computes it) over rounds drawn with replacement (fixed
    seed): its 5th and 95th percentiles, "lo to hi" (how far one run's share can be trusted). The
    share is undefined where full blocks do not pay (a ratio over a speedup near 0: call 3 of the
    eleventh session printed -125,350,000), so resamples whose full speedup is below 1.01 are left
    out, and their fraction is named."""
    full, paired = np.asarray(full_rounds), np.asarray(paired_rounds)
    idx = np.random.default_rng(0).integers(0, len(full), size=(resamples, len(full)))
    f, p = np.median(full[idx], axis=1), np.median(paired[idx], axis=1)
    pays = f >= 1.01
    if not pays.any():
        return "full never pays"
    lo, hi = np.percentile((f[pays] * p[pays] - 1) / (f[pays] - 1), [5, 95])
    left_out = 1 - pays.mean()
    return f"{lo:.3f} to {hi:.3f}" + (f" ({left_out:.0%} of resamples: full does not pay)" if left_out else "")


def goals(rows: list[dict]) -> list[dict]:
    """Per setting: adaptive / none (goal >= 0.97), adaptive's share of full's speedup where full pays
    (goal >= 0.95), and for the long tail whether adaptive finished first."""
    out = []
    settings = {tuple((k, r[k]) for k in ("case", "spec", "sampling", "batch")) for r in rows}
    for setting in sorted(settings, key=str):
        arms = {r["arm"]: r for r in rows if all(r[k] == v for k, v in setting)}
        if len(arms) < len(ARMS):
            continue
        full, adaptive = arms["full"]["vs_none"], arms["adaptive"]["vs_none"]
        row = dict(setting, full=full, adaptive=adaptive, never_costs=adaptive >= 0.97)
        if full > 1:  # adaptive's speedup as full's times their paired ratio (rounds' medians of each)
            kept = full * arms["adaptive"]["vs_full"]
            row["vs_full"] = arms["adaptive"]["vs_full"]
            row["share_of_full_speedup"] = (kept - 1) / (full - 1)
            row["share_90"] = share_interval(arms["full"]["vs_none_rounds"], arms["adaptive"]["vs_full_rounds"])
            row["keeps_speedup"] = kept >= 1 + 0.95 * (full - 1)
        if dict(setting)["case"] == "long-tail":  # (paired within rounds, as the share: see the docstring)
            row["finishes_first"] = adaptive > 1 and arms["adaptive"]["vs_full"] > 1
        out.append(row)
    return out


def pooled_rows(paths: list[str]) -> list[dict]:
    """One row per setting and arm over the rounds of every file: its ratio rounds concatenated (in
    file order) and their medians; the other columns are the first file's."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                key = tuple(r[k] for k in ("case", "spec", "sampling", "batch", "arm"))
                row = rows.setdefault(key, dict(r, vs_none_rounds=[], vs_full_rounds=[], files=0))
                row["files"] += 1
                row["vs_none_rounds"] += r["vs_none_rounds"]
                row["vs_full_rounds"] += r.get("vs_full_rounds", [])
    for row in rows.values():
        row["vs_none"] = statistics.median(row["vs_none_rounds"])
        if row["vs_full_rounds"]:
            row["vs_full"] = statistics.median(row["vs_full_rounds"])
    return list(rows.values())


def print_goals(rows: list[dict], note: str = "") -> None:
    print_table("goals (issue 19): adaptive >= 0.97 x none; >= 95% of full's speedup where it pays; the long "
                f"tail finishes first with adaptive{f' ({note})' if note else ''}", rows,
                ["case", "spec", "sampling", "batch", "full", "adaptive", "vs_full", "never_costs",
                 "share_of_full_speedup", "share_90", "keeps_speedup", "finishes_first"])
