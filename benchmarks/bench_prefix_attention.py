"""Shared-prefix attention against the plain paged-attention kernel, one layer call, GRPO-shaped
steps: P prompts x n samples forked from each, every sample holding its prompt's blocks and its
own generated tokens (uniform in [1, --max-gen]), decode rows (q = 1) and verify rows (q = 9).
Qwen3-8B attention (32 query heads, 8 KV heads, head_dim 128), bf16, block size 16.

For each shape and launch-parameter variant (rollout/engine/prefix_launch.py; `default` is the
engine's table, the others one LaunchConfig for both decode and verify steps): milliseconds per
call (CUDA graphs of 20 calls, median of 5 replays, and their spread), the ratio to the plain
kernel, the effective bandwidth over the unique KV bytes (each distinct key and value read once:
the floor a kernel that reads shared blocks once can reach), the plan's items and partial rows,
the host time of planning the step, and the largest difference from a float32 torch reference
(the output poisoned with NaN first: an unwritten element fails). Every variant is timed with
every group shared (ShareRule()); `route` is the path the engine's planner takes for the step
(prefix_launch.SHARE_RULE: `shared`, or `plain` when it admits no group), and the summary's
`route_ok` says whether that path was the faster one (LOSS: it shares where plain was faster).
`--crossover` adds steps near the rule's edges, plain vs default: smaller groups, shorter
prompts, and groups beside sequences alone (a workload's 4th field: sequences with a prompt of
their own). Prints a table, writes JSON.

    # the GPU sweep, compiled in parallel first (Triton's disk cache), then timed one at a time:
    python benchmarks/bench_prefix_attention.py --sweep --crossover --compile-only --jobs 12
    python benchmarks/bench_prefix_attention.py --sweep --crossover --out $OUT/bench_prefix_attention_sweep.json
    # the default and the rule, main steps and crossover (no sweep):
    python benchmarks/bench_prefix_attention.py --crossover --out $OUT/bench_prefix_attention_rule.json
    python benchmarks/bench_prefix_attention.py --quick --sweep --crossover --out /tmp/b.json   # CPU check

The issue's goal: shared_ms / plain_ms <= 0.35 at 32 x 8 x 1024, q = 1, and no slower than the
plain kernel at q = 9.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--quick" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import (  # noqa: E402
    ATTENTION_KERNELS,
    captured,
    environment,
    kernel_trace,
    kernel_us,
    print_table,
    replay_times_ms,
    write_json,
)
from prefix_variants import VARIANTS  # noqa: E402

from rollout.engine.attention import AttentionMetadata, paged_attention  # noqa: E402
from rollout.engine.prefix_attention import StaticSharedPrefix, plan_to_device  # noqa: E402
from rollout.engine.prefix_launch import DEFAULT_LAUNCH, LaunchConfigs, ShareRule  # noqa: E402
from rollout.engine.prefix_plan import SharedPrefixPlanner  # noqa: E402
from rollout.engine.triton_attention import paged_attention_triton  # noqa: E402
from rollout.engine.triton_prefix_attention import shared_prefix_attention_triton  # noqa: E402

SHAPES = {"qwen3-8b": (32, 8, 128), "tiny": (4, 2, 32)}  # query heads, KV heads, head_dim
BLOCK = 16
# (prompts, samples, prompt tokens, sequences alone): the two GRPO shapes
WORKLOADS = [(32, 8, 1024, 0), (16, 16, 4096, 0)]
# near SHARE_RULE's edges: smaller groups, shorter prompts, groups of 8 beside sequences alone
CROSSOVER = [(128, 2, 1024, 0), (64, 4, 1024, 0), (32, 8, 512, 0), (32, 8, 256, 0), (16, 8, 1024, 128)]
QUICK = [(2, 4, 64, 0), (1, 3, 128, 0)]
QUICK_CROSSOVER = [(1, 4, 64, 3)]
FORCED = ShareRule()  # every group shared: what the kernel variants are timed with
KEY = ("prompts", "n", "prompt", "alone", "q_len")  # a step's fields in every row
MAX_ERROR = 2e-2  # bf16 operands against float32: ~1e-3 expected; more is a wrong result


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", nargs="+", type=int, default=[1, 9])
    p.add_argument("--max-gen", type=int, default=150, help="generated tokens per sample, uniform in [--min-gen, N]")
    p.add_argument("--min-gen", type=int, default=1,
                   help="the fewest generated tokens per sample (equal to --max-gen: a rollout's step, where every "
                        "sample started at once and holds as many own keys)")
    p.add_argument("--sweep", action="store_true", help="every variant of VARIANTS besides the default")
    p.add_argument("--variants", nargs="+", help="only these variants of VARIANTS (with --sweep)")
    p.add_argument("--crossover", action="store_true", help="also smaller groups and a shorter prompt (default only)")
    p.add_argument("--workloads", nargs="+", type=workload, metavar="P,N,PROMPT[,ALONE]",
                   help="these steps in place of the issue's two: P prompts x N samples of PROMPT tokens, beside "
                        "ALONE sequences alone (default 0)")
    p.add_argument("--compile-only", action="store_true", help="compile every kernel variant on tiny steps, then exit")
    p.add_argument("--jobs", type=int, default=8, help="processes compiling in parallel (--compile-only)")
    p.add_argument("--repeats", type=int, default=5, help="timed graph replays (the median is reported)")
    p.add_argument("--quick", action="store_true", help="tiny shapes through Triton's interpreter (CPU check)")
    p.add_argument("--profile", action="store_true",
                   help="also each kernel's device time per call (torch.profiler, eager calls; CUDA only)")
    p.add_argument("--cold", action="store_true",
                   help="with --profile: every call after a write of 256 MB, which leaves none of its bytes in L2 "
                        "(as in a rollout, whose layers read weights between attention calls)")
    p.add_argument("--graph-plan", action="store_true",
                   help="shared plans as the engine's CUDA graphs hold them (buffers and launches sized for capacity)")
    p.add_argument("--best", metavar="JSON",
                   help="print the fastest variants of a sweep's JSON at 32x8x1024 as DECODE,VERIFY (for "
                        "bench_rl.py --prefix-launch), then exit")
    p.add_argument("--out", default="benchmarks/results/bench_prefix_attention.json")
    return p.parse_args()


def workload(text: str) -> tuple[int, int, int, int]:
    """A --workloads value: P,N,PROMPT[,ALONE] as (prompts, samples, prompt tokens, sequences alone)."""
    try:
        fields = [int(x) for x in text.split(",")]
    except ValueError:
        fields = []
    if len(fields) not in (3, 4) or min(fields) < 0 or min(fields[:3]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want P,N,PROMPT[,ALONE], positive integers (ALONE >= 0)")
    return (*fields, 0)[:4]


def main_workloads(args) -> list[tuple[int, int, int, int]]:
    """The steps every variant is timed on: --workloads, else the issue's two (--quick: tiny ones)."""
    return args.workloads or (QUICK if args.quick else WORKLOADS)


