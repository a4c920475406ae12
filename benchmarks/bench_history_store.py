"""What the rollout-history store's worker costs the engine thread (issue 23): step time while it builds.

The history store (rollout.spec.history_store) builds its suffix automata in pure Python on a
worker thread of the engine's process. The engine thread gives the GIL up at every torch call and
waits to get it back; a launch-bound step (the embedded models, any batch-1 step) makes hundreds
of such calls. This script runs such a step on the main thread (`--ops` in-place adds on a small
tensor, the shape of a launch-bound step's host work) while the store takes an epoch of finished
samples (`--prompts` x `--n` samples of `--tokens` tokens, noisy copies of a per-prompt text, as
RL's revisited prompts give), in two arms side by side: `alone` (the store idle) and `store` (it
builds the epoch meanwhile).

Per arm and repeat (`--repeats`, the arms interleaved): the step's median and mean milliseconds
while the store is busy, the slowdown against `alone` (its mean over the repeats), the engine time
lost (steps x the mean's excess over `alone`: what the store cost the engine in all), the seconds
the store took to store the epoch and its tokens per second. Host work only: the numbers carry over
to a GPU host whose steps are launch-bound.

    python benchmarks/bench_history_store.py                 # 64 x 8 x 256 tokens (131k)
    python benchmarks/bench_history_store.py --quick         # a few seconds
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, print_table, write_json  # noqa: E402

from rollout.spec.history import prompt_key  # noqa: E402
from rollout.spec.history_store import HistoryStore  # noqa: E402

COLUMNS = ["arm", "repeat", "steps", "step_ms_median", "step_ms_mean", "slowdown", "engine_lost_s", "store_s",
           "tokens_per_s"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--noise", type=float, default=0.3, help="fraction of a sample's tokens drawn afresh")
    p.add_argument("--ops", type=int, default=300, help="torch calls per step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="8 x 4 x 128 tokens, one repeat")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_history_store_cpu.json"))
    args = p.parse_args()
    if args.quick:
        args.prompts, args.n, args.tokens, args.repeats = 8, 4, 128, 1
    return args


def epoch(args: argparse.Namespace) -> list[tuple[bytes, int, list[int]]]:
    """(prompt key, seed, tokens) of every sample: noisy copies of a text per prompt."""
    rng = random.Random(0)
    samples = []
    for p in range(args.prompts):
        text = [rng.randrange(args.vocab) for _ in range(args.tokens)]
        for s in range(args.n):
            tokens = [rng.randrange(args.vocab) if rng.random() < args.noise else t for t in text]
            samples.append((prompt_key([p]), p * args.n + s, tokens))
    return samples


def steps_while(busy, ops: int, least: int = 20) -> list[float]:
    """Seconds of each launch-bound step run while `busy()` (at least `least` steps)."""
    x = torch.zeros(16)
    times = []
    while busy() or len(times) < least:
        start = time.perf_counter()
        for _ in range(ops):
            x.add_(1)
        times.append(time.perf_counter() - start)
    return times


def run_arm(arm: str, args: argparse.Namespace, samples) -> dict:
    store = HistoryStore(max_tokens=len(samples) * (args.tokens + 2) * 2)
    start = time.perf_counter()
    if arm != "alone":
        for key, seed, tokens in samples:
            store.add(key, seed, tokens, version=0)
    done: dict[str, float] = {}

    def busy() -> bool:
        if arm == "alone":
            return False
        if store._inbox or store._busy:
            return True
        done.setdefault("at", time.perf_counter())
        return False

    times = steps_while(busy, args.ops)
    store.flush()
    stored = sum(len(t) for _, _, t in samples) if arm != "alone" else 0
    seconds = done.get("at", time.perf_counter()) - start if arm != "alone" else 0.0
    return dict(arm=arm, steps=len(times), step_ms_median=statistics.median(times) * 1e3,
                step_ms_mean=statistics.fmean(times) * 1e3, store_s=seconds,
                tokens_per_s=stored / seconds if seconds else 0.0)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    samples = epoch(args)
    rows = [dict(run_arm(arm, args, samples), repeat=r) for r in range(args.repeats)
            for arm in ("alone", "store")]  # fmt: skip
    alone = statistics.fmean(row["step_ms_mean"] for row in rows if row["arm"] == "alone")
    for row in rows:
        row["slowdown"] = row["step_ms_mean"] / alone
        row["engine_lost_s"] = row["steps"] * (row["step_ms_mean"] - alone) / 1e3 if row["arm"] != "alone" else 0.0
    print_table(f"launch-bound steps ({args.ops} torch calls) while the history store takes "
                f"{args.prompts} x {args.n} samples of {args.tokens} tokens", rows, COLUMNS)
    write_json(args.out, dict(args=vars(args), env=environment("cpu"), rows=rows))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
