"""Host time of one engine step, phase by phase: the Python/CPU work between CUDA-graph
forwards (the gap between a ~7 ms 8B decode forward and the 9.9 ms step on an H200).

Builds an engine (on CPU by default) with a tiny random Qwen3 (hidden 64, 2 layers, vocabulary
264: the forward and the policy's sort are small, so the numbers are mostly host cost; `--shape`
picks a larger random one, e.g. qwen3-8b on a GPU) and, with `--spec dflash`, an untrained
one-layer DFlash drafter (block 8). B samples (`--prompt-len` tokens, 32 by default; EOS
ignored) are prefilled, a few decode steps warm up, then every phase of `LLMEngine.step()` is
wrapped with a timer for the timed decode steps: schedule, draft (the drafter's propose),
build_step, forward, ctx (the drafter's update_context), logits, grammar, rows
(build_row_params), policy, verify, capture, hand_over (the last step's masks), sync (_to_host),
commit; each phase's time excludes the phases nested in it (ctx runs inside forward) and `other`
is the step's time outside them; `finish_ms` is the abort of the B samples after the timed steps
(each one's finish, with masks its supports assembled from ~40 steps' rows). One torch thread.
Reports the median milliseconds per step of the step and of every phase (medians resist a busy
machine; `--clock cpu` times this process's CPU time, which other processes do not inflate).
`--embedded` uses the embedded tiny-qwen3 and its trained DFlash drafter instead (a realistic
acceptance length, a larger forward). On CUDA the phases are host time (launches are
asynchronous) and `sync` absorbs the wait for the device. One more step is run under a dispatch
mode that counts the aten ops of every phase (deterministic; on a GPU each is a kernel launch or
at least a host dispatch). With `--overlap on off` both modes run on one engine per spec, in turns,
`--rounds` times (the order reversed every other round), and each row is its mode's round of the
median step (`step_ms_rounds` lists them all): the first engine or mode measured ran slower.
`--budget adaptive full` likewise takes turns between the adaptive draft budget and full blocks
(issue 19: where the adaptive arm's host time goes).

    python benchmarks/bench_host.py                        # batches 1 8 64 256, greedy + t1, none + dflash
    python benchmarks/bench_host.py --quick                # a short check of the script
    python benchmarks/bench_host.py --batches 64 --profile # plus the top cProfile entries
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import SHAPES, environment, nearest_median, print_table, sync, write_config_dir, write_json
from torch.utils._python_dispatch import TorchDispatchMode

import rollout
import rollout.engine.engine as engine_module
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.loader import load_model
from rollout.engine.params import SamplingParams
from rollout.spec.draft_loader import random_drafter, save_drafter

TINY = dict(SHAPES["tiny"], vocab_size=264, hidden_size=64, intermediate_size=128, head_dim=16,
            max_position_embeddings=4096)  # fmt: skip
SAMPLING = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0, top_k=64)}
KV_BLOCK = 16
# (phase, where the callable lives, its attribute): engine attributes are wrapped on the instance,
# module functions in rollout.engine.engine's namespace (where step() looks them up).
PHASES = (
    ("schedule", "scheduler", "schedule"),
    ("draft", "drafter", "propose"),
    ("build_step", "module", "build_step"),
    ("forward", "engine", "_forward"),
    ("ctx", "drafter", "update_context"),
    ("logits", "model", "compute_logits"),
    ("grammar", "module", "grammar_bitmask"),
    ("rows", "module", "build_row_params"),
    ("policy", "module", "policy"),
    ("verify", "module", "verify"),
    ("capture", "capture", "capture"),
    ("hand_over", "committer", "hand_over_masks"),
    ("sync", "module", "_to_host"),
    ("commit", "committer", "commit"),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="small batches, few steps (script check)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    p.add_argument("--sampling", nargs="+", default=list(SAMPLING), choices=list(SAMPLING))
    p.add_argument("--specs", nargs="+", default=["none", "dflash"], choices=["none", "dflash"])
    p.add_argument("--mask", default=None, choices=("selected", "support"), help="every request asks for masks")
    p.add_argument("--overlap", nargs="+", default=["on"], choices=("on", "off"),
                   help="overlapped scheduling (rollout.engine.overlap): the modes take turns on one engine")
    p.add_argument("--budget", nargs="+", default=["adaptive"], choices=("adaptive", "full"),
                   help="with a drafter: the adaptive draft budget, or full blocks every step (--no-spec-adaptive); "
                        "several take turns like --overlap")
    p.add_argument("--rounds", type=int, default=3,
                   help="each case's modes measured in turn this many times, the order reversed every other "
                        "round; the round of the median step is shown (the first engine or mode measured ran "
                        "slower, so one pass of each could not compare them)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (longer: larger block tables)")
    p.add_argument("--block", type=int, default=8, help="drafter block size")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per case")
    p.add_argument("--warmup", type=int, default=5, help="decode steps before timing")
    p.add_argument("--embedded", action="store_true", help="embedded tiny-qwen3 + its trained DFlash drafter")
    p.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES],
                   help="random target shape (default: the tiny one above; e.g. qwen3-8b on a GPU)")
    p.add_argument("--profile", action="store_true", help="print the top cProfile entries of the timed steps")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="cpu: this process's CPU time, which other processes on a shared machine do not inflate")
    p.add_argument("--out", default="benchmarks/results/bench_host.json")
    args = p.parse_args()
    if args.quick:
        args.batches, args.steps, args.warmup, args.rounds = [1, 8], 5, 2, 1
    return args


class PhaseTimer:
    """Wraps the phase callables of one engine with timers reading `clock` (see PHASES)."""

    def __init__(self, engine: LLMEngine, clock):
        self.engine = engine
        self.clock = clock
        self.totals: dict[str, float] = {}  # phase -> seconds in the current step
        self.active = False
        self._restore: list = []
        self._inner: list[float] = []
        self.phases: list[str] = []  # the phases running now, innermost last
        for name, owner, attr in PHASES:
            target = self._owner(owner)
            if target is not None and hasattr(target, attr):
                self._wrap(name, target, attr)

    def _owner(self, owner: str):
        eng = self.engine
        return {"module": engine_module, "engine": eng, "model": eng.model}.get(owner, getattr(eng, owner, None))

    def _wrap(self, name: str, target, attr: str) -> None:
        real = getattr(target, attr)
        in_dict = attr in vars(target)  # an instance attribute (or module global) to put back as it was

        def timed(*args, **kw):
            self._inner.append(0.0)  # time of the timed phases nested in this one
            self.phases.append(name)
            start = self.clock()
            try:
                return real(*args, **kw)
            finally:
                elapsed = self.clock() - start
                self.phases.pop()
                inner = self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed
                if self.active:
                    self.totals[name] = self.totals.get(name, 0.0) + elapsed - inner

        setattr(target, attr, timed)
        self._restore.append((target, attr, real if in_dict else None))

    def close(self) -> None:
        for target, attr, real in reversed(self._restore):
            if real is None:
                delattr(target, attr)
            else:
                setattr(target, attr, real)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops each phase dispatches (the innermost running phase, else `other`):
    machine-independent, and on a GPU each one is a kernel launch or at least a host-side
    dispatch."""

    def __init__(self, timer: PhaseTimer):
        super().__init__()
        self.timer = timer
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase = self.timer.phases[-1] if self.timer.phases else "other"
        self.counts[phase] = self.counts.get(phase, 0) + 1
        return func(*args, **(kwargs or {}))


