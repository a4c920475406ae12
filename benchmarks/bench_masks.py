"""Cost of sampling masks and of grammar-constrained verify (issue 4), DFlash at block size 8.

Masks: 32 concurrent requests x 512 tokens (EOS ignored) on the embedded tiny Qwen3 with its
embedded DFlash drafter; throughput with support masks (temperature 1, top_k 64, top_p 0.95)
divided by throughput without masks at the same sampling parameters and seeds (so both arms
commit the same tokens). Each arm has its own engine and the two engines are stepped in turn,
one step each, every step timed to its arm (`common.run_interleaved`): on a shared host whose
speed drifts by tens of percent between back-to-back runs, that is what keeps a 1% difference
measurable. Reported per case: the median over rounds of the per-round ratio, and the ratio of
the arms' totals. Worst case: top_k 4096 at top_p 1.0 on a Qwen3-0.6B-shaped random
target (vocab 151936) with an untrained DFlash drafter, and top_k = the whole vocabulary on the
embedded model (it has only 264 tokens). Large: the top_k 64 workload on a Qwen3-8B-shaped random
target with an untrained DFlash drafter (`--large-shape`), where a step is mostly GPU time rather
than the tiny model's launch overhead.

Grammar: the same embedded workload at 128 tokens with a never-ending regex (min_tokens =
max_tokens so EOS is never needed) against none, the two engines stepped in turn; the cost is
milliseconds per engine step (median over rounds of the per-round difference).

    python benchmarks/bench_masks.py --device cuda
    python benchmarks/bench_masks.py --device cpu --quick --dflash DIR   # script check
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from common import (
    SHAPES,
    embedded_draft,
    environment,
    free_memory,
    heldout_prompts,
    print_table,
    run_interleaved,
    write_config_dir,
    write_json,
)

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.loader import load_model
from rollout.engine.params import SamplingParams

MASKED = dict(temperature=1.0, top_k=64, top_p=0.95)
CASES = ("top_k64", "grammar", "worst", "whole_vocab", "large")
# Python-looking lines, repeated without end: the regex never forces a stop.
GRAMMAR_REGEX = r"(    [a-z_]{1,16}( = | == |\()[a-z_0-9., ()]{0,40}\n)+"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="short runs, tiny worst-case shape (CPU check)")
    p.add_argument("--dflash", default=None, help="DFlash drafter dir (default: the embedded one)")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worst-shape", default="qwen3-0.6b", choices=list(SHAPES))
    p.add_argument("--worst-top-k", type=int, default=4096)
    p.add_argument("--worst-output-len", type=int, default=128)
    p.add_argument("--worst-rounds", type=int, default=2)
    p.add_argument("--large-shape", default="qwen3-8b", choices=list(SHAPES))
    p.add_argument("--large-rounds", type=int, default=3)
    p.add_argument("--grammar-output-len", type=int, default=128)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES),
                   help="which cases to run (default: all, in this order)")
    p.add_argument("--out", default="benchmarks/results/bench_masks.json")
    args = p.parse_args()
    if args.quick:
        args.requests, args.output_len, args.rounds = 4, 16, 2
        args.worst_shape, args.worst_top_k, args.worst_output_len, args.worst_rounds = "tiny", 512, 8, 1
        args.grammar_output_len = 16
        args.large_shape, args.large_rounds = "tiny", 1
    return args


def engine_for(model: str | None, draft: str, args: argparse.Namespace, load_format: str = "safetensors",
               max_len: int = 1024) -> LLMEngine:
    return build_engine(EngineConfig(
        model=model, load_format=load_format, spec="dflash", draft=draft, spec_block_size=args.block,
        device=args.device, num_kv_blocks=args.requests * (max_len // 16 + 2) + 8, max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, 256 * args.requests), enable_prefix_caching=False,
    ))  # fmt: skip


def requests(prompts, sampling: dict, max_tokens: int, ignore_eos: bool = True, **extra) -> list:
    """One request per prompt, seeded by its index, exactly `max_tokens` tokens (min_tokens bans
    EOS until then; a grammar request may not set ignore_eos)."""
    return [(p, SamplingParams(**sampling, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=ignore_eos,
                               seed=i), extra) for i, p in enumerate(prompts)]  # fmt: skip


def interleaved(engines: dict[str, LLMEngine], arms: dict[str, list], rounds: int, device: str,
                warm: bool = True) -> dict:
    """Throughput of each arm on its own engine, the engines stepped in turn (`run_interleaved`),
    after one untimed round if `warm` (which also captures the CUDA graphs of every step shape);
    the first arm goes first in even rounds, second in odd ones. Per round the ratio of the second
    arm's tokens/s to the first's; reported: their median and the ratio of the arms' totals."""
    first, second = list(arms)
    if warm:
        run_interleaved(engines, arms, "warm", device)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    totals = {name: [0, 0.0] for name in arms}
    steps: dict[str, list[int]] = {name: [] for name in arms}
    for r in range(rounds):
        order = [first, second] if r % 2 == 0 else [second, first]
        runs = run_interleaved({name: engines[name] for name in order}, arms, f"r{r}", device)
        for name, run in runs.items():
            rates[name].append(run.tokens_per_s)
            totals[name][0] += run.tokens
            totals[name][1] += run.seconds
            steps[name].append(run.steps)
        assert runs[first].tokens == runs[second].tokens, {n: run.tokens for n, run in runs.items()}
    ratios = [b / a for a, b in zip(rates[first], rates[second])]
    return dict(**{f"{name}_tokens_per_s": statistics.median(rates[name]) for name in arms},
                median_ratio=statistics.median(ratios), total_ratio=(totals[second][0] / totals[second][1]) /
                (totals[first][0] / totals[first][1]), ratios=ratios, rates=rates, steps=steps)  # fmt: skip


