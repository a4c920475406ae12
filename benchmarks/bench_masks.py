"""Cost of sampling masks and of grammar-constrained verify (issue 4), DFlash at block size 8.

Masks: 32 concurrent requests x 512 tokens (EOS ignored) on the embedded tiny Qwen3 with its
embedded DFlash drafter; throughput with support masks (temperature 1, top_k 64, top_p 0.95)
divided by throughput without masks at the same sampling parameters and seeds (so both runs
commit the same tokens). After a warm-up the two alternate (ABBA order); the ratio reported is
the median over rounds. Worst case: top_k 4096 at top_p 1.0 on a Qwen3-0.6B-shaped random
target (vocab 151936) with an untrained DFlash drafter, and top_k = the whole vocabulary on the
embedded model (it has only 264 tokens).

Grammar: the same embedded workload at 128 tokens with a never-ending regex (min_tokens =
max_tokens so EOS is never needed) against none; the cost is milliseconds per engine step.

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
    run_engine,
    write_config_dir,
    write_json,
)

from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.loader import load_model
from rollout.engine.params import SamplingParams

MASKED = dict(temperature=1.0, top_k=64, top_p=0.95)
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
    p.add_argument("--grammar-output-len", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/bench_masks.json")
    args = p.parse_args()
    if args.quick:
        args.requests, args.output_len, args.rounds = 4, 16, 2
        args.worst_shape, args.worst_top_k, args.worst_output_len, args.worst_rounds = "tiny", 512, 8, 1
        args.grammar_output_len = 16
    return args


def engine_for(model: str | None, draft: str, args: argparse.Namespace, load_format: str = "safetensors",
               max_len: int = 1024) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model, load_format=load_format, spec="dflash", draft=draft, spec_block_size=args.block,
        device=args.device, num_kv_blocks=args.requests * (max_len // 16 + 2) + 8, max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, 256 * args.requests), enable_prefix_caching=False,
    ))  # fmt: skip


def requests(prompts, sampling: dict, max_tokens: int, ignore_eos: bool = True, **extra) -> list:
    """One request per prompt, seeded by its index, exactly `max_tokens` tokens (min_tokens bans
    EOS until then; a grammar request may not set ignore_eos)."""
    return [(p, SamplingParams(**sampling, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=ignore_eos,
                               seed=i), extra) for i, p in enumerate(prompts)]  # fmt: skip


def alternate(engine: LLMEngine, prompts, sampling: dict, max_tokens: int, rounds: int, device: str,
              warm: bool = True) -> dict:
    """Masked vs unmasked throughput, alternating ABBA, after one untimed run of each if `warm`
    (which also captures the CUDA graphs of every step shape)."""
    arms = {"plain": requests(prompts, sampling, max_tokens),
            "masked": requests(prompts, sampling, max_tokens, mask="support")}  # fmt: skip
    for name, reqs in arms.items() if warm else ():
        run_engine(engine, reqs, f"warm-{name}", device)
    rates: dict[str, list[float]] = {"plain": [], "masked": []}
    for r in range(rounds):
        for name in ("plain", "masked") if r % 2 == 0 else ("masked", "plain"):
            run = run_engine(engine, arms[name], f"r{r}-{name}", device)
            assert run.tokens == len(prompts) * max_tokens, run.tokens
            rates[name].append(run.tokens_per_s)
    ratios = [m / p for m, p in zip(rates["masked"], rates["plain"])]
    return dict(plain_tokens_per_s=statistics.median(rates["plain"]),
                masked_tokens_per_s=statistics.median(rates["masked"]),
                median_ratio=statistics.median(ratios), ratios=ratios, rates=rates)  # fmt: skip


def bench_case(engine: LLMEngine, prompts, name: str, sampling: dict, rounds: int, args, result: dict,
               warm: bool = True) -> None:
    row = dict(model="embedded", case=name,
               **alternate(engine, prompts, sampling, args.output_len, rounds, args.device, warm))  # fmt: skip
    result["masks"].append(row)
    print({k: v for k, v in row.items() if k != "rates"}, flush=True)
    write_json(args.out, result)


def bench_grammar(engine: LLMEngine, prompts, args: argparse.Namespace) -> list[dict]:
    """ms per engine step with and without the regex grammar (same sampling, same prompts)."""
    try:
        from rollout.spec.grammar import GrammarSpec
    except ImportError as e:
        print(f"grammar: skipped ({e})", flush=True)
        return [dict(skipped=str(e))]
    arms = {"none": {}, "regex": dict(grammar=GrammarSpec("regex", GRAMMAR_REGEX))}
    runs: dict[str, list] = {name: [] for name in arms}
    for i in range(3):  # alternating rounds after a warm-up of each; the fastest round of each arm counts
        for name, extra in arms.items():
            reqs = requests(prompts, MASKED, args.grammar_output_len, ignore_eos=False, **extra)
            if i == 0:
                run_engine(engine, reqs, f"warm-g-{name}", args.device)
            runs[name].append(run_engine(engine, reqs, f"g-{name}-{i}", args.device))
    rows = []
    for name, arm_runs in runs.items():
        run = min(arm_runs, key=lambda r: r.seconds / r.steps)
        rows.append(dict(grammar=name, ms_per_step=run.seconds / run.steps * 1e3, steps=run.steps,
                         tokens_per_s=run.tokens_per_s, mean_acceptance=run.mean_acceptance(),
                         rounds_ms_per_step=[r.seconds / r.steps * 1e3 for r in arm_runs]))  # fmt: skip
        print(rows[-1], flush=True)
    rows[-1]["extra_ms_per_step"] = rows[-1]["ms_per_step"] - rows[0]["ms_per_step"]
    return rows


def bench_worst_case(args: argparse.Namespace, result: dict) -> None:
    """top_k `--worst-top-k` on a large-vocabulary random target with an untrained drafter."""
    from rollout.spec.draft_loader import random_drafter, save_drafter

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config_dir(SHAPES[args.worst_shape], Path(tmp) / "target")
        target = load_model(model_dir, args.device, load_format="random")
        draft = random_drafter(target, "dflash", block_size=args.block, num_layers=1, seed=1)
        save_drafter(draft, Path(tmp) / "dflash")
        del target, draft
        free_memory()
        engine = engine_for(str(model_dir), str(Path(tmp) / "dflash"), args, load_format="random",
                            max_len=32 + args.worst_output_len + 2 * args.block)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, engine.vocab_size, (args.requests, 32), generator=gen).tolist()
    sampling = dict(temperature=1.0, top_k=args.worst_top_k, top_p=1.0)
    row = dict(model=f"{args.worst_shape} random + random dflash", case=f"top_k {args.worst_top_k}, top_p 1.0",
               **alternate(engine, prompts, sampling, args.worst_output_len, args.worst_rounds, args.device))
    result["masks"].append(row)
    print({k: v for k, v in row.items() if k != "rates"}, flush=True)
    del engine
    free_memory()


def main() -> None:
    """Cases in order of importance (a time limit may cut the run; results are written as they come):
    top_k 64 ratio, grammar cost, top_k 4096 worst case, then the embedded whole-vocabulary case."""
    args = parse_args()
    result = dict(args=vars(args), env=environment(args.device), masks=[], grammar=[])
    draft = args.dflash or embedded_draft("dflash")
    result["dflash"] = draft
    if draft is None:
        print("embedded DFlash drafter not in the repository yet: embedded-model cases skipped", flush=True)
        bench_worst_case(args, result)
    else:
        engine = engine_for(None, draft, args, max_len=256 + args.output_len + 2 * args.block)
        prompts = heldout_prompts(args.requests)
        bench_case(engine, prompts, "top_k 64, top_p 0.95", MASKED, args.rounds, args, result)
        result["grammar"] = bench_grammar(engine, prompts, args)
        write_json(args.out, result)
        bench_worst_case(args, result)
        whole = dict(temperature=1.0, top_k=engine.vocab_size)
        bench_case(engine, prompts, f"top_k {engine.vocab_size} (whole vocab)", whole, 1, args, result, warm=False)
        del engine
    write_json(args.out, result)
    print_table(
        f"support masks vs none, {args.requests} requests, DFlash block {args.block}, median of alternating "
        f"rounds (goal: top_k 64 ratio >= 0.99)", result["masks"],
        ["model", "case", "plain_tokens_per_s", "masked_tokens_per_s", "median_ratio"],
    )
    print_table(f"grammar-constrained verify, regex {GRAMMAR_REGEX!r}", result["grammar"],
                ["grammar", "ms_per_step", "extra_ms_per_step", "steps", "tokens_per_s", "mean_acceptance"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
