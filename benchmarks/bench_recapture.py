"""Does a CUDA graph captured again run its cuBLAS projections slower than the first capture?

`bench_engine.py --compare recapture` found the engine's steps 2.5-6% slower on graphs captured
again than on those captured when the engine was built, wherever cuBLAS runs the projections
(the 30B-A3B at batch 1, the 8B at batch 4), and not where Triton kernels run them all (the 8B at
batch 1). This narrows it down: a chain of F.linear calls on a shape's projections (one token,
weights rotated so that each call reads DRAM) captured once, then again `--captures` times (the
old graph alive, or dropped first), each timed and profiled for its kernel names.

    python benchmarks/bench_recapture.py --device cuda --out benchmarks/results/bench_recapture.json
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.nn.functional as F
from bench_gemv import L2_BYTES, projections
from common import SHAPES, environment, print_table, time_us, write_json


def chain(shape: dict, tokens: int):
    """A function running every projection of the shape on `tokens` rows, over rotated weight copies."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = []
    for name, (n, k) in projections(shape).items():
        if name in ("lm_head", "router"):  # one huge, one tiny: the chain is the layers' projections
            continue
        copies = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
                  for _ in range(max(2, -(-L2_BYTES // (n * k * 2))))]
        calls.append((torch.randn(tokens, k, generator=gen, device="cuda", dtype=torch.bfloat16), copies))
    return lambda: [F.linear(x, w) for x, copies in calls for w in copies]


def capture(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernels(graph: torch.cuda.CUDAGraph) -> list[str]:
    """Distinct kernel names one replay launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda",))
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "qwen3-8b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    p.add_argument("--captures", type=int, default=3)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/bench_recapture.json")
    args = p.parse_args()
    rows = []
    for shape in args.shapes:
        for tokens in args.tokens:
            fn = chain(SHAPES[shape], tokens)
            for fresh in (False, True):
                graph, first = capture(fn), None
                for i in range(args.captures + 1):
                    if i:
                        if fresh:
                            del graph
                            gc.collect()
                            torch.cuda.empty_cache()
                            graph = capture(fn)
                        else:
                            graph = capture(fn)  # the old one is freed once this one exists
                    us = time_us(graph.replay, args.device, args.reps, capture=False)
                    names = kernels(graph)
                    first = first or names
                    rows.append(dict(shape=shape, tokens=tokens, fresh=fresh, capture=i, us=us,
                                     same_kernels=names == first, kernels=" | ".join(n[:60] for n in names)))
                    print({k: v for k, v in rows[-1].items() if k != "kernels"}, names, flush=True)
                del graph
                gc.collect()
                torch.cuda.empty_cache()
    print_table("projection chains, us a replay, by capture (0: the first)", rows,
                ["shape", "tokens", "fresh", "capture", "us", "same_kernels"])
    write_json(args.out, dict(args=vars(args), env=environment(args.device), rows=rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