def random_dirs(root: Path, block: int, shape: dict, device: str) -> tuple[str, str]:
    """A config-only target (random weights at load) and an untrained DFlash drafter for it."""
    model = write_config_dir(shape, root / "target")
    target = load_model(model, torch.device(device), load_format="random")
    draft = root / "dflash"
    save_drafter(random_drafter(target, "dflash", block_size=block, num_layers=1), draft)
    return str(model), str(draft)


def build_engine(spec: str, dirs: tuple[str, str] | None, args: argparse.Namespace, max_tokens: int,
                 overlap: bool) -> LLMEngine:
    batch = max(args.batches)
    per_seq = -(-(args.prompt_len + max_tokens + 2 * args.block) // KV_BLOCK) + 1
    model, draft = dirs if dirs else (None, None)
    return rollout.build_engine(EngineConfig(
        model=model, load_format="safetensors" if args.embedded else "random", spec=spec,
        draft=draft if spec != "none" else None, spec_block_size=args.block if spec != "none" else None,
        device=args.device, block_size=KV_BLOCK, num_kv_blocks=batch * per_seq + 8, max_num_seqs=batch,
        max_num_batched_tokens=max(2048, min(batch * args.prompt_len, 16384)), enable_prefix_caching=False,
        overlap=overlap,
    ))  # fmt: skip


def measure(engine: LLMEngine, batch: int, sampling: dict, tag: str, args, max_tokens: int,
            profile: cProfile.Profile | None) -> dict:
    """Median ms per timed decode step, per phase, for `batch` samples decoding together."""
    vocab = engine.vocab_size
    for i in range(batch):
        prompt = [(7 * i + 3 * j) % (vocab - 8) for j in range(args.prompt_len)]
        params = SamplingParams(**sampling, max_tokens=max_tokens, ignore_eos=True, seed=i)
        engine.add_request(f"{tag}-{i}", [prompt], params, mask=args.mask)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill
    for _ in range(args.warmup):
        engine.step()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    timer = PhaseTimer(engine, clock)
    committed = sum(s.num_output_tokens for s in engine.scheduler.running)
    timer.active = True
    steps: list[dict[str, float]] = []
    for _ in range(args.steps):
        timer.totals = {}
        sync(args.device)
        start = clock()
        if profile is not None:
            profile.enable()
        assert len(engine.step()) == 0, "a sample finished while timing: raise max_tokens"
        if profile is not None:
            profile.disable()
        sync(args.device)
        steps.append(dict(timer.totals, step=clock() - start))
    timer.active = False
    assert len(engine.scheduler.running) == batch, "not every sample decoded in every timed step"
    committed = sum(s.num_output_tokens for s in engine.scheduler.running) - committed
    with OpCounter(timer) as counter:
        engine.step()
    timer.close()
    start = clock()  # every sample's finish (with masks: its supports assembled from its steps' rows)
    for request_id in list(engine.intake.requests):
        engine.abort(request_id)
    finish_ms = (clock() - start) * 1e3
    for t in steps:
        t["other"] = t["step"] - sum(t.get(name, 0.0) for name, _, _ in PHASES)
    row = {name: statistics.median(t.get(name, 0.0) for t in steps) * 1e3
           for name in ("step", *(name for name, _, _ in PHASES), "other")}
    row["step_ms"] = row.pop("step")
    row["finish_ms"] = finish_ms
    row["tokens_per_step"] = committed / args.steps / batch
    row["ops"] = {name: counter.counts.get(name, 0) for name in (*(name for name, _, _ in PHASES), "other")}
    row["ops"]["step"] = sum(counter.counts.values())
    return row


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    result = dict(args=vars(args), env=environment(args.device), rows=[])
    max_tokens = (args.warmup + args.steps + 4) * args.block + 8
    profile = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory() as tmp:
        shape = TINY if args.shape == "tiny" else SHAPES[args.shape]
        dirs = None if args.embedded else random_dirs(Path(tmp), args.block, shape, args.device)
        for spec in args.specs:
            engine = build_engine(spec, dirs, args, max_tokens, True)
            for mode, batch in itertools.product(args.sampling, args.batches):
                budgets = args.budget if spec != "none" else ["-"]
                runs: dict[tuple, list[dict]] = {m: [] for m in itertools.product(args.overlap, budgets)}
                for r in range(args.rounds):
                    for overlap, budget in list(runs)[:: 1 if r % 2 == 0 else -1]:
                        while not engine.pipeline.idle:  # the last run's step in flight (its samples aborted)
                            engine.step()
                        engine.pipeline.enabled = overlap == "on"
                        if spec != "none":
                            engine.scheduler.draft_budget = engine.spec_budget if budget == "adaptive" else None
                        runs[overlap, budget].append(measure(engine, batch, SAMPLING[mode],
                                                             f"{spec}-{overlap}-{budget}-{mode}-{batch}-{r}", args,
                                                             max_tokens, profile))
                for (overlap, budget), rounds in runs.items():
                    row = dict(spec=spec, overlap=overlap, budget=budget, sampling=mode, batch=batch)
                    row.update(nearest_median(rounds, "step_ms"))
                    row["step_ms_rounds"] = [round(x["step_ms"], 3) for x in rounds]
                    result["rows"].append(row)
                    write_json(args.out, result)
                    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    columns = ["spec", "overlap", "budget", "sampling", "batch", "step_ms", *(name for name, _, _ in PHASES), "other",
               "tokens_per_step", "finish_ms"]
    print_table(f"ms per decode step by phase ({args.device}, one thread, {args.clock} clock, "
                f"{'embedded tiny-qwen3' if args.embedded else f'{args.shape} random Qwen3'}, masks {args.mask})",
                result["rows"], columns)
    print_table("aten ops dispatched per decode step by phase (one step counted)",
                [dict(spec=r["spec"], overlap=r["overlap"], budget=r["budget"], sampling=r["sampling"],
                      batch=r["batch"], **r["ops"]) for r in result["rows"]],
                ["spec", "overlap", "budget", "sampling", "batch", "step", *(name for name, _, _ in PHASES), "other"])
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(40)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
