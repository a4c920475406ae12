"""The rollout-history drafter (issue 23), the "Epochs" case: RL revisits its prompts, so the
samples of earlier epochs predict the next ones. 64 prompts x n=8 for 4 epochs at temperature 1
on the embedded pair (tiny Qwen3 target, its DFlash drafter), rollout time per epoch with no
speculation, DFlash alone, `--spec history` alone and both (`--spec dflash+history`: per request and
step, the proposer with the higher expected accepted length drafts), in one run.

Prompts: the first `--prompt-len` bytes of held-out stdlib files (scripts/corpus.py); each epoch is
one rollout of all 64 prompts (one request each, n=8, EOS ends a sample, `--output-len` at most),
seeded per epoch (1000 + epoch) alike for every arm. Each arm runs the epoch alone, one after another
(common.run_in_turn, the order reversed every other epoch): arms stepped in turn would share the
device's stream, one engine's step launched ahead falling inside another's time and draft budget
(until session 15 they were, and the DFlash arm's budget then drafted full blocks at 0.45x none's
speed). Before epoch 1 every
engine warms up on other prompts (CUDA graphs, Triton kernels); the history keeps those too.
Between epochs (the gap between rollouts, untimed) the history arms wait until their worker thread
has stored the epoch's samples (rollout.spec.history_store); within an epoch it stores them while
the engines step (its time is not any arm's, and it shares the GIL with all of them).

Reported per arm and epoch: seconds, output tokens, tokens/s, steps, committed tokens per verify
step, the fraction of drafts accepted, the history's share of the drafts, and the epoch time
relative to none and to DFlash; then the issue's goal: epochs 2-4 at least 25% faster with history
and DFlash together than with DFlash alone (`goal` in the JSON).

    python benchmarks/bench_history.py --device cuda            # ~3 min on an H200
    python benchmarks/bench_history.py --device cpu --quick     # a small run: checks the script
"""

from __future__ import annotations

import argparse

import torch
from common import embedded_draft, environment, heldout_prompts, print_table, run_in_turn, write_json

import rollout
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams

ARMS = ("none", "dflash", "history", "dflash+history")
GOAL = 0.25  # epochs 2.. at least this much faster with dflash+history than with dflash alone


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="4 prompts x n=2, 2 epochs, 24 tokens (CPU check)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--no-overlap", action="store_true", help="every arm with overlapped scheduling off")
    add_workload_args(p, prompts=64, prompt_len=128, output_len=256, out="benchmarks/results/bench_history.json")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.n, args.epochs, args.prompt_len, args.output_len = 4, 2, 2, 32, 24
    return args


def add_workload_args(p: argparse.ArgumentParser, prompts: int, prompt_len: int, output_len: int, out: str) -> None:
    """The epoch workload's options (this script's and profile_history.py's)."""
    p.add_argument("--prompts", type=int, default=prompts)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=prompt_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--block", type=int, default=8, help="draft block of DFlash and history")
    p.add_argument("--out", default=out)


def build(arm: str, args: argparse.Namespace, **config) -> LLMEngine:
    """The arm's engine sized for the workload; `config`: further EngineConfig fields."""
    samples = args.prompts * args.n
    per_seq = -(-(args.prompt_len + args.output_len + args.block + 1) // 16) + 1
    return rollout.build_engine(EngineConfig(
        spec=arm, draft=embedded_draft("dflash") if arm.startswith("dflash") else None,
        spec_block_size=None if arm == "none" else args.block, device=args.device,
        num_kv_blocks=samples * per_seq + 16, max_num_seqs=samples,
        max_num_batched_tokens=max(2048, samples * (args.block + 1)), **config,
    ))  # fmt: skip


def epoch_requests(prompts: list[list[int]], args: argparse.Namespace, seed: int) -> list:
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, seed=seed)
    return [(prompt, params, dict(n=args.n)) for prompt in prompts]


def draft_totals(engine: LLMEngine) -> dict[str, tuple[int, int]]:
    """Draft tokens (proposed, accepted) by proposer, over every policy version so far."""
    totals: dict[str, tuple[int, int]] = {}
    for (name, _), (p, a) in engine.draft_counts.by_key.items():
        before = totals.get(name, (0, 0))
        totals[name] = (before[0] + p, before[1] + a)
    return totals


