"""One GRPO step's attention, the plain paged kernel and the shared-prefix kernels of the default
launch, called eagerly a few times for Nsight Compute to read (bench_prefix_attention.py times
them; this only runs them). The first `--warmup` rounds compile; skip their launches in ncu.

    ncu --clock-control none -k regex:'_attn_kernel|_item_kernel|_lone_heads_kernel|_merge_kernel' \
        --launch-skip 8 --launch-count 4 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats \
        python3 benchmarks/ncu_prefix_attention.py --workload 32 8 1024 --q-len 1
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from bench_prefix_attention import SHAPES, Step  # noqa: E402

from rollout.engine import triton_pdl  # noqa: E402
from rollout.engine.prefix_launch import DEFAULT_LAUNCH  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", nargs=3, type=int, default=[32, 8, 1024], metavar=("PROMPTS", "N", "PROMPT"))
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--max-gen", type=int, default=150, help="generated tokens per sample, uniform in [1, N]")
    p.add_argument("--warmup", type=int, default=2, help="rounds before the ones to profile (compiles)")
    p.add_argument("--rounds", type=int, default=2, help="rounds to profile: plain, then shared, each round")
    p.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    args = p.parse_args()
    triton_pdl.ENABLED = not args.no_pdl
    step = Step((*args.workload, 0), args.q_len, SHAPES["qwen3-8b"], args, "cuda", torch.bfloat16)
    host, _ = step.planned(DEFAULT_LAUNCH, repeats=0)
    shared = step.shared_fn(step.device_plan(host, DEFAULT_LAUNCH, "cuda", graph_plan=False))
    for _ in range(args.warmup + args.rounds):
        step.plain()
        shared()
    torch.cuda.synchronize()
    print(f"workload {args.workload} q={args.q_len}: {len(host.items)} items, {host.num_partial_rows} partial rows, "
          f"{args.warmup + args.rounds} rounds of plain + shared", flush=True)


if __name__ == "__main__":
    main()