def launches(args) -> dict[str, LaunchConfigs]:
    chosen = {"default": DEFAULT_LAUNCH}
    if args.sweep:
        names = args.variants or list(VARIANTS)
        chosen.update({name: LaunchConfigs(VARIANTS[name], VARIANTS[name]) for name in names})
    return chosen


def grpo_step(workload, q_len: int, max_gen: int, min_gen: int = 1, seed: int = 0):
    """Block tables, contexts and prompt lengths of one decode / verify step (blocks scrambled):
    `prompts` x `samples` forked samples, then `alone` sequences with a prompt of their own."""
    prompts, samples, prompt_len, alone = workload
    prompt_of = np.concatenate([np.repeat(np.arange(prompts), samples), prompts + np.arange(alone)])  # [S]
    prompts += alone
    rng = np.random.default_rng(seed)
    gen = rng.integers(min_gen, max_gen + 1, size=len(prompt_of)) + q_len  # [S] tokens after the prompt
    ctx = prompt_len + gen
    prompt_blocks = prompt_len // BLOCK
    own = -(-(ctx - prompt_blocks * BLOCK) // BLOCK)  # [S] blocks past the shared full ones
    num_blocks = prompts * prompt_blocks + int(own.sum()) + 1
    ids = rng.permutation(num_blocks - 1) + 1
    width = prompt_blocks + int(own.max())
    table = np.zeros((len(ctx), width), np.int64)
    used = prompts * prompt_blocks
    for s, p in enumerate(prompt_of):
        table[s, :prompt_blocks] = ids[p * prompt_blocks:(p + 1) * prompt_blocks]
        table[s, prompt_blocks:prompt_blocks + own[s]] = ids[used:used + own[s]]
        used += own[s]
    unique_keys = prompts * prompt_blocks * BLOCK + int((ctx - prompt_blocks * BLOCK).sum())
    return table, ctx, num_blocks, unique_keys


def metadata(table, ctx, q_len: int, device: str) -> AttentionMetadata:
    positions = np.concatenate([np.arange(c - q_len, c) for c in ctx])
    seq = np.repeat(np.arange(len(ctx)), q_len)
    slots = table[seq, positions // BLOCK] * BLOCK + positions % BLOCK
    t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64), device=device)  # noqa: E731
    return AttentionMetadata(positions=t(positions), slot_mapping=t(slots),
                             cu_seqlens_q=t(np.arange(0, len(seq) + 1, q_len)), context_lens=t(ctx),
                             block_tables=t(table), max_query_len=q_len, max_context_len=int(ctx.max()),
                             block_size=BLOCK)


