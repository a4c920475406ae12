"""The fused MoE kernels one by one (issue 21): a sweep of launch parameters per step size, and
where a batch-1 decode step of the whole model spends its time (`moe_breakdown.py`).

Sweep, on one Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts, top 8, width 768, bf16, random
router and experts; `--copies` copies of the layer's experts rotated so that repeats read DRAM,
not L2): for each step of T tokens, each path (gemv, sorted with 16- or 64-row blocks) and each
phase (routing, gate/up, down, sum), every variant's time as CUDA-graph replays (median of
`--reps`, per layer), the GB/s of the expert bytes the step must read (each touched expert once)
and its fraction of the measured device copy bandwidth (routing and the sum: the same call
repeated per copy). Each variant runs the whole layer once
against `moe.experts_reference` in float32 (relative error ||out - ref|| / ||ref||, outputs
poisoned with NaN first); variants over 2e-2 are marked and never picked. Then, per T, the
launch main ran before the table, the table's launch (moe_launch.LAUNCHES) and each path's
fastest phases combined, timed whole (router GEMM + MoE): the fastest of those is "best", and
the best launches are printed as a table to paste into moe_launch.py.

    python benchmarks/bench_moe.py --device cuda --out bench_moe.json     # sweep + breakdown
    python benchmarks/bench_moe.py --device cuda --no-breakdown            # sweep only
    python benchmarks/bench_moe.py --device cpu --quick                    # checks the script itself
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import SHAPES, copy_bandwidth, environment, free_memory, print_table, time_us, write_json  # noqa: E402

from rollout.engine import moe, moe_launch, triton_moe, triton_moe_route, triton_ops  # noqa: E402
from rollout.engine.moe_launch import MoeLaunch, Tiles  # noqa: E402

# Variants per kernel (block_n, block_k, warps, stages); each list's first entry leads, the table's
# choice is among them. Sorted: some from vLLM's tuned H200 configs for this shape (its BLOCK_N
# counts gate and up columns together: half of ours).
GEMV_GATE_UP = [Tiles(32, 64, 4, 5), Tiles(32, 256, 4, 3), Tiles(32, 128, 4, 3), Tiles(16, 256, 4, 3),
                Tiles(16, 128, 4, 4), Tiles(64, 128, 4, 3), Tiles(32, 256, 4, 2), Tiles(32, 256, 8, 3),
                Tiles(64, 256, 8, 3), Tiles(32, 512, 4, 2)]
GEMV_DOWN = [Tiles(8, 256, 8, 2), Tiles(16, 128, 8, 2), Tiles(8, 128, 4, 2), Tiles(4, 256, 4, 2),
             Tiles(16, 64, 4, 2), Tiles(16, 256, 8, 2), Tiles(32, 128, 8, 2)]  # no tl.dot: stages do nothing
SORTED_GATE_UP = {16: [Tiles(64, 128, 4, 3), Tiles(32, 128, 4, 3), Tiles(32, 64, 4, 5), Tiles(128, 128, 8, 2),
                       Tiles(64, 64, 4, 4)],
                  64: [Tiles(64, 64, 4, 3), Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 4)]}
SORTED_DOWN = {16: [Tiles(64, 64, 4, 4), Tiles(32, 128, 4, 3), Tiles(64, 128, 4, 3), Tiles(128, 128, 8, 2),
                    Tiles(128, 64, 4, 3)],
               64: [Tiles(64, 64, 4, 3), Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 4)]}
# What main ran before the table (tiles() at 50f12be): 16-row blocks below 32 pairs per expert.
BEFORE = MoeLaunch("sorted", Tiles(32, 128, 4, 3), Tiles(32, 128, 4, 3), block_m=16)
BEFORE_LARGE = MoeLaunch("sorted", Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3), block_m=64)
ROUTER_ROWS = [2, 4, 8, 16]  # router rows per program of the norm's launch (add_rms_norm_router)
ROUTER_IN_NORM_MAX_TOKENS = 8  # the norm + router launches are timed up to here
GEMV_MAX_TOKENS = 64  # the gemv path is swept up to here (it re-reads shared experts per pair)
BAD_ERROR = 2e-2  # bf16 operands land between 1e-3 and 1e-2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="tiny shape, two variants per list (CPU check)")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=[k for k, v in SHAPES.items() if "num_experts" in v])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 16, 64, 512])
    p.add_argument("--copies", type=int, default=4, help="copies of the layer's experts, rotated")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--no-breakdown", action="store_true", help="skip the whole-model breakdown")
    p.add_argument("--breakdown-batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--context", type=int, default=192, help="breakdown: the decode step's context")
    p.add_argument("--decode-tokens", type=int, default=64, help="breakdown: tokens of the timed engine run")
    p.add_argument("--out", default="benchmarks/results/bench_moe.json")
    args = p.parse_args()
    if args.quick:
        args.shape, args.tokens, args.copies, args.reps, args.decode_tokens = "tiny-moe", [1, 3], 1, 1, 3
        args.context, args.breakdown_batches = 24, [1, 2]
    return args


class Layer:
    """`copies` random copies of one MoE layer's router and experts (bf16 on CUDA), and step inputs."""

    def __init__(self, shape: dict, copies: int, device: str):
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.hidden, self.experts = shape["hidden_size"], shape["num_experts"]
        self.inter, self.top_k = shape["moe_intermediate_size"], shape["num_experts_per_tok"]
        self.device = device
        gen = torch.Generator(device=device).manual_seed(0)
        rand = lambda *s: (torch.randn(*s, generator=gen, device=device) * 0.02).to(self.dtype)  # noqa: E731
        self.copies = [(rand(self.experts, 2 * self.inter, self.hidden), rand(self.experts, self.hidden, self.inter),
                        rand(self.experts, self.hidden)) for _ in range(copies)]  # (gate_up, down, router)

    def step(self, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (unit scale, as after RMSNorm) and its router logits through copy 0's router."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn(num_tokens, self.hidden, generator=gen, device=self.device).to(self.dtype)
        return x, F.linear(x, self.copies[0][2])

    def expert_bytes(self, ids: torch.Tensor) -> dict[str, float]:
        """Bytes of expert weights a step routed to `ids` must read, by phase."""
        down = ids.unique().numel() * self.hidden * self.inter * self.copies[0][0].element_size()
        return dict(gate_up=2 * down, down=down)

    def time(self, args, fn) -> float:
        """Median microseconds of `fn(copy)` per copy, every copy in one graph; NaN (and the error
        printed) when the variant fails, so that one failure costs one row, not the run."""
        try:
            return time_us(lambda: [fn(c) for c in self.copies], args.device, args.reps) / len(self.copies)
        except Exception as e:  # noqa: BLE001 - a variant Triton cannot compile or launch
            print(f"variant failed: {e!r}"[:400], flush=True)
            return float("nan")


def poisoned(fn, sizes: list[int]):
    """Run `fn` after freeing NaN-filled bf16 blocks of the element counts its outputs will have,
    so that the allocator likely hands them back to it and an unwritten element shows as NaN
    (best effort: the caching allocator decides)."""
    if torch.cuda.is_available():
        junk = [torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda") for n in sizes]
        del junk
    return fn()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.float() - want).norm() / want.norm()).item()


