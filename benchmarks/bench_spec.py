"""Speculative decoding (issues 3, 19): what speculation buys, and that adaptive draft budgets never cost.

Every case runs its workload three ways in one run, side by side: `none` (no drafter), `full` (the
drafter's full block every step, as `--no-spec-adaptive`) and `adaptive` (the default: per-step draft
budgets from measured acceptance and step costs, rollout/engine/spec_budget.py). `full` and `adaptive`
are one engine, its scheduler's draft budget switched off and on, so they share CUDA graphs and
warm-up; `none` is an engine of its own. Each arm runs the workload once untimed (graph captures,
kernel builds, the budget's first estimates), then `--repeats` timed runs, alternating between arms;
the table shows each arm's median tokens/s and its ratio to `none` in the same case (`vs_none`: the
median over rounds of the ratio within a round; adaptive's `vs_full` likewise, and the share of full's
speedup that adaptive keeps is computed from full's vs_none times vs_full: full and adaptive run next
to each other in every round, so a host whose speed moves between rounds, as it does by 20% for the
embedded models' runs, moves both). Rounds alternate the arms' order (none, full, adaptive, then the
reverse), and each run starts after a garbage collection. (Stepping full and adaptive in turn on
engines of their own was tried and dropped: the adaptive engine's cost model then learns step times
that the other engine's steps distort, and its budget chose other steps.) With
`--fresh-start` each timed adaptive run starts from the budget's prior instead (what a new server's
first batch pays; the warm-up's graphs and cost model kept).

Cases (`--cases`; the default is all but verify-cost, ~5 minutes on one H200):
* embedded-t1: the embedded target with its DFlash and DSpark drafters (block 8), temperature 1,
  top-k 64, batch 32. Goal (issue 19): adaptive >= 0.97 of none.
* embedded-greedy: the same greedy at batch 1 (prompts one at a time) and 32. Goal: adaptive keeps
  >= 95% of full's speedup where full pays.
* 8b: a Qwen3-8B-shaped random target (load_format random) with an untrained one-layer DFlash drafter
  (block 8), temperature 1, batch 8 and 256. Goal: adaptive >= 0.97 of none.
* long-tail: a 256-sample rollout of the embedded target with DFlash whose output lengths vary (a
  quarter of the samples 4x longer, by per-request max_tokens), greedy and temperature 1. Goal:
  adaptive finishes before none and before full (`finishes_first`: the medians of its paired
  ratios to each over rounds are above 1, as the share below pairs its rounds).
* verify-cost: one 8B-shaped target forward + LM head over B x (block + 1) tokens against a decode
  step of B tokens, B in 1, 8, 32, 64, eagerly and replayed as a CUDA graph.

Prompts are the first 256 bytes of held-out stdlib files (scripts/corpus.py) on the embedded models,
random token ids on the 8B shape; EOS is ignored. Acceptance = committed tokens per verify step, the
prefill step of each sample left out (1.0 for steps that verified nothing); `drafts_per_row`: drafts
the adaptive budget verified per decode row, `probes` its full-block probe steps, `declined` its steps
that verified no drafts where samples could have (`declined_eager`: of them, steps run eagerly, as
while prompts prefill); `steps` each arm's
engine steps, `draft_steps` / `draft_seconds` the adaptive arm's steps that verified drafts and their
wall time, `eager_draft_steps` / `eager_draft_seconds` those of them whose target forward ran eagerly
(no CUDA graph), `eager_proposals` the drafter forwards that ran eagerly (of the adaptive arm's). `--host-profile` adds
one more run of full and adaptive under cProfile (`host_ms_per_step`: the host's milliseconds a step in
rollout's own functions; cProfile slows Python code, so compare the arms, not the totals with a step).

    python benchmarks/bench_spec.py --device cuda
    python benchmarks/bench_spec.py --device cuda --cases 8b long-tail
    python benchmarks/bench_spec.py --device cpu --quick     # a check of the script

`--sync-arms` adds each arm once more with overlapped scheduling off (`none-sync`, `full-sync`,
`adaptive-sync`: the same engines, `--no-overlap`'s synchronous loop, rollout/engine/overlap.py) in
the same rounds; `vs_sync` is an arm's median ratio over rounds to its synchronous twin (what overlap
buys it; issue 17), `overlapped_drafts` the steps it launched before a drafted step synchronised.

`--pool A.json B.json ...` runs nothing: it pools the rounds of earlier runs of the same code (each
setting's arms' per-round ratios, concatenated in file order so that each round's pairing holds) and
prints and writes the goals over them. A single run's medians move by more than the goals' margins
on the launch-bound embedded pair; pooled rounds are what a closing claim should rest on.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import pstats
import random
import statistics
import tempfile
from pathlib import Path

import torch
from common import (
    SHAPES,
    embedded_draft,
    environment,
    free_memory,
    graph_ms,
    heldout_prompts,
    kv_caches,
    metadata,
    model_dtype,
    nearest_median,
    print_table,
    random_model,
    random_target_and_drafter,
    run_engine,
    time_ms,
    write_json,
)
from spec_goals import ARMS, goals, pooled_rows, print_goals

import rollout
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams

HOST_TOP = 15  # functions listed by --host-profile
CASES = ("embedded-t1", "embedded-greedy", "8b", "long-tail", "verify-cost")
SAMPLING = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0, top_k=64)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="tiny workloads and shapes (a CPU check of the script)")
    p.add_argument("--cases", nargs="+", default=[c for c in CASES if c != "verify-cost"], choices=CASES)
    p.add_argument("--specs", nargs="+", default=["dflash", "dspark"], choices=["dflash", "dspark"],
                   help="the embedded cases' drafters")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--output-len", type=int, default=256, help="embedded cases (long tail: the short samples)")
    p.add_argument("--batch1-prompts", type=int, default=3, help="prompts run one at a time at batch 1")
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES), help="the 8b and verify-cost cases")
    p.add_argument("--shape-batches", nargs="+", type=int, default=[8, 256])
    p.add_argument("--shape-output-len", type=int, default=128)
    p.add_argument("--tail-samples", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="timed rounds of the arms (medians are shown)")
    p.add_argument("--embedded-repeats", type=int, default=5, help="the same, embedded cases (short runs)")
    p.add_argument("--verify-batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--context", type=int, default=1024, help="verify-cost")
    p.add_argument("--fresh-start", action="store_true",
                   help="each timed adaptive run starts from the prior, as a new server's first batch")
    p.add_argument("--host-profile", action="store_true",
                   help="one more run of full and adaptive under cProfile: host ms a step by function")
    p.add_argument("--sync-arms", action="store_true",
                   help="every arm also with overlapped scheduling off (vs_sync: overlap's gain)")
    p.add_argument("--pool", nargs="+", default=None, metavar="JSON",
                   help="run nothing: the goals over the pooled rounds of these bench_spec JSON files")
    p.add_argument("--out", default="benchmarks/results/bench_spec.json")
    args = p.parse_args()
    if args.quick:
        args.output_len, args.batch1_prompts, args.repeats, args.tail_samples = 16, 1, 1, 16
        args.embedded_repeats = 1
        args.shape, args.shape_batches, args.shape_output_len = "tiny", [2, 8], 16
        args.verify_batches, args.context = [1, 4], 64
    return args


# -- engines and arms ---------------------------------------------------------------------------------


def engine_pair(args: argparse.Namespace, spec: str, max_batch: int, max_len: int, **model) -> dict[str, LLMEngine]:
    """The `none` engine and the drafter's engine (`full` and `adaptive`), sized for max_batch samples
    of up to max_len tokens each. `model`: EngineConfig fields of the target and drafter."""
    kw = dict(device=args.device, num_kv_blocks=max_batch * (-(-(max_len + 2 * args.block) // 16) + 1) + 8,
              max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch * (args.block + 1)),
              enable_prefix_caching=False)
    draft = model.pop("draft", None) or embedded_draft(spec)
    spec_config = EngineConfig(spec=spec, draft=draft, spec_block_size=args.block, **model, **kw)
    return {"none": rollout.build_engine(EngineConfig(spec="none", **model, **kw)),
            "spec": rollout.build_engine(spec_config)}


def run_arm(engines: dict[str, LLMEngine], arm: str, groups: list[list], tag: str, device: str,
            fresh: bool = False) -> dict:
    """The workload (groups of requests run one group after another) on one arm; `fresh`: the adaptive
    budget starts from its prior (a new server's first batch, its cost model and graphs kept). An arm
    named "-sync" runs with overlapped scheduling off."""
    base = arm.removesuffix("-sync")
    engine = engines["none" if base == "none" else "spec"]
    engine.pipeline.enabled = base == arm
    budget = engine.spec_budget
    if base != "none":
        engine.scheduler.draft_budget = budget if base == "adaptive" else None
    if arm == "adaptive" and fresh:
        budget.forget_acceptance()
    before = dict(budget.totals) if budget is not None else {}
    drafts_before, proposals_before = engine.draft_counts.total()[0], _eager_proposals(engine)
    overlapped_before = engine.pipeline.overlapped_drafts
    gc.collect()  # (untimed: no run inherits a collection of the garbage the runs before it left)
    runs = [run_engine(engine, g, f"{tag}-{arm}-{i}", device) for i, g in enumerate(groups)]
    if arm == "full" and budget is not None:  # untimed: what full blocks' steps teach the budget (the engine
        budget.learn()  # records them) is learned here, not billed to the adaptive arm's first full choice
    tokens, seconds = sum(r.tokens for r in runs), sum(r.seconds for r in runs)
    accepts = [n for r in runs for o in r.outputs for n in o.accept_lengths[1:]]
    row = dict(arm=arm, tokens_per_s=tokens / seconds, seconds=seconds, tokens=tokens, steps=sum(r.steps for r in runs),
               mean_acceptance=statistics.fmean(accepts) if accepts else float("nan"),
               overlapped_drafts=engine.pipeline.overlapped_drafts - overlapped_before)
    engine.pipeline.enabled = True
    if base == "adaptive":
        spent = {k: budget.totals[k] - before.get(k, 0) for k in budget.totals}
        drafts = engine.draft_counts.total()[0] - drafts_before
        row.update(drafts_per_row=drafts / max(spent["decode_rows"], 1), probes=spent["probes"],
                   declined=spent["declined"], declined_eager=spent["declined_eager"],
                   draft_steps=spent["draft_steps"], draft_seconds=spent["draft_seconds"],
                   eager_draft_steps=spent["eager_draft_steps"], eager_draft_seconds=spent["eager_draft_seconds"],
                   eager_proposals=_eager_proposals(engine) - proposals_before)
        summary = budget.summary()  # (resets the budget's totals: read above)
        row.update(acceptance=summary["acceptance"], cost=summary["cost"])
    return row


def _eager_proposals(engine: LLMEngine) -> int:
    """The drafter's batched proposals so far that did not replay its CUDA graphs (0 for a drafter
    without them)."""
    drafter = engine.drafter
    graphs = getattr(drafter, "graphs", None)
    return getattr(drafter, "num_proposals", 0) - (graphs.num_replays if graphs is not None else 0)


def compare(engines: dict[str, LLMEngine], groups: list[list], setting: dict, args, result: dict,
            repeats: int | None = None) -> None:
    """Warm-up of every arm, then `repeats` rounds, each running every arm once, in turn; one row per
    arm: the run nearest the arm's median tokens/s, and `vs_none`, the median over rounds of the arm's
    tokens/s over `none`'s in the same round (so a host that drifts between rounds cancels out; the
    launch-bound embedded models' runs move by 20% from one round to the next)."""
    tag = "-".join(str(v) for v in setting.values())
    arms = ARMS + (tuple(f"{a}-sync" for a in ARMS) if args.sync_arms else ())
    for arm in ARMS:
        run_arm(engines, arm, groups, f"{tag}-warm", args.device)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(repeats or args.repeats):
        for arm in arms if r % 2 == 0 else arms[::-1]:  # (no arm always runs right after the same one)
            runs[arm].append(run_arm(engines, arm, groups, f"{tag}-{r}", args.device, args.fresh_start))
    hosts = host_profiles(engines, groups, tag, args) if args.host_profile else {}
    for arm in arms:
        row = dict(setting, **nearest_median(runs[arm], "tokens_per_s"))
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[arm], runs["none"])]
        row["vs_none"], row["vs_none_rounds"] = statistics.median(ratios), [round(x, 3) for x in ratios]
        if arm == "adaptive":  # the pair measured next to each other in every round
            paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[arm], runs["full"])]
            row["vs_full"], row["vs_full_rounds"] = statistics.median(paired), [round(x, 3) for x in paired]
        if f"{arm}-sync" in runs:  # what overlapped scheduling buys the arm, paired within rounds
            paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[arm], runs[f"{arm}-sync"])]
            row["vs_sync"], row["vs_sync_rounds"] = statistics.median(paired), [round(x, 3) for x in paired]
        if arm in hosts:
            row["host_ms_per_step"] = hosts[arm]
        result["rows"].append(row)
        write_json(args.out, result)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def host_profiles(engines: dict[str, LLMEngine], groups: list[list], tag: str, args) -> dict[str, dict]:
    """One more run of the full and adaptive arms under cProfile: per arm, the host milliseconds a step
    in every function and in rollout's own (self time, the top HOST_TOP of them), and the functions
    where adaptive spends the most more than full a step, printed."""
    per_step, totals = {}, {}
    for arm in ("full", "adaptive"):
        profile = cProfile.Profile()
        profile.enable()
        row = run_arm(engines, arm, groups, f"{tag}-host", args.device)
        profile.disable()
        own, every = collections.Counter(), 0.0
        for (path, line, name), (_, _, self_time, _, _) in pstats.Stats(profile).stats.items():
            every += self_time * 1e3 / row["steps"]
            if "/rollout/" in path:
                own[f"{path.split('/rollout/')[-1]}:{line}:{name}"] += self_time * 1e3 / row["steps"]
        per_step[arm], totals[arm] = own, every
    more = {k: per_step["adaptive"][k] - per_step["full"][k] for k in per_step["adaptive"]}
    print(f"{tag}: host ms a step (every function / rollout's own): full {totals['full']:.3f} / "
          f"{sum(per_step['full'].values()):.3f}, adaptive {totals['adaptive']:.3f} / "
          f"{sum(per_step['adaptive'].values()):.3f}; adaptive's most over full:", flush=True)
    for name, ms in sorted(more.items(), key=lambda kv: -kv[1])[:HOST_TOP]:
        print(f"  {ms:+.4f}  {name}", flush=True)
    return {arm: dict(every=round(totals[arm], 4), own=round(sum(own.values()), 4),
                      top={k: round(v, 4) for k, v in own.most_common(HOST_TOP)}) for arm, own in per_step.items()}


