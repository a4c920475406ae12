"""The adaptive draft budget's learning replayed on CPU with GPU-like step times (issue 19): bench_spec's
long tail (a quarter of the samples run 4x longer; `--uniform`: every sample as long, the embedded batch
case) on the embedded pair, full blocks then adaptive budgets, where each step's wall time given to the
budget comes from a time model instead of the clock, and its cost model starts from the startup tables
of a GPU run (a bench_spec JSON's adaptive row). The drafts and acceptance are the real models'; only
the times are synthetic. For studying what the budget learns and declines without device time: a GPU
run's pathology that this reproduces can be traced step by step here. (Its time model is a guess shaped
on the H200's host-bound embedded steps in BENCHMARKS.md, eleventh session: a graphed step ~2.6-3.0 ms
whatever it drafts, an eager step ~4.5 ms plus its tokens; it is not a measurement.) Each arm's row
names its critical sample, the one that finished last: its place in the order of admission, the step it
first decoded in and its last step.

    python benchmarks/replay_budget.py --cost benchmarks/results/bench_spec_slack3_tail_h200.json
    python benchmarks/replay_budget.py --cost benchmarks/results/bench_spec_room3_h200.json --samples 32 \
        --short 256 --uniform
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_spec  # noqa: E402
from common import print_table, write_json  # noqa: E402

from rollout.engine.spec_budget import SpecBudget, step_shape  # noqa: E402
from rollout.engine.step_cost import Curve, StepCost, TargetCost  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cost", required=True, help="a bench_spec JSON: its first adaptive row's cost tables")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--short", type=int, default=64, help="the short samples' output tokens (long: 4x)")
    p.add_argument("--uniform", action="store_true", help="every sample --short tokens (no long tail)")
    p.add_argument("--sampling", default="greedy", choices=list(bench_spec.SAMPLING))
    p.add_argument("--graph-ms", type=float, nargs=3, default=[2.6, 0.4, 0.15],
                   help="a graphed step: base ms, ms more at 256 rows, ms more when it drafts")
    p.add_argument("--eager-ms", type=float, nargs=3, default=[4.5, 0.0005, 1.5],
                   help="an eager step: base ms, ms per token, ms more when it drafts")
    p.add_argument("--out", default="benchmarks/results/replay_budget.json")
    return p.parse_args()


def gpu_tables(path: str) -> StepCost:
    """The StepCost of the startup tables in a bench_spec JSON's first adaptive row (learning on)."""
    row = next(r for r in json.load(open(path))["rows"] if r.get("arm") == "adaptive")
    cost = row["cost"]
    table = lambda d: TargetCost(d["rows"], [x / 1e3 for x in d["decode_ms"]],  # noqa: E731
                                 [x / 1e3 for x in d["verify_ms"]], d["q"])
    drafter = Curve(cost["graph"]["rows"], [x / 1e3 for x in cost["drafter_ms"]])
    return StepCost(table(cost["eager"]), table(cost["graph"]), drafter)


class SyntheticClock:
    """Replaces SpecBudget.record's wall time and graphed flag by the time model's (a step is graphed
    when it has no prefill and at most 256 rows, as on the GPU); keeps each step's shape."""

    def __init__(self, args: argparse.Namespace):
        self.graph, self.eager = args.graph_ms, args.eager_ms
        self.steps: list[tuple[int, int, int, bool]] = []  # (rows, tokens besides drafts, drafts, graphed)
        self.items: list[list[tuple[int, int]]] = []  # per step, (sequence id, tokens besides drafts) per item
        self._record = SpecBudget.record

    def __enter__(self):
        clock = self

        def record(budget, step, num_accepted, seconds, graphed):
            rows, tokens, _, drafts = step_shape(step)
            graphed = tokens <= rows <= 256
            clock.steps.append((rows, tokens, drafts, graphed))
            clock.items.append([(id(item.seq), item.num_new_tokens) for item in step.tokens.items])
            return clock._record(budget, step, num_accepted, clock.seconds(rows, tokens, drafts, graphed), graphed)

        SpecBudget.record = record
        return self

    def __exit__(self, *exc):
        SpecBudget.record = self._record

    def seconds(self, rows: int, tokens: int, drafts: int, graphed: bool) -> float:
        if graphed:
            base, per_256, drafting = self.graph
            return (base + per_256 * rows / 256 + (drafting if drafts else 0.0)) / 1e3
        base, per_token, drafting = self.eager
        return (base + per_token * tokens + (drafting if drafts else 0.0)) / 1e3


def critical_sample(steps: list[list[tuple[int, int]]]) -> dict:
    """The sample that finished last (steps: per step, (sequence id, tokens besides drafts) per item):
    its place in the order of admission, the step it first decoded in (one token besides drafts), its
    last step."""
    order, first, last = {}, {}, {}
    for i, items in enumerate(steps):
        for seq, tokens in items:
            order.setdefault(seq, len(order))
            if tokens == 1:
                first.setdefault(seq, i)
            last[seq] = i
    seq = max(last, key=lambda s: (last[s], -order[s]))
    return dict(critical=order[seq], critical_first_decode=first.get(seq), critical_last=last[seq])


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    n, short = args.samples, args.short
    lengths = [short if args.uniform or i % 4 else 4 * short for i in range(n)]
    engine_args = argparse.Namespace(device="cpu", block=8)
    engines = bench_spec.engine_pair(engine_args, "dflash", n, 256 + 4 * short)
    requests = bench_spec.requests(bench_spec.heldout_prompts(n), bench_spec.SAMPLING[args.sampling], lengths)
    budget = engines["spec"].spec_budget
    budget.cost, budget.graphs, budget.max_graph_rows = gpu_tables(args.cost), True, 256
    rows = []
    with SyntheticClock(args) as clock:
        for arm in ("full", "adaptive"):
            clock.steps.clear()
            clock.items.clear()
            start = time.perf_counter()
            row = bench_spec.run_arm(engines, arm, [requests], arm, "cpu")
            graphed = [s for s in clock.steps if s[3]]
            synthetic = sum(clock.seconds(*s) for s in clock.steps)
            rows.append(dict(arm=arm, steps=row["steps"], synthetic_s=round(synthetic, 3),
                             graphed_steps=len(graphed), graphed_plain=sum(1 for s in graphed if not s[2]),
                             declined=row.get("declined"), probes=row.get("probes"),
                             drafts_per_row=round(row["drafts_per_row"], 3) if "drafts_per_row" in row else None,
                             mean_acceptance=round(row["mean_acceptance"], 3),
                             **critical_sample(clock.items), corrections=row.get("cost", {}).get("corrections"),
                             cpu_s=round(time.perf_counter() - start, 1)))
    case = "uniform samples" if args.uniform else "the long tail"
    print_table(f"{case} replayed on CPU, {n} samples, {args.sampling}, GPU tables of {args.cost}", rows,
                [k for k in rows[0] if k != "corrections"])
    for row in rows:
        print(row["arm"], "corrections", row["corrections"])
    write_json(args.out, dict(args=vars(args), rows=rows, corrections={"/".join(map(str, k)): round(v, 3)
                                                                     for k, v in budget.cost.correction.items()}))


if __name__ == "__main__":
    main()
