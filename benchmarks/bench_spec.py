"""Speculative decoding (issue 3): acceptance and wall-clock speedup of DFlash and DSpark over
non-speculative decoding on the embedded models, and the verify-step cost at 8B scale.

Acceptance: the embedded tiny Qwen3 with its embedded drafters at block size 8; prompts are the
first 256 bytes of held-out stdlib files (scripts/corpus.py), 256 output tokens (EOS ignored),
greedy and temperature 1 (top_k 64, seeded), batch 1 (prompts run one at a time) and batch 32.
Mean acceptance length = committed tokens per verify step, the prefill step of each sample left
out. Speedup = tokens/s with the drafter / tokens/s with spec=none on the same workload. A drafter
that is not in the repository yet is reported as missing (or pass `--dflash DIR` / `--dspark DIR`).

Verify cost: Qwen3-8B-shaped random bfloat16 target, context ~1024 per sequence; one forward plus
LM head over B x (block + 1) tokens against one decode step of B tokens, B in 1, 8, 32, 64.

    python benchmarks/bench_spec.py --device cuda
    python benchmarks/bench_spec.py --device cpu --quick --dflash D1 --dspark D2   # script check
"""

from __future__ import annotations

import argparse

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
    print_table,
    random_model,
    run_engine,
    time_ms,
    write_json,
)

import rollout
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams

SPECS = ("none", "dflash", "dspark")
SAMPLING = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0, top_k=64)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="short runs and a tiny verify shape (CPU check)")
    p.add_argument("--dflash", default=None, help="DFlash drafter dir (default: the embedded one)")
    p.add_argument("--dspark", default=None, help="DSpark drafter dir (default: the embedded one)")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--batch1-prompts", type=int, default=3, help="prompts run one at a time at batch 1")
    p.add_argument("--verify-shape", default="qwen3-8b", choices=list(SHAPES))
    p.add_argument("--verify-batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--out", default="benchmarks/results/bench_spec.json")
    args = p.parse_args()
    if args.quick:
        args.output_len, args.batches, args.batch1_prompts = 24, [1, 4], 1
        args.verify_shape, args.verify_batches, args.context = "tiny", [1, 4], 64
    return args


def drafter_dirs(args: argparse.Namespace) -> dict[str, str | None]:
    return {"dflash": args.dflash or embedded_draft("dflash"), "dspark": args.dspark or embedded_draft("dspark")}


def build_engine(spec: str, draft: str | None, args: argparse.Namespace) -> LLMEngine:
    per_seq = -(-(256 + args.output_len + 2 * args.block) // 16) + 1
    return rollout.build_engine(EngineConfig(
        spec=spec, draft=draft, spec_block_size=None if spec == "none" else args.block, device=args.device,
        num_kv_blocks=max(args.batches) * per_seq + 8, max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(2048, 256 * max(args.batches)), enable_prefix_caching=False,
    ))  # fmt: skip


def requests(prompts: list[list[int]], sampling: dict, max_tokens: int) -> list:
    return [(p, SamplingParams(**sampling, max_tokens=max_tokens, ignore_eos=True, seed=i), {})
            for i, p in enumerate(prompts)]  # fmt: skip


def measure(engine: LLMEngine, prompts: list[list[int]], sampling: dict, batch: int, args) -> dict:
    """Tokens/s and acceptance of `prompts` run in groups of `batch` (seeded, EOS ignored)."""
    runs = [run_engine(engine, requests(prompts[i : i + batch], sampling, args.output_len), f"b{batch}-{i}",
                       args.device) for i in range(0, len(prompts), batch)]  # fmt: skip
    tokens, seconds = sum(r.tokens for r in runs), sum(r.seconds for r in runs)
    accepts = [n for run in runs for o in run.outputs for n in o.accept_lengths[1:]]
    return dict(tokens_per_s=tokens / seconds, tokens=tokens, seconds=seconds,
                mean_acceptance=sum(accepts) / max(len(accepts), 1), verify_steps=len(accepts))


def bench_acceptance(args: argparse.Namespace, result: dict) -> None:
    dirs = drafter_dirs(args)
    result["drafters"] = dirs
    prompts = heldout_prompts(max(max(args.batches), args.batch1_prompts))
    base: dict[tuple[str, int], float] = {}
    for spec in SPECS:
        if spec != "none" and dirs[spec] is None:
            print(f"{spec}: embedded drafter not in the repository yet, skipped", flush=True)
            continue
        engine = build_engine(spec, dirs.get(spec), args)
        for mode, sampling in SAMPLING.items():
            for batch in args.batches:
                chosen = prompts[: args.batch1_prompts] if batch == 1 else prompts[:batch]
                # the same workload twice, the second timed: the first run captures the CUDA graphs
                # and compiles the Triton kernels of every step shape it meets
                measure(engine, chosen, sampling, batch, args)
                row = dict(spec=spec, sampling=mode, batch=batch, **measure(engine, chosen, sampling, batch, args))
                if spec == "none":
                    base[mode, batch] = row["tokens_per_s"]
                row["speedup"] = row["tokens_per_s"] / base[mode, batch]
                result["acceptance"].append(row)
                write_json(args.out, result)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        del engine
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
def bench_verify_cost(args: argparse.Namespace, result: dict) -> None:
    """One target forward + LM head: B x (block+1) verify tokens vs B decode tokens, eager and
    (on CUDA) replayed as a CUDA graph, as the engine runs uniform steps; the ratio uses the graph."""
    device, dtype, shape = torch.device(args.device), model_dtype(args.device), SHAPES[args.verify_shape]
    torch.manual_seed(0)
    model = random_model(shape, device, dtype)
    per_seq = -(-(args.context + args.block + 1) // 16)
    caches = kv_caches(model, max(args.verify_batches) * per_seq + 1, device, dtype)
    kind = "graph" if device.type == "cuda" else "eager"
    # the engine's kernels on CUDA (Triton), and the torch reference path beside them
    for backend in ("triton", "torch") if device.type == "cuda" else ("torch",):
        model.set_kernel_backend(backend)
        for batch in args.verify_batches:
            row = dict(shape=args.verify_shape, kernels=backend, batch=batch, context=args.context)
            for name, q in (("decode", 1), ("verify", args.block + 1)):
                eager, graph = time_step(model, caches, batch, q, args.context, iters=5 if args.quick else 20)
                row[f"{name}_eager_ms"], row[f"{name}_graph_ms"] = eager, graph
            row["verify_over_decode"] = row[f"verify_{kind}_ms"] / row[f"decode_{kind}_ms"]
            result["verify_cost"].append(row)
            write_json(args.out, result)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    model, caches = None, None
    free_memory()


def main() -> None:
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    result = dict(args=vars(args), env=environment(args.device), acceptance=[], verify_cost=[])
    bench_verify_cost(args, result)  # first: the part a time limit must not cut
    bench_acceptance(args, result)
    print_table(
        f"speculative decoding, block {args.block}, {args.output_len} tokens, held-out stdlib prompts "
        f"(goals: DFlash greedy acceptance >= 3, speedup >= 2x at batch 1)", result["acceptance"],
        ["spec", "sampling", "batch", "mean_acceptance", "tokens_per_s", "speedup", "verify_steps"],
    )
    print_table(
        f"verify forward ({args.block + 1} tokens/seq) vs decode step, {args.verify_shape} random weights, "
        f"context {args.context}", result["verify_cost"],
        ["kernels", "batch", "decode_eager_ms", "verify_eager_ms", "decode_graph_ms", "verify_graph_ms",
         "verify_over_decode"],
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
