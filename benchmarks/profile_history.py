"""Host time of the rollout-history proposer (issue 23): one epoch of `bench_history.py`'s workload
(prompts x n samples at temperature 1, after an epoch that fills the history) on `--spec
dflash+history` with full blocks (`--no-spec-adaptive`: the budget's choices do not depend on step
times; the history's worker stores epoch 2's samples while it runs, so what the history proposes
varies a little from run to run), under cProfile; the Python time a step of each
function in the `rollout/spec` package, the proposers' share of the host's critical path (drafted
steps run synchronously). Compare commits by running it on each.

    python benchmarks/profile_history.py --device cpu            # ~1 min on the 2-core CPU machine
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats

import torch
from bench_history import add_workload_args, build, draft_totals, epoch_requests
from common import heldout_prompts, print_table, run_engine, write_json


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    add_workload_args(p, prompts=16, prompt_len=64, output_len=64, out="benchmarks/results/profile_history.json")
    p.add_argument("--top", type=int, default=8, help="functions shown")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    engine = build("dflash+history", args, spec_adaptive=False)
    prompts = heldout_prompts(args.prompts, args.prompt_len)
    run_engine(engine, epoch_requests(prompts, args, 1001), "epoch1", args.device)
    engine.drafter.flush()
    before = draft_totals(engine)
    profile = cProfile.Profile()
    profile.enable()
    run = run_engine(engine, epoch_requests(prompts, args, 1002), "epoch2", args.device)
    profile.disable()
    by_function: collections.Counter[str] = collections.Counter()
    for (path, _, name), (_, _, own, _, _) in pstats.Stats(profile).stats.items():
        if "/rollout/spec/" in path:
            by_function[f"{path.split('/rollout/')[-1]}:{name}"] += own
    ms = lambda s: round(s / run.steps * 1e3, 3)  # noqa: E731
    rows = [dict(function="rollout/spec in all", ms_per_step=ms(sum(by_function.values())))]
    rows += [dict(function=f, ms_per_step=ms(s)) for f, s in by_function.most_common(args.top)]
    drafts = {name: dict(proposed=p - before.get(name, (0, 0))[0], accepted=a - before.get(name, (0, 0))[1])
              for name, (p, a) in draft_totals(engine).items()}  # epoch 2's
    print_table(f"Python time a step under cProfile, epoch 2 of {args.prompts} prompts x n={args.n}, {run.steps} "
                f"steps, drafts {drafts}", rows, ["function", "ms_per_step"])
    write_json(args.out, dict(args=vars(args), steps=run.steps, tokens=run.tokens, drafts=drafts, rows=rows))


if __name__ == "__main__":
    main()
