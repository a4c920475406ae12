"""The linear layers of small decode steps: cuBLAS (F.linear) against rollout's skinny Triton
kernel (rollout/engine/triton_linear.py), per projection of the 8B and 30B-A3B shapes.

Each row times one projection at T tokens as CUDA-graph replays over rotated copies of the
weight (more than 256 MB in all, so no copy stays in L2 between calls, as in a real step where
the next layer reads other weights), and reports microseconds and the fraction of the copy
bandwidth the weight read reaches. "down+silu" is the down projection fed the packed gate|up
output: cuBLAS after triton_ops.silu_mul against the kernel's fused input; "+norm" likewise the
projection after a residual add and RMSNorm (triton_ops.add_rms_norm). The sweep times
other launches than `Launch.rule`'s so the rule can be checked; `best` is the fastest.

    python benchmarks/bench_linear.py --device cuda --out benchmarks/results/bench_linear_h200.json
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from common import copy_bandwidth, environment, print_table, time_us, write_json

from rollout.engine.triton_linear import Launch, skinny_linear
from rollout.engine.triton_ops import add_rms_norm, silu_mul

# (shape, projection, N, K); "+silu" takes a [T, 2K] gate|up input (silu * up inside the kernel),
# "+norm" the previous output and the residual stream (add + RMSNorm inside the kernel; the rule's
# launch only: the sweep of the plain projection stands for it)
PROJECTIONS = [
    ("qwen3-8b", "qkv", 6144, 4096), ("qwen3-8b", "qkv+norm", 6144, 4096), ("qwen3-8b", "o", 4096, 4096),
    ("qwen3-8b", "gate_up", 24576, 4096), ("qwen3-8b", "gate_up+norm", 24576, 4096),
    ("qwen3-8b", "down+silu", 4096, 12288), ("qwen3-30b-a3b", "qkv", 5120, 2048),
    ("qwen3-30b-a3b", "o", 2048, 4096), ("qwen3-30b-a3b", "router", 128, 2048),
]
EPS = 1e-6


def unfused(proj: str, x, w, residual, norm):
    """The engine's ops without the skinny kernel: F.linear after silu_mul / add_rms_norm."""
    if proj.endswith("+silu"):
        return F.linear(silu_mul(x), w)
    if proj.endswith("+norm"):
        return F.linear(add_rms_norm(x, residual, norm, EPS)[0], w)
    return F.linear(x, w)


def fused(proj: str, x, w, residual, norm, launch: Launch):
    if proj.endswith("+norm"):
        return skinny_linear(x, w, None, launch, add_norm=(residual, norm, EPS))[0]
    return skinny_linear(x, w, None, launch, silu_input=proj.endswith("+silu"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 9, 16])
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="also time launches other than the rule's")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU check of the script)")
    p.add_argument("--out", default="benchmarks/results/bench_linear.json")
    return p.parse_args()


def sweep(num_tokens: int) -> list[Launch]:
    if num_tokens == 1:
        grid = itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8), (2, 3))
    else:
        grid = itertools.product((16, 32, 64), (64, 128, 256), (4,), (2, 3))
    return [Launch(n, k, w, s) for n, k, w, s in grid]


def time_row(args, weights, x, fn) -> float:
    try:
        return time_us(lambda: [fn(x, w) for w in weights], args.device, args.reps) / len(weights)
    except Exception as e:  # noqa: BLE001 - a launch Triton cannot compile: one row lost, not the run
        print(f"failed: {e!r}"[:300], flush=True)
        return float("nan")


def launch_name(launch: Launch | None) -> str | None:
    return launch and f"n{launch.block_n}/k{launch.block_k}/w{launch.warps}/s{launch.stages}"


def bench_projection(args, shape: str, proj: str, n: int, k: int, bandwidth: float, dtype) -> tuple[list, list]:
    """Every timed row of one projection, and a summary row per token count."""
    nbytes = n * k * torch.finfo(dtype).bits // 8
    copies = max(2, -(-(256 << 20) // nbytes)) if args.device == "cuda" else 2
    weights = [(torch.randn(n, k, device=args.device) * 0.02).to(dtype) for _ in range(copies)]
    rows, best = [], []
    norm = torch.rand(k, device=args.device).to(dtype) + 0.5
    for num_tokens in args.tokens:
        x = torch.randn(num_tokens, 2 * k if proj.endswith("+silu") else k, device=args.device).to(dtype)
        residual = torch.randn(num_tokens, k, device=args.device).to(dtype)
        want = unfused(proj, x, weights[0], residual, norm).float()
        mine = []

        def add(path: str, launch: Launch | None, us: float, out=None, mine=mine, want=want,
                num_tokens=num_tokens) -> None:
            err = float((out.float() - want).abs().max() / want.abs().max()) if out is not None else 0.0
            mine.append(dict(shape=shape, proj=proj, n=n, k=k, tokens=num_tokens, path=path,
                             launch=launch_name(launch), us=us, fraction=nbytes / (us * 1e-6) / bandwidth,
                             rel_err=err))

        add("cublas", None, time_row(args, weights, x, lambda x, w, r=residual: unfused(proj, x, w, r, norm)))
        rule = Launch.rule(num_tokens, n, k)
        swept = args.sweep and not args.quick and not proj.endswith("+norm")
        launches = ([rule] if rule else []) + (sweep(num_tokens) if swept else [])
        for i, launch in enumerate(launches):
            if k % launch.block_k:
                continue
            fn = lambda x, w, launch=launch, r=residual: fused(proj, x, w, r, norm, launch)  # noqa: E731
            add("rule" if i == 0 and rule else "sweep", launch, time_row(args, weights, x, fn), fn(x, weights[0]))
        fastest = min((r for r in mine[1:] if r["us"] == r["us"]), key=lambda r: r["us"], default=None)
        ruled = next((r for r in mine if r["path"] == "rule"), None)
        best.append(dict(shape=shape, proj=proj, tokens=num_tokens, cublas_us=mine[0]["us"],
                         cublas_fraction=mine[0]["fraction"], rule_us=ruled and ruled["us"],
                         rule_fraction=ruled and ruled["fraction"], rule_launch=ruled and ruled["launch"],
                         rule_err=ruled and ruled["rel_err"], best_us=fastest and fastest["us"],
                         best_launch=fastest and fastest["launch"],
                         rule_over_cublas=ruled and ruled["us"] / mine[0]["us"]))
        print(best[-1], flush=True)
        rows += mine
    return rows, best


def main() -> None:
    args = parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    bandwidth = copy_bandwidth(args.device, 1 << 30) if args.device == "cuda" else float("nan")
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    projections = [("tiny", p, 128, 256) for p in ("qkv", "qkv+norm", "down+silu")] if args.quick else PROJECTIONS
    result = dict(args=vars(args), env=environment(args.device), bandwidth=bandwidth, rows=[], best=[])
    for shape, proj, n, k in projections:
        rows, best = bench_projection(args, shape, proj, n, k, bandwidth, dtype)
        result["rows"] += rows
        result["best"] += best
        write_json(args.out, result)
    print_table("skinny linear against cuBLAS, us a call (fraction of copy bandwidth)", result["best"],
                ["shape", "proj", "tokens", "cublas_us", "cublas_fraction", "rule_us", "rule_fraction",
                 "rule_launch", "rule_over_cublas", "rule_err", "best_us", "best_launch"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