def requests(prompts: list[list[int]], sampling: dict, max_tokens) -> list:
    """(prompt, params, {}) per prompt, seeded; max_tokens: one for all, or one per prompt."""
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    return [(p, SamplingParams(**sampling, max_tokens=n, ignore_eos=True, seed=i), {})
            for i, (p, n) in enumerate(zip(prompts, lengths))]


# -- cases --------------------------------------------------------------------------------------------


def case_embedded(args: argparse.Namespace, result: dict, mode: str, batches: list[int]) -> None:
    prompts = heldout_prompts(max(max(batches), args.batch1_prompts))
    for spec in args.specs:
        engines = engine_pair(args, spec, max(batches), 256 + args.output_len)
        for batch in batches:
            chosen = prompts[: args.batch1_prompts] if batch == 1 else prompts[:batch]
            reqs = requests(chosen, SAMPLING[mode], args.output_len)
            groups = [reqs[i: i + batch] for i in range(0, len(reqs), batch)]
            compare(engines, groups, dict(case=f"embedded-{mode}", spec=spec, sampling=mode, batch=batch), args,
                    result, args.embedded_repeats)
        del engines
        free_memory()


def case_shape(args: argparse.Namespace, result: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model, draft = random_target_and_drafter(args.shape, args.device, Path(tmp), args.block)
        engines = engine_pair(args, "dflash", max(args.shape_batches), 128 + args.shape_output_len, model=model,
                              draft=draft, load_format="random")
        vocab = engines["none"].vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(128)] for _ in range(max(args.shape_batches))]
        for batch in args.shape_batches:
            reqs = requests(prompts[:batch], SAMPLING["t1"], args.shape_output_len)
            compare(engines, [reqs], dict(case="8b", spec=f"{args.shape} untrained dflash", sampling="t1",
                                          batch=batch), args, result)
        del engines
        free_memory()