def row_of(arm: str, epoch: int, run, before: dict, after: dict) -> dict:
    steps = [n for o in run.outputs for n in o.accept_lengths[1:]]
    delta = {name: (p - before.get(name, (0, 0))[0], a - before.get(name, (0, 0))[1])
             for name, (p, a) in after.items()}
    proposed, accepted = sum(p for p, _ in delta.values()), sum(a for _, a in delta.values())
    return dict(arm=arm, epoch=epoch, seconds=run.seconds, tokens=run.tokens, tokens_per_s=run.tokens_per_s,
                steps=run.steps, tokens_per_verify_step=sum(steps) / max(len(steps), 1),
                draft_acceptance=accepted / proposed if proposed else None,
                history_share=delta.get("history", (0, 0))[0] / proposed if proposed else None,
                drafts_by_proposer=delta)


def flush(engines: dict[str, LLMEngine]) -> None:
    """The history arms' finished samples stored (their worker thread), between epochs."""
    for engine in engines.values():
        if hasattr(engine.drafter, "flush"):
            engine.drafter.flush()


def run_epochs(engines: dict[str, LLMEngine], prompts: list[list[int]], args, result: dict) -> None:
    for epoch in range(1, args.epochs + 1):
        before = {arm: draft_totals(e) for arm, e in engines.items()}
        requests = {arm: epoch_requests(prompts, args, 1000 + epoch) for arm in engines}
        runs = run_in_turn(engines, requests, f"epoch{epoch}", args.device, reverse=epoch % 2 == 0)
        flush(engines)
        rows = {arm: row_of(arm, epoch, runs[arm], before[arm], draft_totals(engines[arm])) for arm in engines}
        for row in rows.values():
            row["time_vs_none"] = row["seconds"] / rows["none"]["seconds"]
            if "dflash" in rows:
                row["time_vs_dflash"] = row["seconds"] / rows["dflash"]["seconds"]
            result["epochs"].append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        write_json(args.out, result)


def goal(epochs: list[dict]) -> dict | None:
    """Epochs 2.. with history and DFlash together against DFlash alone (None: an arm is missing)."""
    later = [r for r in epochs if r["epoch"] >= 2]
    both = sum(r["seconds"] for r in later if r["arm"] == "dflash+history")
    alone = sum(r["seconds"] for r in later if r["arm"] == "dflash")
    if not both or not alone:
        return None
    faster = 1 - both / alone
    return dict(epochs=sorted({r["epoch"] for r in later}), dflash_seconds=alone, combined_seconds=both,
                faster=faster, goal=GOAL, met=faster >= GOAL)

def history_stats(engine: LLMEngine) -> dict:
    drafter = engine.drafter
    store = getattr(drafter, "history", drafter).store  # (the combined drafter holds a HistoryDrafter)
    return dict(stored_tokens=store.history.num_tokens, prompts=len(store.history.prompts), dropped=store.dropped)


def main() -> None:
    args = parse_args()
    result = dict(args=vars(args), env=environment(args.device), epochs=[])
    arms = [arm for arm in args.arms if not arm.startswith("dflash") or embedded_draft("dflash")]
    engines = {arm: build(arm, args, overlap=not args.no_overlap) for arm in arms}
    warm = heldout_prompts(args.prompts + 8, args.prompt_len)[args.prompts:]
    run_in_turn(engines, {arm: epoch_requests(warm, args, 7) for arm in engines}, "warmup", args.device)
    flush(engines)
    run_epochs(engines, heldout_prompts(args.prompts, args.prompt_len), args, result)
    result["history"] = {arm: history_stats(engine) for arm, engine in engines.items() if "history" in arm}
    print_table(
        f"epochs: {args.prompts} prompts x n={args.n}, temperature 1, up to {args.output_len} tokens, block "
        f"{args.block}, {args.device}", result["epochs"],
        ["arm", "epoch", "seconds", "tokens", "tokens_per_s", "steps", "tokens_per_verify_step", "draft_acceptance",
         "history_share", "time_vs_none", "time_vs_dflash"],
    )
    result["goal"] = goal(result["epochs"])
    print(f"goal (epochs 2.. >= {GOAL:.0%} faster with dflash+history than dflash): {result['goal']}")
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    main()