def sweep_tokens(layer: Layer, num_tokens: int, args, bandwidth: float, rows: list[dict]) -> None:
    x, logits = layer.step(num_tokens, seed=num_tokens)
    gate_up0, down0, _ = layer.copies[0]
    weights, ids = moe.route(logits, layer.top_k, True)
    ref = moe.experts_reference(x.float(), gate_up0.float(), down0.float(), weights.float(), ids)
    nbytes = layer.expert_bytes(ids)
    pairs = num_tokens * layer.top_k  # the element counts of the paths' hidden and output buffers:
    hidden_rows = [pairs] + [triton_moe_route.max_blocks(pairs, layer.experts, bm) * bm for bm in (16, 64)]
    outputs = [n * layer.inter for n in hidden_rows] + [pairs * layer.hidden, x.numel()]

    def check(launch: MoeLaunch) -> float:
        try:
            run = lambda: triton_moe.fused_moe(x, logits, gate_up0, down0, layer.top_k, True, launch)  # noqa: E731
            return rel_error(poisoned(run, outputs), ref)
        except Exception as e:  # noqa: BLE001 - reported as an infinite error, never picked
            print(f"{launch} failed: {e!r}"[:400], flush=True)
            return float("inf")

    def add(path: str, phase: str, tiles, us: float, launch: MoeLaunch | None = None, block_m: int = 0) -> None:
        err = None if launch is None else check(launch)
        row = dict(tokens=num_tokens, path=path, block_m=block_m, phase=phase, tiles=str(tiles or "-"), us=us,
                   rel_err=err, launch=str(launch or "-"), experts_touched=ids.unique().numel())
        moved = sum(nbytes.values()) if phase == "layer" else nbytes.get(phase)
        if moved:
            row.update(gb_per_s=moved / us / 1e3, of_copy=moved / us / 1e3 / (bandwidth / 1e9))
        rows.append(row)

    if num_tokens <= ROUTER_IN_NORM_MAX_TOKENS:
        sweep_router(layer, x, args, add)
    paths = [("gemv", 0)] if num_tokens <= GEMV_MAX_TOKENS else []
    for path, block_m in paths + [("sorted", bm) for bm in ((16, 64) if num_tokens >= 256 else (16,))]:
        try:
            if path == "gemv":
                sweep_gemv(layer, x, logits, args, add)
            else:
                sweep_sorted(layer, x, logits, block_m, args, add)
        except Exception as e:  # noqa: BLE001 - the path's base launch failed: report it, sweep the rest
            print(f"{num_tokens} tokens, {path} {block_m}: failed: {e!r}"[:400], flush=True)
    launches = [("before", BEFORE if num_tokens * layer.top_k < 32 * layer.experts else BEFORE_LARGE),
                ("table", moe_launch.launch_for(num_tokens))] + candidates(rows, num_tokens)
    for name, launch in launches:
        us = layer.time(args, lambda c, launch=launch: triton_moe.fused_moe(
            x, F.linear(x, c[2]), c[0], c[1], layer.top_k, True, launch))
        add(name, "layer", launch, us, launch)
    timed = [r for r in rows if r["tokens"] == num_tokens and r["path"].startswith("best ")
             and math.isfinite(r["us"]) and r["rel_err"] < BAD_ERROR]
    if timed:  # the fastest candidate, timed whole: the phases alone leave out launch gaps
        rows.append({**min(timed, key=lambda r: r["us"]), "path": "best"})