def bench_case(engines: dict[str, LLMEngine], prompts, name: str, sampling: dict, rounds: int, args, result: dict,
               max_tokens: int | None = None, warm: bool = True, model: str = "embedded") -> None:
    """Support masks (second arm) against none (first), same sampling and seeds: the same tokens."""
    max_tokens = max_tokens or args.output_len
    arms = {"plain": requests(prompts, sampling, max_tokens),
            "masked": requests(prompts, sampling, max_tokens, mask="support")}  # fmt: skip
    row = dict(model=model, case=name, **interleaved(engines, arms, rounds, args.device, warm))
    result["masks"].append(row)
    print({k: v for k, v in row.items() if k not in ("rates", "steps")}, flush=True)
    write_json(args.out, result)


def bench_grammar(engines: dict[str, LLMEngine], prompts, args: argparse.Namespace) -> list[dict]:
    """ms per engine step with and without the regex grammar (same sampling, same prompts),
    the two engines stepped in turn."""
    try:
        from rollout.engine.grammar import GrammarSpec
    except ImportError as e:
        print(f"grammar: skipped ({e})", flush=True)
        return [dict(skipped=str(e))]
    arms = {name: requests(prompts, MASKED, args.grammar_output_len, ignore_eos=False, **extra)
            for name, extra in (("none", {}), ("regex", dict(grammar=GrammarSpec("regex", GRAMMAR_REGEX))))}
    engines = dict(zip(arms, engines.values()))
    run_interleaved(engines, arms, "warm-g", args.device)
    runs: dict[str, list] = {name: [] for name in arms}
    for i in range(args.rounds):
        order = list(arms) if i % 2 == 0 else list(arms)[::-1]
        for name, run in run_interleaved({n: engines[n] for n in order}, arms, f"g{i}", args.device).items():
            runs[name].append(run)
    rows = []
    for name, arm_runs in runs.items():
        ms = [r.seconds / r.steps * 1e3 for r in arm_runs]
        rows.append(dict(grammar=name, ms_per_step=statistics.median(ms), steps=arm_runs[0].steps,
                         tokens_per_s=statistics.median(r.tokens_per_s for r in arm_runs),
                         mean_acceptance=arm_runs[0].mean_acceptance(), rounds_ms_per_step=ms))  # fmt: skip
        print(rows[-1], flush=True)
    extra = [g - n for n, g in zip(rows[0]["rounds_ms_per_step"], rows[1]["rounds_ms_per_step"])]
    rows[-1]["extra_ms_per_step"] = statistics.median(extra)
    return rows


