"""Where one decode step's time goes on a GPU, per kernel backend: a diagnostic companion of
bench_engine.py (its numbers are not the benchmark's, since timing each phase synchronises).

For each backend and batch: (1) plain decode steps/s with nothing wrapped, (2) the same steps
with every phase of `LLMEngine.step` wrapped in device-synchronised timers (schedule, draft,
build_step, forward, logits, rows, policy, verify, capture, to_host, commit), (3) the CUDA
kernels of one eager forward (count and top 12 by device time) from torch.profiler.
Prints tables and writes JSON (`--out`).

    python benchmarks/profile_step.py --shape qwen3-8b --batches 1 64 --backends torch triton
"""

from __future__ import annotations

import argparse
import collections
import random
import tempfile
import time
from pathlib import Path

from common import SHAPES, eager_step_kernels, environment, print_table, sync, write_config_dir, write_json

import rollout.engine.engine as engine_mod
from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams

MODULE_PHASES = ("build_step", "build_row_params", "policy", "verify", "_to_host")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--backends", nargs="+", default=["torch", "triton"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt (GRPO groups): batch / n prompts")
    p.add_argument("--mask", choices=("selected", "support"), default=None,
                   help="support masks at top_k 64, top_p 0.95 (needs --temperature > 0)")
    p.add_argument("--out", default="benchmarks/results/profile_step.json")
    return p.parse_args()


class PhaseTimer:
    """Wraps callables so that each call's device-inclusive time is added to its phase."""

    def __init__(self, device: str):
        self.device = device
        self.ms: dict[str, float] = collections.defaultdict(float)
        self.frozen: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            sync(self.device)
            start = time.perf_counter()
            out = fn(*a, **kw)
            sync(self.device)
            self.ms[name] += (time.perf_counter() - start) * 1e3
            return out

        return timed


WORKLOAD = dict(n=1, mask=None)  # --n and --mask, set once by main


def decode(engine: LLMEngine, prompts, steps: int, temperature: float, device: str, timer=None) -> float:
    """Prefill, then time `steps` decode steps; returns ms per step. A `timer` counts the
    decode steps only. `prompts` holds batch / n prompts of n samples each."""
    masked = WORKLOAD["mask"] is not None
    grpo = WORKLOAD["n"] > 1 and not masked  # the RL default: temperature alone, no truncation
    top_k = 64 if temperature and not grpo else -1
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=0.95 if masked else 1.0,
                            max_tokens=steps + 1, ignore_eos=True)
    rid = f"p{time.monotonic_ns()}"
    engine.add_request(rid, prompts, params, n=WORKLOAD["n"], mask=WORKLOAD["mask"])
    while any(not s.output_token_ids for s in engine.intake.requests[rid]):
        engine.step()  # prefill (in chunks) + every sample's first token
    sync(device)
    if timer is not None:
        timer.ms.clear()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    ms = (time.perf_counter() - start) * 1e3 / steps
    if timer is not None:
        timer.frozen = dict(timer.ms)
    while engine.has_unfinished():
        engine.step()
    return ms


def phases(engine: LLMEngine, prompts, steps: int, temperature: float, device: str) -> dict[str, float]:
    timer = PhaseTimer(device)
    saved = {name: getattr(engine_mod, name) for name in MODULE_PHASES}
    saved_obj = [(engine.scheduler, "schedule"), (engine, "_forward"), (engine, "_draft"),
                 (engine.committer, "commit"), (engine.capture, "capture")]
    originals = [(obj, name, getattr(obj, name)) for obj, name in saved_obj]
    try:
        for name, fn in saved.items():
            setattr(engine_mod, name, timer.wrap(name, fn))
        for obj, name, fn in originals:
            setattr(obj, name, timer.wrap(name.strip("_"), fn))
        total = decode(engine, prompts, steps, temperature, device, timer)
    finally:
        for name, fn in saved.items():
            setattr(engine_mod, name, fn)
        for obj, name, _ in originals:
            delattr(obj, name)
    row = {name: ms / steps for name, ms in timer.frozen.items()}
    row["step_synced"] = total
    row["unaccounted"] = total - sum(v for k, v in row.items() if k != "step_synced")
    return row


def kernels(engine: LLMEngine, prompts, device: str) -> dict:
    """Kernel count and top kernels of one eager decode forward (graphs off)."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    events = eager_step_kernels(
        engine, lambda: engine.add_request(f"k{time.monotonic_ns()}", prompts, params, n=WORKLOAD["n"]), device)
    total_us = sum(e.device_time_total for e in events)
    top = [dict(name=e.key[:70], calls=e.count, ms=e.device_time_total / 1e3) for e in events[:12]]
    return dict(num_kernels=sum(e.count for e in events), device_ms=total_us / 1e3, top=top)


def main() -> None:
    args = parse_args()
    WORKLOAD.update(n=args.n, mask=args.mask)
    shape = SHAPES[args.shape]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        per_seq = -(-(args.prompt_len + args.steps + 8) // 16) + 1
        blocks = max(args.batches) * per_seq * 2 + 8 if args.device == "cpu" else None  # CUDA: the memory plan's
        config = EngineConfig(model=str(write_config_dir(shape, Path(tmp))), load_format="random",
                              device=args.device, num_kv_blocks=blocks, max_num_seqs=max(args.batches),
                              enable_prefix_caching=False,
                              max_num_batched_tokens=max(2048, max(args.batches) // args.n * args.prompt_len))
        engine = build_engine(config)
    result = dict(args=vars(args), env=environment(args.device), rows=[], kernels=[])
    for backend in args.backends:
        engine.model.set_kernel_backend(backend)
        if engine.graphs is not None:
            engine.graphs = engine.make_step_graphs(capture=True)
        for batch in args.batches:
            prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(args.prompt_len)]
                       for _ in range(max(1, batch // args.n))]
            decode(engine, prompts, 4, args.temperature, args.device)  # warm-up: graph capture
            ms = min(decode(engine, prompts, args.steps, args.temperature, args.device) for _ in range(2))
            row = dict(backend=backend, batch=batch, step_ms=ms, tokens_per_s=batch * 1e3 / ms)
            row.update(phases(engine, prompts, args.steps, args.temperature, args.device))
            result["rows"].append(row)
            if args.device == "cuda":
                result["kernels"].append(dict(backend=backend, batch=batch, **kernels(engine, prompts, args.device)))
                k = result["kernels"][-1]
                print(f"{backend} b{batch}: {k['num_kernels']} kernels, {k['device_ms']:.2f} ms device per "
                      f"eager forward step", flush=True)
                for t in k["top"]:
                    print(f"    {t['ms']:8.3f} ms {t['calls']:5d}x {t['name']}", flush=True)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            write_json(args.out, result)
    columns = ["backend", "batch", "step_ms", "tokens_per_s", "step_synced", "schedule", "draft", "build_step",
               "forward", "build_row_params", "policy", "verify", "capture", "_to_host", "commit", "unaccounted"]
    print_table(f"{args.shape} decode step, ms (phases synchronised: diagnostic only)", result["rows"], columns)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