def call_ms(fn, device: str, calls: int, repeats: int) -> tuple[float, float]:
    """(median, max - min) milliseconds per call over `repeats` replays of a CUDA graph of
    `calls` calls (one wall-clock call off CUDA)."""
    fn()
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3, 0.0
    (times,) = replay_times_ms([captured(fn, calls)], calls, repeats)
    return statistics.median(times), max(times) - min(times)


class Step:
    """One workload's step on the device: caches, queries, metadata, the float32 reference."""

    def __init__(self, workload, q_len: int, shape, args, device: str, dtype):
        self.workload, self.q_len, self.shape = workload, q_len, shape
        self.prompt_len = workload[2]
        heads, kv_heads, head_dim = shape
        self.table, self.ctx, num_blocks, unique_keys = grpo_step(workload, q_len, args.max_gen, args.min_gen)
        self.meta = metadata(self.table, self.ctx, q_len, device)
        gen = torch.Generator(device=device).manual_seed(0)
        cache_shape = (num_blocks, BLOCK, kv_heads, head_dim)
        self.k_cache, self.v_cache = (torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
                                      for _ in range(2))
        self.q = torch.randn(len(self.meta.positions), heads, head_dim, generator=gen, device=device, dtype=dtype)
        self.scale = head_dim**-0.5
        self.unique_bytes = 2 * unique_keys * kv_heads * head_dim * self.k_cache.element_size()
        self.ref = None

    def reference(self) -> torch.Tensor:
        """Float32 torch attention (this step's keys are in the cache already: it rewrites them
        from the cache itself)."""
        if self.ref is None:
            flat = [c.view(-1, *c.shape[2:])[self.meta.slot_mapping].float() for c in (self.k_cache, self.v_cache)]
            self.ref = paged_attention(self.q.float(), *flat, self.k_cache.float(), self.v_cache.float(), self.meta,
                                       self.scale)
        return self.ref

    def plain(self, out=None):
        m = self.meta
        return paged_attention_triton(self.q, self.k_cache, self.v_cache, m.block_tables, m.context_lens,
                                      m.cu_seqlens_q, m.max_query_len, m.max_context_len, self.scale)

    def plan_args(self):
        starts = (self.ctx - self.q_len).tolist()
        return self.table, starts, [self.q_len] * len(self.ctx), [self.prompt_len] * len(self.ctx)

    def route(self) -> str:
        """The path the engine's planner (default launch and SHARE_RULE) takes for this step."""
        heads, kv_heads, _ = self.shape
        return "plain" if SharedPrefixPlanner(BLOCK, heads // kv_heads, kv_heads).plan(*self.plan_args()) is None \
            else "shared"

    def planner(self, launch: LaunchConfigs) -> SharedPrefixPlanner:
        """A planner for this step's shape that shares every group (FORCED)."""
        heads, kv_heads, _ = self.shape
        return SharedPrefixPlanner(BLOCK, heads // kv_heads, kv_heads, launch, FORCED)

    def planned(self, launch: LaunchConfigs, repeats: int):
        """(host plan with every group shared, host ms per plan)."""
        planner = self.planner(launch)
        plan_args = self.plan_args()
        host = planner.plan(*plan_args)
        begin = time.perf_counter()
        for _ in range(repeats):
            planner.plan(*plan_args)
        return host, (time.perf_counter() - begin) / max(repeats, 1) * 1e3

    def device_plan(self, host, launch: LaunchConfigs, device: str, graph_plan: bool):
        """The host plan on the device: as planned, or (graph_plan) in a CUDA graph's static
        buffers for this step's token count, whose launches are sized for their capacity."""
        plan = plan_to_device(host, torch.device(device))
        if not graph_plan:
            return plan
        tokens = len(self.meta.positions)
        static = StaticSharedPrefix(self.planner(launch), tokens, torch.device(device))
        static.load(plan, tokens)
        return static.plan(tokens, self.q_len)

    def shared_fn(self, plan):
        def run(out=None):
            return shared_prefix_attention_triton(self.q, self.k_cache, self.v_cache, self.meta.block_tables,
                                                  self.meta.positions, plan, self.scale, out=out)
        return run

    def error(self, fn) -> float:
        """Largest absolute difference from the reference, the output poisoned with NaN first
        (inf when an element was not written or is NaN)."""
        out = fn(torch.full_like(self.q, float("nan")))
        diff = (out.float() - self.reference()).abs()
        return float("inf") if diff.isnan().any() else diff.max().item()


def profile_workloads(chosen: dict, args, dtype) -> list[dict]:
    """Rows (step, variant, kernel, us per call) for the main steps, the plain kernel first, and per
    variant "(all)", the kernels' sum. --cold: each call after an L2 flush, itself not counted."""
    rows = []
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda") if args.cold else None
    for workload in main_workloads(args):
        for q_len in args.queries:
            step = Step(workload, q_len, SHAPES["qwen3-8b"], args, "cuda", dtype)
            fns = {"plain": lambda out=None, step=step: step.plain()}
            for name, launch in chosen.items():
                host, _ = step.planned(launch, repeats=0)
                fns[name] = step.shared_fn(step.device_plan(host, launch, "cuda", args.graph_plan))
            for name, fn in fns.items():
                fn()
                run = fn if flush is None else lambda fn=fn: (flush.zero_(), fn())
                trace = [e for e in kernel_trace(run, calls=20) if any(k in e["name"] for k in ATTENTION_KERNELS)]
                kernels = kernel_us(None, calls=20, by_grid=True, trace=trace)
                for kernel, us in kernels.items():
                    rows.append(dict(key_fields(step), variant=name, kernel=kernel, us=us))
                rows.append(dict(key_fields(step), variant=name, kernel="(all)", us=sum(kernels.values())))
            del step
            torch.cuda.empty_cache()
    return rows


def key_fields(step: Step) -> dict:
    return dict(zip(KEY, (*step.workload, step.q_len), strict=True))


def measure(step: Step, name: str, launch: LaunchConfigs | None, args, device: str) -> dict:
    """One row: the plain kernel (launch None) or a shared-prefix variant."""
    row = dict(key_fields(step), variant=name)
    calls = 1 if args.quick else 20
    if launch is None:
        fn = step.plain
        row.update(items=0, partial_rows=0, plan_host_ms=0.0)
    else:
        host, host_ms = step.planned(launch, repeats=1 if args.quick else 20)
        if host is None:
            return dict(row, ms=float("nan"), note="nothing to share")
        fn = step.shared_fn(step.device_plan(host, launch, device, args.graph_plan))
        row.update(items=len(host.items), partial_rows=host.num_partial_rows, plan_host_ms=host_ms)
    row["ms"], row["spread_ms"] = call_ms(fn, device, calls, args.repeats)
    row["GBps_unique"] = step.unique_bytes / row["ms"] / 1e6
    row["max_err"] = step.error(fn) if launch is not None else step.error(lambda out: step.plain())
    row["note"] = "WRONG" if not row["max_err"] <= MAX_ERROR else ""
    return row


def guarded(step: Step, name: str, launch: LaunchConfigs, args, device: str) -> dict:
    """measure(), a variant that fails to compile or run recorded as such (one GPU call times all)."""
    try:
        return measure(step, name, launch, args, device)
    except Exception as error:  # noqa: BLE001 - the sweep goes on; the row says what broke
        return dict(key_fields(step), variant=name, ms=float("nan"),
                    note=f"ERROR {type(error).__name__}: {str(error)[:120]}")


def run_workloads(workloads, chosen: dict, args, device: str, dtype, result: dict) -> None:
    shape = SHAPES["tiny" if args.quick else "qwen3-8b"]
    for workload in workloads:
        for q_len in args.queries:
            step = Step(workload, q_len, shape, args, device, dtype)
            plain = measure(step, "plain", None, args, device)
            rows = [plain] + [guarded(step, name, launch, args, device) for name, launch in chosen.items()]
            route = step.route()
            for row in rows:
                row.update(ratio=row["ms"] / plain["ms"], route=route)
            print(f"{workload} q={q_len}: plain {plain['ms']:.4f} ms, "
                  + ", ".join(f"{r['variant']} {r['ratio']:.3f}" for r in rows[1:]) + f"; route {route}", flush=True)
            result["rows"] += rows
            write_json(args.out, result)
            del step
            if device == "cuda":
                torch.cuda.empty_cache()


def compile_all(chosen: dict, args, device: str, dtype) -> None:
    """Compile every variant's kernels on small steps of the same head shape, dtype and number of
    sequences (the same specialisations), in `args.jobs` processes: Triton's disk cache then
    serves the timed run."""
    import multiprocessing as mp

    shape = SHAPES["tiny" if args.quick else "qwen3-8b"]
    tasks = [(name, q, args.max_gen, shape, device, dtype) for name in chosen for q in args.queries]
    begin = time.perf_counter()
    with mp.get_context("spawn").Pool(min(args.jobs, len(tasks))) as pool:
        for name, q, seconds in pool.imap_unordered(_compile_one, tasks):
            print(f"compiled {name} q={q}: " + (f"{seconds:.1f} s" if isinstance(seconds, float) else seconds),
                  flush=True)
    print(f"compiled {len(tasks)} variants in {time.perf_counter() - begin:.1f} s")


def _compile_one(task):
    try:
        return _compile(*task)
    except Exception as error:  # noqa: BLE001 - reported; the timed run records the variant's error
        return task[0], task[1], f"failed: {type(error).__name__}: {str(error)[:200]}"


def _compile(name, q_len, max_gen, shape, device, dtype):
    begin = time.perf_counter()
    launch = {"default": DEFAULT_LAUNCH, **{k: LaunchConfigs(v, v) for k, v in VARIANTS.items()}}[name]
    args = argparse.Namespace(max_gen=max_gen, min_gen=1)
    step = Step((32, 8, 64, 0), q_len, shape, args, device, dtype)  # 256 sequences, as the timed steps
    step.plain()
    host, _ = step.planned(launch, repeats=0)
    step.shared_fn(plan_to_device(host, torch.device(device)))()
    if device == "cuda":
        torch.cuda.synchronize()
    return name, q_len, time.perf_counter() - begin


def summary(rows: list[dict]) -> list[dict]:
    """Per step: the plain kernel, the default, the fastest correct variant, the engine's route
    and whether it took the faster of plain and default (`route_ok`: yes, LOSS where it shares
    and the plain kernel was faster, `missed win` where it does not and sharing was faster)."""
    best = []
    keys = sorted({tuple(r[k] for k in KEY) for r in rows}, key=lambda k: (k[2], k[1], k[3], k[4]))
    for key in keys:
        group = [r for r in rows if tuple(r[k] for k in KEY) == key]
        plain = next(r for r in group if r["variant"] == "plain")
        default = next(r for r in group if r["variant"] == "default")
        ok = [r for r in group if r["variant"] != "plain" and not r["note"] and r["ms"] == r["ms"]]
        top = min(ok, key=lambda r: r["ms"]) if ok else default
        faster = "shared" if default["ms"] < plain["ms"] else "plain"  # NaN (nothing shared): plain
        verdict = "yes" if plain["route"] == faster else "LOSS" if plain["route"] == "shared" else "missed win"
        best.append(dict(zip(KEY, key, strict=True), plain_ms=plain["ms"], default_ms=default["ms"],
                         default_ratio=default["ratio"], best=top["variant"], best_ms=top["ms"],
                         best_ratio=top["ratio"], route=plain["route"],
                         route_ok=verdict,
                         worst_err=max((r.get("max_err", 0.0) for r in group), default=0.0)))
    return best


def best_variants(path: str) -> str:
    """DECODE,VERIFY: the fastest variants of a sweep's JSON at the issue's step, 32 prompts x n=8
    x 1024 tokens, q=1 and q=9 (`default` where the sweep timed no q=9)."""
    import json

    best = {r["q_len"]: r["best"] for r in json.load(open(path))["summary"]
            if (r["prompts"], r["n"], r["prompt"], r["alone"]) == (32, 8, 1024, 0)}
    return f"{best[1]},{best.get(9, 'default')}"


def main() -> None:
    args = parse_args()
    if args.best:
        print(best_variants(args.best))
        return
    device = "cpu" if args.quick else "cuda"
    dtype = torch.float32 if args.quick else torch.bfloat16
    chosen = launches(args)
    if args.quick:
        args.max_gen, args.min_gen = 20, 1
    if not 1 <= args.min_gen <= args.max_gen:
        raise SystemExit(f"--min-gen must be in [1, --max-gen], got {args.min_gen} and {args.max_gen}")
    if args.compile_only:
        compile_all(chosen, args, device, dtype)
        return
    result = dict(args=vars(args), env=environment(device), shape=SHAPES["tiny" if args.quick else "qwen3-8b"],
                  launch={name: repr(launch) for name, launch in chosen.items()}, rows=[])
    run_workloads(main_workloads(args), chosen, args, device, dtype, result)
    if args.crossover:
        run_workloads(QUICK_CROSSOVER if args.quick else CROSSOVER, {"default": DEFAULT_LAUNCH}, args, device,
                      dtype, result)
    for row in result["rows"]:
        row["err"] = f"{row.get('max_err', float('nan')):.1e}"
    print_table("attention per layer call, every variant (ms; ratio to plain; GB/s of unique KV)", result["rows"],
                [*KEY, "variant", "ms", "spread_ms", "ratio", "GBps_unique", "items", "partial_rows", "err", "route",
                 "note"])
    if args.profile and device == "cuda":
        result["profile"] = profile_workloads(chosen, args, dtype)
        print_table("device time per call by kernel (us; eager calls, torch.profiler)", result["profile"],
                    [*KEY, "variant", "kernel", "us"])
    result["summary"] = summary(result["rows"])
    print_table("fastest correct variant per step (ms); the engine's route", result["summary"],
                [*KEY, "plain_ms", "default_ms", "default_ratio", "best", "best_ms", "best_ratio", "route", "route_ok",
                 "worst_err"])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
