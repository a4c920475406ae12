"""Why the adaptive draft budget declines drafts (issue 19): `bench_spec.py` (same options) with every
step whose full choice gives no drafts to samples that could verify some recorded: the step's rows,
the predicted seconds of the chosen (plain) step and of full blocks, the cost model's plain and
drafting corrections for the step's kind (graphed or not) and rows bucket with how many steps of each
it has counted, the rule's age and whether it was tentative, and the samples' own and the server-wide
acceptance estimates at the first positions. A decline made where the plain step's price was never
measured, or on a sample's estimate that no later draft can correct while the rule serves, shows here.
Every step the adaptive budget records is listed too (`steps`: rows, drafting rows, drafts, graphed,
its wall time and the cost model's prediction of it then, whether it was a probe), so the price of a
drafting step and of the steps around it can be read against the plain steps' (`--cases 8b`: the
probes of a batch that declines every draft), each step named by its run (`run`: the case, the round
and the arm; the full arm's steps are recorded too), and each run's row gains `captured_graphs`, the
CUDA graphs its steps had to capture (a ragged step's new graph key is captured inside the timed run).

    python3 benchmarks/trace_declines.py --device cuda --cases embedded-greedy --specs dflash \
        --embedded-repeats 10 --out benchmarks/results/trace_declines_h200.json

Writes bench_spec's JSON with `declines` (every declined full choice, in order) added.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_spec  # noqa: E402

from rollout.engine.spec_budget import SpecBudget, step_shape  # noqa: E402
from rollout.engine.step_cost import rows_bucket  # noqa: E402

MAX_RECORDS = 400
MAX_STEPS = 4000


def traced_run_arm(current: dict):
    """bench_spec.run_arm, naming the steps it records and counting the graphs its steps captured."""
    run_arm = bench_spec.run_arm

    def _run_arm(engines, arm, groups, tag, device, fresh=False):
        engine = engines["none" if arm == "none" else "spec"]
        current["run"] = f"{tag}-{arm}"
        before = engine.compiled()["graphs"]
        row = run_arm(engines, arm, groups, tag, device, fresh)
        row["captured_graphs"] = engine.compiled()["graphs"] - before
        return row

    return _run_arm


def traced_record(steps: list[dict], current: dict):
    """SpecBudget.record, listing each step's shape, wall time and predicted time (before it learns)."""
    record = SpecBudget.record

    def _record(budget, step, num_accepted, seconds, graphed):
        if len(steps) < MAX_STEPS:
            n, tokens, drafting, drafts = step_shape(step)
            predicted = budget.cost.seconds(n, tokens, graphed, drafting, drafts)
            steps.append(dict(run=current.get("run"), rows=n, drafting=drafting, drafts=drafts, graphed=graphed,
                              ms=round(seconds * 1e3, 3),
                              predicted_ms=round(predicted * 1e3, 3),
                              probe=bool(drafting and budget._probe_due is not None)))
        return record(budget, step, num_accepted, seconds, graphed)

    return _record


def traced_choose(records: list[dict]):
    """SpecBudget._choose, recording each choice that gives no drafts where the samples' limits allow some."""
    choose = SpecBudget._choose

    def _choose(budget, decode, limits, rows, base, room, graphs):
        drafts, seconds, full_seconds = choose(budget, decode, limits, rows, base, room, graphs)
        chosen = drafts * len(decode) if isinstance(drafts, int) else sum(drafts)
        if chosen == 0 and sum(limits) and len(records) < MAX_RECORDS:
            cost, bucket_ = budget.cost, rows_bucket(len(decode))
            graphed = graphs and cost.graph is not None
            keys = {"plain": (graphed, False), "drafting": (graphed, True)}
            own = budget.acceptance.of(decode)[:, :3]  # [S, 3]
            records.append(dict(
                rows=len(decode), room=room, graphs=graphs, predicted_ms=round(seconds * 1e3, 4),
                full_ms=round(full_seconds * 1e3, 4), age=budget._age, tentative=budget._tentative,
                full_choice=budget._age == 1,
                **{f"{name}_{level}": round(cost.correction.get(key if level == "kind" else (*key, bucket_), -1.0), 3)
                   for name, key in keys.items() for level in ("kind", "bucket")},
                **{f"{name}_counted": cost.observed.get((*key, bucket_), 0) for name, key in keys.items()},
                own_p123_min=np.round(own.min(axis=0), 3).tolist(),
                own_p123_mean=np.round(own.mean(axis=0), 3).tolist(),
                server_p123=np.round(budget.acceptance.server_wide()[:3], 3).tolist()))
        return drafts, seconds, full_seconds

    return _choose


def main() -> None:
    records: list[dict] = []
    steps: list[dict] = []
    current: dict = {}
    SpecBudget._choose = traced_choose(records)
    SpecBudget.record = traced_record(steps, current)
    bench_spec.run_arm = traced_run_arm(current)
    bench_spec.main()
    args = bench_spec.parse_args()
    with open(args.out) as f:
        result = json.load(f)
    result["declines"] = records
    result["steps"] = steps
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    full = [r for r in records if r["full_choice"]]
    unmeasured = sum(r["plain_counted"] == 0 for r in full)
    print(f"declined full choices: {len(full)} ({unmeasured} where the plain step's bucket had no counted step), "
          f"steps they served: {len(records)}; wrote {args.out}")
    summarise(steps)


def summarise(steps: list[dict]) -> None:
    """By setting and arm, over the timed rounds: the steps' median and mean wall time and prediction,
    graphed and eager, drafting and plain apart, and the plain steps right after a drafting step."""
    after = {id(b) for a, b in zip(steps, steps[1:]) if a["drafting"] and not b["drafting"]}
    runs: dict[tuple[str, str], list[dict]] = {}
    for step in steps:
        setting, round_, arm = (step["run"] or "--").rsplit("-", 2)
        if round_ != "warm" and arm in ("full", "adaptive"):
            runs.setdefault((setting, arm), []).append(step)
    for (setting, arm), mine in runs.items():
        for name, group in (("graphed drafting", [s for s in mine if s["drafting"] and s["graphed"]]),
                            ("eager drafting", [s for s in mine if s["drafting"] and not s["graphed"]]),
                            ("plain after drafting", [s for s in mine if id(s) in after]),
                            ("graphed plain", [s for s in mine if not s["drafting"] and s["graphed"]]),
                            ("eager plain", [s for s in mine if not s["drafting"] and not s["graphed"]])):
            if group:
                ms = sorted(s["ms"] for s in group)
                per_row = sum(s["drafts"] for s in group) / max(sum(s["drafting"] for s in group), 1)
                print(f"{setting} {arm}, {name}: {len(group)} steps, median {ms[len(ms) // 2]:.2f} ms, mean "
                      f"{sum(ms) / len(ms):.2f} ms, predicted median "
                      f"{sorted(s['predicted_ms'] for s in group)[len(group) // 2]:.2f} ms, "
                      f"drafts a drafting row {per_row:.2f}")

if __name__ == "__main__":
    main()
