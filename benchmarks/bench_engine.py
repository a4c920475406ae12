"""Decode throughput of the engine against transformers' `generate` (issue 2): Qwen3-0.6B- and
Qwen3-8B-shaped random bfloat16 weights, batch 1 and 64, 128 random prompt tokens, 128 greedy
output tokens (EOS ignored / min_new_tokens = max_new_tokens), both measured in this run on the
same weights. Decode tokens/s = the N-1 tokens after the first over (time of the N-token run -
time of a 1-token run), the same for both; end-to-end rates are reported too. The floor is
the decode rate of a step that only reads the weights once: copy bandwidth / weight bytes, with
the bandwidth measured by a large device-to-device copy. Prints a table, writes JSON (`--out`).

    python benchmarks/bench_engine.py --device cuda
    python benchmarks/bench_engine.py --device cpu --quick     # checks the script itself
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from common import (
    SHAPES,
    copy_bandwidth,
    environment,
    free_memory,
    hf_config,
    model_dtype,
    print_table,
    run_engine,
    sync,
    weight_bytes,
    write_config_dir,
    write_json,
)

import rollout
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.loader import load_state_into
from rollout.engine.params import SamplingParams

KV_BLOCK = 16
# Runs before the timed N-token one: a 4-token warm-up (captures the decode CUDA graphs), then
# two 1-token runs (prefill + first token; the faster one is subtracted).
LENGTHS = (4, 1, 1)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="tiny shape and lengths (CPU check)")
    p.add_argument("--shapes", nargs="+", default=["qwen3-8b", "qwen3-0.6b"], choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--out", default="benchmarks/results/bench_engine.json")
    args = p.parse_args()
    if args.quick:
        args.shapes, args.batches, args.prompt_len, args.output_len = ["tiny"], [1, 4], 16, 8
    return args


def build_hf(shape: dict, device: str):
    """transformers' Qwen3ForCausalLM with random weights (its own init), sdpa, on `device`."""
    import transformers

    cfg = hf_config(shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(model_dtype(device))
    try:
        with torch.device(device):
            hf = transformers.Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return hf.eval().requires_grad_(False)


def build_engine(shape: dict, root: Path, hf, args: argparse.Namespace) -> LLMEngine:
    """The engine on a config-only directory, then given transformers' weights."""
    per_seq = -(-(args.prompt_len + args.output_len) // KV_BLOCK) + 1
    config = EngineConfig(
        model=str(write_config_dir(shape, root)), load_format="random", device=args.device,
        num_kv_blocks=max(args.batches) * per_seq + 8, block_size=KV_BLOCK, max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(2048, max(args.batches) * args.prompt_len), enable_prefix_caching=False,
    )  # fmt: skip
    engine = rollout.build_engine(config)
    if hf is not None:
        load_state_into(engine.model, hf.state_dict())
    return engine


def rates(batch: int, output_len: int, seconds_1: float, seconds_n: float) -> dict:
    """End-to-end tokens/s of the N-token run, and decode tokens/s: the N - 1 tokens after the
    first, over the time the N-token run took beyond the 1-token run (prefill + first token);
    NaN when timing noise makes that difference non-positive (only seen on a busy CPU)."""
    extra = seconds_n - seconds_1
    return dict(e2e=batch * output_len / seconds_n,
                decode=batch * (output_len - 1) / extra if extra > 0 else float("nan"))  # fmt: skip


def engine_rates(engine: LLMEngine, prompts: list[list[int]], output_len: int, device: str) -> dict:
    seconds: dict[int, float] = {}
    for i, n in enumerate(LENGTHS + (output_len,)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        run = run_engine(engine, [(p, params, {}) for p in prompts], f"r{i}", device)
        assert run.tokens == len(prompts) * n, run.tokens
        seconds[n] = min(seconds.get(n, float("inf")), run.seconds)
    return rates(len(prompts), output_len, seconds[1], seconds[output_len])


@torch.inference_mode()
def hf_rates(hf, prompts: list[list[int]], output_len: int, device: str) -> dict:
    ids = torch.tensor(prompts, device=device)  # [B, P]
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    seconds: dict[int, float] = {}
    for n in LENGTHS + (output_len,):
        sync(device)
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)  # [B, P + n]
        sync(device)
        seconds[n] = min(seconds.get(n, float("inf")), time.perf_counter() - start)
        assert out.shape[1] == ids.shape[1] + n, out.shape
    return rates(len(prompts), output_len, seconds[1], seconds[output_len])


def bench_shape(name: str, args: argparse.Namespace, bandwidth: float, result: dict) -> None:
    shape = SHAPES[name]
    start = time.perf_counter()
    hf = None if args.no_hf else build_hf(shape, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(shape, Path(tmp), hf, args)
    nbytes = weight_bytes(engine.model)
    floor = bandwidth / nbytes
    print(f"{name}: weights {nbytes / 1e9:.2f} GB, floor {floor:.1f} tokens/s at batch 1, "
          f"built in {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    rng = random.Random(0)
    for batch in args.batches:
        prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(batch)]
        row = dict(shape=name, batch=batch, weight_gb=nbytes / 1e9, floor_tokens_per_s=floor)
        ours = engine_rates(engine, prompts, args.output_len, args.device)
        row.update(engine_tokens_per_s=ours["decode"], engine_e2e_tokens_per_s=ours["e2e"])
        if hf is not None:
            theirs = hf_rates(hf, prompts, args.output_len, args.device)
            row.update(hf_tokens_per_s=theirs["decode"], hf_e2e_tokens_per_s=theirs["e2e"])
            row["engine_over_hf"] = ours["decode"] / theirs["decode"]
        if batch == 1:
            row["fraction_of_floor"] = ours["decode"] / floor
        result["rows"].append(row)
        write_json(args.out, result)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    del engine, hf
    free_memory()


def main() -> None:
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = copy_bandwidth(args.device, (64 << 20) if args.quick else (4 << 30))
    print(f"device copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)", flush=True)
    result = dict(args=vars(args), env=environment(args.device), copy_bandwidth_bytes_per_s=bandwidth, rows=[])
    for name in args.shapes:
        bench_shape(name, args, bandwidth, result)
    columns = ["shape", "batch", "engine_tokens_per_s", "hf_tokens_per_s", "engine_over_hf", "floor_tokens_per_s",
               "fraction_of_floor", "engine_e2e_tokens_per_s", "hf_e2e_tokens_per_s"]  # fmt: skip
    print_table(
        f"decode tokens/s (after the first token; e2e = incl. prefill), {args.prompt_len} prompt + "
        f"{args.output_len} greedy tokens, {args.device} "
        f"(goals: 8B batch 1 >= 0.5 of floor; batch 64 >= 10x transformers)", result["rows"], columns,
    )
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
