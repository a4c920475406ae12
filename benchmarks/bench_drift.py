"""Drafter drift and online refresh (issue 23, the "Drift" case), on the embedded pair (tiny Qwen3
target, its DFlash drafter), side by side in one run.

Policy v1: the embedded target fine-tuned briefly (`--finetune-steps` AdamW steps on 256-byte windows)
on text it was not trained on: this repository's documentation (README.md, BENCHMARKS.md, docs/*.md;
the target learnt Python sources). Each arm's engine gets v1 by `update_weights` before the rollouts.
Arms:
* `off`: the embedded DFlash drafter, as shipped (trained for v0);
* `refresh`: the same, with `--drafter-refresh` (`--mode`, default idle) from the push on;
* `offline`: a drafter trained offline for v1: the embedded drafter trained by the refresh's trainer
  (rollout.spec.refresh, the same objective) for `--offline-seconds` on v1's own rollouts of other
  prompts (as many tokens as the measured rollouts), then frozen.
Rollouts: rounds of `--prompts` documentation prompts (`--prompt-len` bytes) x n at temperature 1,
seeded per round alike for every arm, each arm's round run alone, one after another (common.run_in_turn,
the order reversed every other round; arms stepped in turn would share the device's stream), until
`--rollout-tokens` output tokens. Between rounds the idle refresh arm's engine gets its idle slices
(what the gap between rollouts gives it; untimed, reported as idle_train_seconds). Reported per
arm and round: cumulative tokens, the fraction of drafts accepted in the round, committed tokens per
verify step, tokens/s, and for the refresh arm the training time inside its steps. Goal (the issue):
the refresh arm's acceptance in the last round >= 90% of the offline drafter's, with its rollout
tokens/s no more than 5% below `off`'s: the training inside steps at most 5% of its time, and its
tokens/s over all rounds at least 0.95 of `off`'s (`goal` in the JSON).

    python benchmarks/bench_drift.py --device cuda            # the issue's run: 100k rollout tokens
    python benchmarks/bench_drift.py --device cpu --quick     # a small run: checks the script
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import embedded_draft, environment, print_table, run_engine, run_in_turn, write_json

import rollout
from rollout.engine.config import DEFAULT_MODEL, EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GOAL_ACCEPTANCE, GOAL_SLOWDOWN = 0.90, 0.05


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="a few steps and tokens (CPU check)")
    p.add_argument("--finetune-steps", type=int, default=300)
    p.add_argument("--finetune-lr", type=float, default=3e-4)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rollout-tokens", type=int, default=100_000)
    p.add_argument("--mode", default="idle", choices=("idle", "always"))
    p.add_argument("--refresh-lr", type=float, default=3e-4)
    p.add_argument("--refresh-ms", type=float, default=20.0)
    p.add_argument("--refresh-share", type=float, default=0.04, help="--drafter-refresh-share")
    p.add_argument("--refresh-tokens", type=int, default=1 << 16)
    p.add_argument("--offline-seconds", type=float, default=120.0)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/bench_drift.json")
    args = p.parse_args()
    if args.quick:
        args.finetune_steps, args.prompts, args.n, args.prompt_len, args.output_len = 5, 4, 2, 32, 24
        args.rollout_tokens, args.offline_seconds = 400, 2.0
    return args


def docs_text() -> bytes:
    paths = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    return b"\n\n".join(p.read_bytes() for p in paths if p.is_file())


def finetune_v1(args: argparse.Namespace, text: bytes) -> dict[str, torch.Tensor]:
    """The embedded target after `finetune_steps` steps on the first 80% of `text` (byte tokens)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).to(args.device)
    data = torch.tensor(list(text[: int(len(text) * 0.8)]), device=args.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    opt = torch.optim.AdamW(hf.parameters(), lr=args.finetune_lr)
    hf.train()
    for step in range(args.finetune_steps):
        starts = torch.randint(0, len(data) - 257, (16,), generator=gen).tolist()
        batch = torch.stack([data[s : s + 257] for s in starts])  # [16, 257]
        loss = hf(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == args.finetune_steps - 1:
            print(f"finetune step {step} loss {loss.item():.4f}", flush=True)
    return {k: v.detach().to("cpu").contiguous() for k, v in hf.state_dict().items()}


def prompts_of(text: bytes, count: int, length: int, offset: int) -> list[list[int]]:
    """`count` prompts of `length` bytes from the last 20% of `text`, every other slice from `offset`."""
    tail = text[int(len(text) * 0.8):]
    step = max(1, (len(tail) - length) // (2 * count + 1))
    return [list(tail[(2 * i + offset) * step : (2 * i + offset) * step + length]) for i in range(count)]


def build(args: argparse.Namespace, draft: str, refresh: str) -> LLMEngine:
    samples = args.prompts * args.n
    per_seq = -(-(args.prompt_len + args.output_len + args.block + 1) // 16) + 1
    return rollout.build_engine(EngineConfig(
        spec="dflash", draft=draft, spec_block_size=args.block, device=args.device,
        num_kv_blocks=samples * per_seq + 16, max_num_seqs=samples,
        max_num_batched_tokens=max(2048, samples * (args.block + 1)), drafter_refresh=refresh,
        drafter_refresh_lr=args.refresh_lr, drafter_refresh_ms=args.refresh_ms,
        drafter_refresh_share=args.refresh_share,
        drafter_refresh_tokens=args.refresh_tokens,
    ))  # fmt: skip


def round_requests(prompts: list[list[int]], args: argparse.Namespace, seed: int) -> list:
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, seed=seed)
    return [(prompt, params, dict(n=args.n)) for prompt in prompts]


def offline_drafter(args: argparse.Namespace, v1: dict, prompts: list[list[int]], out: Path) -> str:
    """The embedded drafter trained for `offline_seconds` on v1's rollouts of `prompts` (module docstring)."""
    engine = build(args, embedded_draft("dflash"), "idle")
    engine.update_weights(v1)
    refresh, tokens, seed = engine.drafter.refresh, 0, 500
    while tokens < min(args.rollout_tokens, refresh.capacity):
        run = run_engine(engine, round_requests(prompts, args, seed), f"o{seed}", args.device)
        tokens, seed = tokens + run.tokens, seed + 1
    start = time.perf_counter()
    while time.perf_counter() - start < args.offline_seconds:
        refresh.train_step()
    refresh.begin_step([])  # the trained weights into the drafter
    config, data = engine.drafter.checkpoint()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config)
    (out / "model.safetensors").write_bytes(data)
    print(f"offline drafter: {refresh.stats.steps} steps on {tokens} tokens, loss {refresh.stats.loss:.4f}")
    return str(out)


def draft_totals(engine: LLMEngine) -> tuple[int, int]:
    return tuple(sum(v[i] for v in engine.draft_counts.by_key.values()) for i in (0, 1))


def run_rounds(engines: dict[str, LLMEngine], prompts: list[list[int]], args, result: dict) -> None:
    cumulative, idle_s, train_s = dict.fromkeys(engines, 0), 0.0, 0.0
    for round_index in range(10_000):
        if min(cumulative.values()) >= args.rollout_tokens:
            return
        before = {arm: draft_totals(e) for arm, e in engines.items()}
        in_steps = engines["refresh"].drafter.refresh.stats.seconds
        runs = run_in_turn(engines, {arm: round_requests(prompts, args, 1000 + round_index) for arm in engines},
                           f"r{round_index}", args.device, reverse=round_index % 2 == 1)
        train_s = engines["refresh"].drafter.refresh.stats.seconds - in_steps
        start = time.perf_counter()
        while engines["refresh"].idle_work():  # the gap between rollouts
            pass
        idle_s += time.perf_counter() - start
        for arm, run in runs.items():
            cumulative[arm] += run.tokens
            proposed, accepted = (a - b for a, b in zip(draft_totals(engines[arm]), before[arm]))
            row = dict(arm=arm, round=round_index, tokens=cumulative[arm], seconds=run.seconds,
                       tokens_per_s=run.tokens_per_s, tokens_per_verify_step=run.mean_acceptance(),
                       draft_acceptance=accepted / proposed if proposed else None)
            if arm == "refresh":
                row |= dict(train_seconds_in_steps=train_s, idle_train_seconds=idle_s,
                            refresh_steps=engines[arm].drafter.refresh.stats.steps)
            result["rounds"].append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        write_json(args.out, result)


def goal(rounds: list[dict]) -> dict:
    last = {r["arm"]: r for r in rounds if r["round"] == max(x["round"] for x in rounds)}
    refresh, offline = last["refresh"]["draft_acceptance"], last["offline"]["draft_acceptance"]
    ratio = None if refresh is None or offline is None else refresh / max(offline, 1e-9)  # (None: no draft verified)
    seconds = {arm: sum(r["seconds"] for r in rounds if r["arm"] == arm) for arm in ("off", "refresh")}
    in_steps = sum(r["train_seconds_in_steps"] for r in rounds if r["arm"] == "refresh")
    slowdown = in_steps / max(seconds["refresh"], 1e-9)
    rate = {arm: last[arm]["tokens"] / max(seconds[arm], 1e-9) for arm in ("off", "refresh")}  # (cumulative tokens)
    throughput = rate["refresh"] / max(rate["off"], 1e-9)
    return dict(acceptance_vs_offline=ratio, acceptance_goal=GOAL_ACCEPTANCE, training_share_of_refresh_time=slowdown,
                throughput_vs_off=throughput, slowdown_goal=GOAL_SLOWDOWN,
                met=(ratio is not None and ratio >= GOAL_ACCEPTANCE and slowdown <= GOAL_SLOWDOWN
                     and throughput >= 1 - GOAL_SLOWDOWN))


def main() -> None:
    args = parse_args()
    if embedded_draft("dflash") is None:
        raise SystemExit("the embedded DFlash drafter is not in this checkout")
    result = dict(args=vars(args), env=environment(args.device), rounds=[])
    text = docs_text()
    v1 = finetune_v1(args, text)
    with tempfile.TemporaryDirectory() as tmp:
        offline = offline_drafter(args, v1, prompts_of(text, args.prompts, args.prompt_len, 1), Path(tmp) / "d")
        engines = {"off": build(args, embedded_draft("dflash"), "off"),
                   "refresh": build(args, embedded_draft("dflash"), args.mode),
                   "offline": build(args, offline, "off")}
    for engine in engines.values():
        engine.update_weights(v1)
    run_rounds(engines, prompts_of(text, args.prompts, args.prompt_len, 0), args, result)
    print_table(f"drift: v1 = target + {args.finetune_steps} steps on docs; {args.prompts} prompts x n={args.n}, "
                f"temperature 1, up to {args.output_len} tokens, block {args.block}, refresh {args.mode}, "
                f"{args.device}", result["rounds"],
                ["arm", "round", "tokens", "seconds", "tokens_per_s", "tokens_per_verify_step", "draft_acceptance",
                 "train_seconds_in_steps", "idle_train_seconds", "refresh_steps"])
    result["goal"] = goal(result["rounds"])
    print(f"goal: {result['goal']}")
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    main()
