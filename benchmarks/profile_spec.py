"""Where a speculative step's time goes on a GPU (diagnostic, not a benchmark): the embedded
target with an embedded drafter at block 8, batch 1 and 32, greedy and temperature 1; ms per
verify step, then torch.profiler's top host-side ops (self CPU time) and device kernels of ten
steps. Prints tables; writes JSON (`--out`).

    python benchmarks/profile_spec.py --spec dflash
"""

from __future__ import annotations

import argparse
import time

from common import embedded_draft, environment, heldout_prompts, sync, write_json
from torch.profiler import ProfilerActivity, profile

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--specs", nargs="+", default=["dflash", "dspark"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/profile_spec.json")
    return p.parse_args()


def run(engine: LLMEngine, prompts, temperature: float, tokens: int, device: str, prof_steps: int = 0):
    params = SamplingParams(temperature=temperature, top_k=64 if temperature else -1, max_tokens=tokens,
                            ignore_eos=True, seed=3)
    engine.add_request(f"r{time.monotonic_ns()}", prompts, params)
    engine.step()  # prefill
    sync(device)
    steps, start, prof = 0, time.perf_counter(), None
    while engine.has_unfinished():
        if prof_steps and steps == 2:
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        engine.step()
        steps += 1
        if prof is not None and steps == 2 + prof_steps:
            sync(device)
            prof.__exit__(None, None, None)
            break
    sync(device)
    ms = (time.perf_counter() - start) * 1e3 / steps
    while engine.has_unfinished():
        engine.step()
    return ms, prof


def main() -> None:
    args = parse_args()
    prompts = heldout_prompts(max(args.batches))
    result = dict(args=vars(args), env=environment(args.device), rows=[])
    for spec in args.specs:
        engine = build_engine(EngineConfig(spec=spec, draft=embedded_draft(spec), spec_block_size=8, device=args.device,
                                        num_kv_blocks=2048, max_num_seqs=64, enable_prefix_caching=False))
        for temperature in (0.0, 1.0):
            for batch in args.batches:
                run(engine, prompts[:batch], temperature, args.tokens, args.device)  # warm-up
                ms, _ = run(engine, prompts[:batch], temperature, args.tokens, args.device)
                _, prof = run(engine, prompts[:batch], temperature, args.tokens, args.device, prof_steps=10)
                events = prof.key_averages()
                cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
                dev = sorted([e for e in events if e.device_type.name == "CUDA"], key=lambda e: -e.device_time_total)
                row = dict(spec=spec, temperature=temperature, batch=batch, ms_per_step=ms,
                           cpu_top=[(e.key[:60], e.count // 10, round(e.self_cpu_time_total / 1e4, 3)) for e in cpu],
                           kernels_per_step=sum(e.count for e in dev) / 10,
                           device_ms_per_step=sum(e.device_time_total for e in dev) / 1e4)
                result["rows"].append(row)
                print(f"{spec} T={temperature} b{batch}: {ms:.2f} ms/step, {row['kernels_per_step']:.0f} kernels "
                      f"and {row['device_ms_per_step']:.2f} ms device per step; top self-CPU ms/step:", flush=True)
                for name, calls, cpu_ms in row["cpu_top"]:
                    print(f"    {cpu_ms:8.3f} {calls:5d}x {name}", flush=True)
                write_json(args.out, result)
        del engine


if __name__ == "__main__":
    main()