def bench_random_case(args: argparse.Namespace, result: dict, shape: str, sampling: dict, max_tokens: int,
                      rounds: int) -> None:
    """Support masks against none on a random target of `shape` with an untrained DFlash drafter
    (its drafts are almost never accepted: about one token per step)."""
    from rollout.spec.draft_loader import random_drafter, save_drafter

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config_dir(SHAPES[shape], Path(tmp) / "target")
        target = load_model(model_dir, args.device, load_format="random")
        draft = random_drafter(target, "dflash", block_size=args.block, num_layers=1, seed=1)
        save_drafter(draft, Path(tmp) / "dflash")
        del target, draft
        free_memory()
        max_len = 32 + max_tokens + 2 * args.block
        engines = {arm: engine_for(str(model_dir), str(Path(tmp) / "dflash"), args, load_format="random",
                                   max_len=max_len) for arm in ("plain", "masked")}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, engines["plain"].vocab_size, (args.requests, 32), generator=gen).tolist()
    name = ", ".join(f"{k} {v}" for k, v in sampling.items() if k != "temperature")
    bench_case(engines, prompts, name, sampling, rounds, args, result, max_tokens=max_tokens,
               model=f"{shape} random + random dflash")
    del engines
    free_memory()


def bench_worst_case(args: argparse.Namespace, result: dict) -> None:
    """top_k `--worst-top-k` at top_p 1.0 on a large-vocabulary random target."""
    bench_random_case(args, result, args.worst_shape, dict(temperature=1.0, top_k=args.worst_top_k, top_p=1.0),
                      args.worst_output_len, args.worst_rounds)


def bench_large_case(args: argparse.Namespace, result: dict) -> None:
    """The top_k 64 workload on a target whose step is GPU time, not launch overhead."""
    bench_random_case(args, result, args.large_shape, MASKED, args.output_len, args.large_rounds)


def main() -> None:
    """Cases in order of importance (a time limit may cut the run; results are written as they come):
    top_k 64 ratio, grammar cost, top_k 4096 worst case, then the embedded whole-vocabulary case."""
    args = parse_args()
    result = dict(args=vars(args), env=environment(args.device), masks=[], grammar=[])
    draft = args.dflash or embedded_draft("dflash")
    result["dflash"] = draft
    if draft is None:
        print("embedded DFlash drafter not in the repository yet: embedded-model cases skipped", flush=True)
        if "worst" in args.cases:
            bench_worst_case(args, result)
        if "large" in args.cases:
            bench_large_case(args, result)
    else:
        max_len = 256 + args.output_len + 2 * args.block
        engines = {arm: engine_for(None, draft, args, max_len=max_len) for arm in ("plain", "masked")}
        prompts = heldout_prompts(args.requests)
        if "top_k64" in args.cases:
            bench_case(engines, prompts, "top_k 64, top_p 0.95", MASKED, args.rounds, args, result)
        if "grammar" in args.cases:
            result["grammar"] = bench_grammar(engines, prompts, args)
            write_json(args.out, result)
        if "worst" in args.cases:
            bench_worst_case(args, result)
        if "large" in args.cases:
            bench_large_case(args, result)
        if "whole_vocab" in args.cases:
            vocab = engines["plain"].vocab_size
            whole = dict(temperature=1.0, top_k=vocab)
            bench_case(engines, prompts, f"top_k {vocab} (whole vocab)", whole, 2, args, result)
        del engines
    write_json(args.out, result)
    print_table(
        f"support masks vs none, {args.requests} requests, DFlash block {args.block}, two engines stepped in turn "
        f"(goal: top_k 64 ratio >= 0.99)", result["masks"],
        ["model", "case", "plain_tokens_per_s", "masked_tokens_per_s", "median_ratio", "total_ratio"],
    )
    if result["grammar"]:
        print_table(f"grammar-constrained verify, regex {GRAMMAR_REGEX!r}", result["grammar"],
                    ["grammar", "ms_per_step", "extra_ms_per_step", "steps", "tokens_per_s", "mean_acceptance"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