def sweep_gemv(layer: Layer, x, logits, args, add) -> None:
    k = layer.top_k
    base = next((e for _, e in moe_launch.LAUNCHES if e.path == "gemv"), MoeLaunch("gemv", GEMV_GATE_UP[0],
                                                                                 GEMV_DOWN[0]))
    hidden, weights, ids = triton_moe.gemv_gate_up(x, logits, layer.copies[0][0], k, True, base.gate_up)
    for tiles, inside in [(t, True) for t in variants(GEMV_GATE_UP, args)] + [(base.gate_up, False)]:
        us = layer.time(args, lambda c, t=tiles, r=inside: triton_moe.gemv_gate_up(x, logits, c[0], k, True, t, r))
        launch = replace(base, gate_up=tiles, route_inside=inside)
        add("gemv", "gate_up", f"{tiles}{'' if inside else ' +route'}", us, launch)
    for tiles in variants(GEMV_DOWN, args):
        us = layer.time(args, lambda c, t=tiles: triton_moe.gemv_down(hidden, c[1], weights, ids, k, t))
        add("gemv", "down", tiles, us, replace(base, down=tiles))


def sweep_router(layer: Layer, x, args, add) -> None:
    """The residual add + RMSNorm before the block and the router's logits: two launches (the
    norm kernel, then the router's GEMM) against one (triton_ops.add_rms_norm_router), by rows
    of the router per program."""
    gen = torch.Generator(device=layer.device).manual_seed(1)
    attn = torch.randn(x.shape, generator=gen, device=layer.device).to(layer.dtype)
    norm = torch.rand(layer.hidden, generator=gen, device=layer.device).to(layer.dtype) + 0.5

    def separate(router):
        normed, _ = triton_ops.add_rms_norm(attn, x, norm, 1e-6)
        return F.linear(normed, router)

    add("norm", "router", "norm + GEMM", layer.time(args, lambda c: separate(c[2])))
    for rows in ROUTER_ROWS:
        us = layer.time(args, lambda c, r=rows: triton_ops.add_rms_norm_router(attn, x, norm, 1e-6, c[2], r))
        add("norm", "router", f"in norm, {rows} rows a program", us)


def sweep_sorted(layer: Layer, x, logits, block_m: int, args, add) -> None:
    k, num_pairs = layer.top_k, x.shape[0] * layer.top_k
    base = next((e for _, e in moe_launch.LAUNCHES if e.path == "sorted" and e.block_m == block_m),
                MoeLaunch("sorted", SORTED_GATE_UP[block_m][0], SORTED_DOWN[block_m][0], block_m))
    weights, sorted_pairs, block_expert = triton_moe.sorted_route(logits, k, True, block_m)
    add("sorted", "route", None, layer.time(args, lambda c: triton_moe.sorted_route(logits, k, True, block_m)),
        None, block_m)
    hidden = triton_moe.sorted_gate_up(x, layer.copies[0][0], sorted_pairs, block_expert, k, block_m, base.gate_up)
    for tiles in variants(SORTED_GATE_UP[block_m], args):
        us = layer.time(args, lambda c, t=tiles: triton_moe.sorted_gate_up(x, c[0], sorted_pairs, block_expert, k,
                                                                           block_m, t))
        add("sorted", "gate_up", tiles, us, MoeLaunch("sorted", tiles, base.down, block_m), block_m)
    for tiles in variants(SORTED_DOWN[block_m], args):
        us = layer.time(args, lambda c, t=tiles: triton_moe.sorted_down(hidden, c[1], weights, sorted_pairs,
                                                                        block_expert, num_pairs, block_m, t))
        add("sorted", "down", tiles, us, MoeLaunch("sorted", base.gate_up, tiles, block_m), block_m)
    pair_out = triton_moe.sorted_down(hidden, layer.copies[0][1], weights, sorted_pairs, block_expert, num_pairs,
                                      block_m, base.down)
    add("sorted", "sum", None, layer.time(args, lambda c: pair_out.view(x.shape[0], k, -1).sum(1)), None, block_m)


