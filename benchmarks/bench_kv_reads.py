"""How fast a paged KV cache reads when each program takes one KV head's rows (issue 24).

The shared-prefix pass reads a group's keys once per (item, KV head) pair: a key row of one head is
256 contiguous bytes (128 dims, bf16), and the next key's row of that head lies 2 KB further (8 KV
heads a key). The pass reaches ~3 TB/s, 65% of the H200's DRAM peak, with enough copies in flight
(benchmarks/results/prefix_attention_notes.md). This isolates the access pattern from the attention
math: a Triton kernel sums a cache of [blocks, 16, KV heads, 128] through programs that each read a
run of blocks, in four layouts of the same bytes:

- `all_heads`: a program reads its blocks' every KV head (32 KB contiguous a block);
- `head_together`: one head a program, the heads of a run of blocks in adjacent programs (as the
  shared pass's queue hands out (item, KV head) pairs, which run at about the same time);
- `head_apart`: one head a program, programs ordered head by head (a head's pass over the whole
  cache before the next head's);
- `two_heads`: two adjacent heads a program (512 contiguous bytes a key), pairs of heads together.

If the one-head layouts read much slower than `all_heads`, a shared tile that holds several KV heads
would pay; if not, the pass's 65% comes from elsewhere.

    python benchmarks/bench_kv_reads.py --device cuda --out benchmarks/results/bench_kv_reads_h200.json
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from common import copy_bandwidth, environment, print_table, time_us, write_json

BLOCK, HEAD_DIM = 16, 128
LAYOUTS = {"all_heads": 0, "head_together": 1, "head_apart": 2, "two_heads": 3}


@triton.jit
def _read_kernel(cache_ptr, out_ptr, num_runs, RUN: tl.constexpr, KV_HEADS: tl.constexpr, HEADS: tl.constexpr,
                 APART: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums HEADS adjacent KV heads of RUN consecutive blocks (key rows of HEADS x 128
    bf16, one block's BLOCK keys a step); APART orders programs head group by head group."""
    p = tl.program_id(0)
    groups = KV_HEADS // HEADS
    if APART:
        run, group = p % num_runs, p // num_runs
    else:
        run, group = p // groups, p % groups
    rows = tl.arange(0, BLOCK * HEADS)  # key x head of the group
    offs = ((rows // HEADS) * KV_HEADS + group * HEADS + rows % HEADS)[:, None] * HEAD_DIM \
        + tl.arange(0, HEAD_DIM)[None, :]
    acc = tl.zeros([BLOCK * HEADS, HEAD_DIM], tl.float32)
    base = cache_ptr + run.to(tl.int64) * RUN * BLOCK * KV_HEADS * HEAD_DIM
    for b in range(RUN):
        acc += tl.load(base + b * BLOCK * KV_HEADS * HEAD_DIM + offs).to(tl.float32)
    tl.store(out_ptr + p, tl.sum(acc))


def read_fn(cache: torch.Tensor, layout: str, run: int, warps: int, stages: int):
    """A call that reads the whole cache once in `layout`."""
    num_blocks, _, kv_heads, _ = cache.shape
    heads = {"all_heads": kv_heads, "two_heads": 2}.get(layout, 1)
    runs = num_blocks // run
    grid = runs * (kv_heads // heads)
    out = torch.empty(grid, dtype=torch.float32, device=cache.device)

    def call():
        _read_kernel[(grid,)](cache, out, runs, RUN=run, KV_HEADS=kv_heads, HEADS=heads,
                              APART=layout == "head_apart", HEAD_DIM=HEAD_DIM, BLOCK=BLOCK,
                              num_warps=warps, num_stages=stages)
    return call, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--gb", type=float, default=2.0, help="cache size (GB; far past L2)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--runs", nargs="+", type=int, default=[16, 64], help="blocks a program reads")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/bench_kv_reads.json")
    args = p.parse_args()
    if args.kv_heads < 2 or args.kv_heads & (args.kv_heads - 1):
        raise SystemExit(f"--kv-heads must be a power of two >= 2, got {args.kv_heads}")
    block_bytes = BLOCK * args.kv_heads * HEAD_DIM * 2
    num_blocks = int(args.gb * 1e9) // block_bytes // max(args.runs) * max(args.runs)
    cache = torch.randn(num_blocks, BLOCK, args.kv_heads, HEAD_DIM, device=args.device, dtype=torch.bfloat16)
    nbytes = cache.numel() * cache.element_size()
    copy = copy_bandwidth(args.device, 1 << 30) if args.device == "cuda" else float("nan")  # bytes read + written
    rows, expected = [], cache.double().sum().item()
    for run in args.runs:
        for layout in LAYOUTS:
            for warps, stages in ((4, 2), (4, 4), (8, 4)):
                call, out = read_fn(cache, layout, run, warps, stages)
                call()
                err = abs(out.double().sum().item() - expected) / max(abs(expected), 1.0)
                us = time_us(call, args.device, args.reps)
                rows.append(dict(run=run, layout=layout, warps=warps, stages=stages, us=us,
                                 TBps=nbytes / us / 1e6, of_copy=nbytes / us * 1e6 / copy, rel_err=err))
                print(rows[-1], flush=True)
    print_table(f"reading a {nbytes / 1e9:.2f} GB paged KV cache once ({args.kv_heads} KV heads; a copy moves "
                f"{copy / 1e12:.2f} TB/s)", rows, ["run", "layout", "warps", "stages", "us", "TBps", "of_copy",
                                                   "rel_err"])
    write_json(args.out, dict(environment=environment(args.device), bytes=nbytes, copy_read_Bps=copy, rows=rows))


if __name__ == "__main__":
    main()