def case_long_tail(args: argparse.Namespace, result: dict) -> None:
    """A quarter of the samples (every fourth) run 4x longer: wide at the start, a narrow tail."""
    n, short = args.tail_samples, args.output_len // 2
    lengths = [4 * short if i % 4 == 0 else short for i in range(n)]
    engines = engine_pair(args, "dflash", n, 256 + 4 * short)
    prompts = heldout_prompts(n)
    for mode in SAMPLING:
        compare(engines, [requests(prompts, SAMPLING[mode], lengths)],
                dict(case="long-tail", spec="dflash", sampling=mode, batch=n), args, result)
    del engines
    free_memory()


def time_step(model, caches, batch: int, q: int, context: int, iters: int) -> tuple[float, float | None]:
    """(eager ms, CUDA-graph ms) of one forward + LM head over `batch` sequences of `q` new tokens."""
    device = caches[0][0].device
    meta = metadata([q] * batch, [context + q - 1] * batch, device)
    ids = torch.randint(0, model.config.vocab_size, (q * batch,), device=device)  # [B * q]

    def step():
        return model.compute_logits(model(ids, meta, caches)[0])  # [B * q, V]

    return time_ms(step, device.type, iters), graph_ms(step, device.type, iters)


@torch.inference_mode()
def case_verify_cost(args: argparse.Namespace, result: dict) -> None:
    """One target forward + LM head: B x (block+1) verify tokens vs B decode tokens, eager and
    (on CUDA) replayed as a CUDA graph, as the engine runs uniform steps; the ratio uses the graph."""
    device, dtype, shape = torch.device(args.device), model_dtype(args.device), SHAPES[args.shape]
    torch.manual_seed(0)
    model = random_model(shape, device, dtype)
    per_seq = -(-(args.context + args.block + 1) // 16)
    caches = kv_caches(model, max(args.verify_batches) * per_seq + 1, device, dtype)
    kind = "graph" if device.type == "cuda" else "eager"
    for backend in ("triton", "torch") if device.type == "cuda" else ("torch",):
        model.set_kernel_backend(backend)
        for batch in args.verify_batches:
            row = dict(shape=args.shape, kernels=backend, batch=batch, context=args.context)
            for name, q in (("decode", 1), ("verify", args.block + 1)):
                eager, graph = time_step(model, caches, batch, q, args.context, iters=5 if args.quick else 20)
                row[f"{name}_eager_ms"], row[f"{name}_graph_ms"] = eager, graph
            row["verify_over_decode"] = row[f"verify_{kind}_ms"] / row[f"decode_{kind}_ms"]
            result["verify_cost"].append(row)
            write_json(args.out, result)
    model, caches = None, None
    free_memory()


# -- goals --------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.pool:
        rows = pooled_rows(args.pool)
        result = dict(args=vars(args), pooled=args.pool, rows=rows, goals=goals(rows))
        write_json(args.out, result)
        print_goals(result["goals"], f"pooled over {len(args.pool)} runs")
        print(f"wrote {args.out}")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    result = dict(args=vars(args), env=environment(args.device), rows=[], verify_cost=[], goals=[])
    if "verify-cost" in args.cases:
        case_verify_cost(args, result)
    if "embedded-t1" in args.cases:
        case_embedded(args, result, "t1", [2 if args.quick else 32])
    if "embedded-greedy" in args.cases:
        case_embedded(args, result, "greedy", [1, 4 if args.quick else 32])
    if "8b" in args.cases:
        case_shape(args, result)
    if "long-tail" in args.cases:
        case_long_tail(args, result)
    result["goals"] = goals(result["rows"])
    write_json(args.out, result)
    print_table(f"speculation: none / full blocks / adaptive budgets, block {args.block}", result["rows"],
                ["case", "spec", "sampling", "batch", "arm", "tokens_per_s", "vs_none", "vs_sync", "overlapped_drafts",
                 "mean_acceptance",
                 "drafts_per_row", "probes", "declined", "declined_eager", "steps", "draft_steps", "draft_seconds",
                 "eager_draft_steps", "eager_draft_seconds", "eager_proposals", "seconds"])
    print_goals(result["goals"])
    if result["verify_cost"]:
        print_table(f"verify forward ({args.block + 1} tokens/seq) vs decode step, {args.shape} random weights, "
                    f"context {args.context}", result["verify_cost"],
                    ["kernels", "batch", "decode_eager_ms", "verify_eager_ms", "decode_graph_ms", "verify_graph_ms",
                     "verify_over_decode"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