def variants(tiles: list[Tiles], args) -> list[Tiles]:
    return tiles[:2] if args.quick else tiles


def candidates(rows: list[dict], num_tokens: int) -> list[tuple[str, MoeLaunch]]:
    """Per path and block size, the launch of its fastest correct gate/up (with its routing choice)
    and down, to be timed whole: ("best gemv", launch), ("best sorted m16", launch), ..."""
    mine = [r for r in rows if r["tokens"] == num_tokens and r["phase"] in ("gate_up", "down")
            and math.isfinite(r["us"]) and r["rel_err"] is not None and r["rel_err"] < BAD_ERROR]
    out = []
    for path, block_m in sorted({(r["path"], r["block_m"]) for r in mine}):
        fastest = {}
        for r in (r for r in mine if (r["path"], r["block_m"]) == (path, block_m)):
            if r["phase"] not in fastest or r["us"] < fastest[r["phase"]]["us"]:
                fastest[r["phase"]] = r
        if len(fastest) == 2:
            down = parse_launch(fastest["down"]["launch"]).down
            launch = replace(parse_launch(fastest["gate_up"]["launch"]), down=down)
            out.append((f"best {path}" + (f" m{block_m}" if path == "sorted" else ""), launch))
    return out


def parse_tiles(text: str) -> Tiles:
    n, k, w, s = (int(part[1:]) for part in text.split("/"))
    return Tiles(n, k, w, s)


def parse_launch(text: str) -> MoeLaunch:
    """The MoeLaunch whose str() is `text`."""
    parts = text.split()
    block_m = int(parts[1][1:]) if parts[0] == "sorted" else 16
    return MoeLaunch(parts[0], parse_tiles(parts[-3]), parse_tiles(parts[-1]), block_m, "routed" not in parts,
                     "router-in-norm" in parts)


def print_sweep(rows: list[dict]) -> None:
    top, rows = [], [r for r in rows if r["path"] in (*moe_launch.PATHS, "norm")]
    for key in sorted({(r["tokens"], r["path"], r["block_m"], r["phase"]) for r in rows}):
        group = sorted((r for r in rows if (r["tokens"], r["path"], r["block_m"], r["phase"]) == key),
                       key=lambda r: (r["rel_err"] is not None and r["rel_err"] >= BAD_ERROR, r["us"]))
        top += group[:3]
    print_table("MoE sweep, per layer: the 3 fastest variants of each phase (all in the JSON); of_copy = GB/s "
                "of the touched experts' bytes over the device copy bandwidth", top,
                ["tokens", "path", "block_m", "phase", "tiles", "us", "gb_per_s", "of_copy", "rel_err"])


def print_choice(rows: list[dict], tokens: list[int]) -> None:
    layer = [r for r in rows if r["phase"] == "layer"]
    print_table("whole MoE layer (router GEMM + kernels): main's launch before the table, the table's, each "
                "path's fastest phases, the best of those", layer,
                ["tokens", "path", "tiles", "us", "gb_per_s", "of_copy", "rel_err", "experts_touched"])
    print("\nbest launches, for rollout/engine/moe_launch.py (bucket = the tokens measured):")
    for num_tokens in tokens:
        launch = parse_launch(next(r for r in layer if r["tokens"] == num_tokens and r["path"] == "best")["launch"])
        print(f"    ({num_tokens}, {launch!r}),")



def main() -> None:
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = copy_bandwidth(args.device, (64 << 20) if args.quick else (4 << 30))
    print(f"device copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)", flush=True)
    result = dict(args=vars(args), env=environment(args.device), copy_bandwidth_bytes_per_s=bandwidth,
                  table=[(most, str(launch)) for most, launch in moe_launch.LAUNCHES], rows=[])
    layer = Layer(SHAPES[args.shape], args.copies, args.device)
    for num_tokens in args.tokens:
        start = time.perf_counter()
        sweep_tokens(layer, num_tokens, args, bandwidth, result["rows"])
        write_json(args.out, result)
        print(f"swept {num_tokens} tokens in {time.perf_counter() - start:.1f} s", flush=True)
    del layer
    free_memory()
    if not args.no_breakdown:
        from moe_breakdown import breakdown

        result["breakdown"] = breakdown(args, bandwidth)
        write_json(args.out, result)
    print_sweep(result["rows"])
    print_choice(result["rows"], args.tokens)
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
