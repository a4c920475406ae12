"""Paged attention alone: the Triton kernel against the torch reference path, Qwen3-8B heads
(32 query heads, 8 KV heads, head_dim 128), block size 16, bfloat16: decode (1 query token per
sequence) and verify (9 tokens per sequence) at batch 1 to 64 and contexts 1k and 4k. For each
shape: the largest absolute difference between the two outputs (the fast path checked against
the simple one) and the time of each, from CUDA graphs of 20 calls. Prints a table, writes JSON.
`--kv-heads 4` gives Qwen3-30B-A3B's heads; `--target-programs` times the kernel at other values
of `triton_attention.TARGET_PROGRAMS` (how far the keys are split; 1: never split, no merge), `--index32 1 0`
with key rows' offsets in int32 (`triton_attention.INDEX32`, the default) and in int64, side by side.

    python benchmarks/bench_attention.py
    python benchmarks/bench_attention.py --batches 1 --contexts 192 1024 --queries 1 --target-programs 1 64 512
    python benchmarks/bench_attention.py --batches 64 256 --index32 1 0
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import captured, environment, print_table, replay_times_ms, write_json

from rollout.engine import triton_attention
from rollout.engine.attention import AttentionMetadata, paged_attention
from rollout.engine.triton_attention import paged_attention_triton, plan_grid

HEADS, HEAD_DIM, BLOCK = 32, 128, 16
CALLS = 20  # calls a timed CUDA graph holds


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--queries", nargs="+", type=int, default=[1, 9])
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of the 32 query heads (8B: 8, 30B-A3B: 4)")
    p.add_argument("--target-programs", nargs="+", type=int, default=[triton_attention.TARGET_PROGRAMS])
    p.add_argument("--index32", nargs="+", type=int, choices=[0, 1], default=[int(triton_attention.INDEX32)],
                   help="key rows' offsets in int32 (1) or int64 (0): triton_attention.INDEX32")
    p.add_argument("--out", default="benchmarks/results/bench_attention.json")
    return p.parse_args()


def case(batch: int, q_len: int, ctx: int, kv_heads: int, dtype=torch.bfloat16):
    """Contexts spread over [ctx/2, ctx], blocks handed out in a scrambled order."""
    gen = torch.Generator().manual_seed(batch * 7919 + ctx + q_len)
    ctx_lens = [ctx // 2 + (ctx // 2) * (i + 1) // batch for i in range(batch)]
    per_seq = -(-ctx // BLOCK)
    num_blocks = batch * per_seq + 1
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = order[: batch * per_seq].view(batch, per_seq)
    positions = torch.cat([torch.arange(c - q_len, c) for c in ctx_lens])
    seq = torch.arange(batch).repeat_interleave(q_len)
    slots = tables[seq, positions // BLOCK] * BLOCK + positions % BLOCK
    dev = "cuda"
    meta = AttentionMetadata(positions=positions.to(dev), slot_mapping=slots.to(dev),
                             cu_seqlens_q=torch.arange(0, batch * q_len + 1, q_len, device=dev),
                             context_lens=torch.tensor(ctx_lens, device=dev), block_tables=tables.to(dev),
                             max_query_len=q_len, max_context_len=ctx, block_size=BLOCK)
    shape = (num_blocks, BLOCK, kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, device=dev, dtype=dtype)
    v_cache = torch.randn(shape, device=dev, dtype=dtype)
    t = batch * q_len
    q = torch.randn(t, HEADS, HEAD_DIM, device=dev, dtype=dtype)
    k = torch.randn(t, kv_heads, HEAD_DIM, device=dev, dtype=dtype)
    v = torch.randn(t, kv_heads, HEAD_DIM, device=dev, dtype=dtype)
    return q, k, v, k_cache, v_cache, meta


def measure(batch: int, q_len: int, ctx: int, kv_heads: int, scale: float, index32s: list[int]) -> list[dict]:
    """One row for each value of triton_attention.INDEX32 in index32s, on the same case."""
    q, k, v, k_cache, v_cache, meta = case(batch, q_len, ctx, kv_heads)
    ref32 = paged_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, scale)
    want = paged_attention(q, k, v, k_cache, v_cache, meta, scale)  # also writes k/v into the caches

    def triton_fn():
        return paged_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      meta.cu_seqlens_q, meta.max_query_len, meta.max_context_len, scale)

    def torch_fn():
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    graphs, diffs = [captured(torch_fn, CALLS)], []
    for index32 in index32s:
        triton_attention.INDEX32 = bool(index32)  # paged_attention_triton reads it at each call
        diffs.append((triton_fn().float() - ref32).abs().max().item())
        graphs.append(captured(triton_fn, CALLS))
    torch_ms, *triton_ms = (statistics.median(t) for t in replay_times_ms(graphs, CALLS, repeats=5))
    shared = dict(context=ctx, q_len=q_len, batch=batch, kv_heads=kv_heads,
                  target_programs=triton_attention.TARGET_PROGRAMS,
                  plan=str(plan_grid(batch, kv_heads, HEADS // kv_heads, q_len, ctx)), torch_ms=torch_ms,
                  max_diff_torch_fp32=(want.float() - ref32).abs().max().item())
    return [dict(shared, index32=index32, triton_ms=ms, speedup=torch_ms / ms, max_diff_triton_fp32=diff)
            for index32, ms, diff in zip(index32s, triton_ms, diffs, strict=True)]


def main() -> None:
    args = parse_args()
    scale = HEAD_DIM**-0.5
    result = dict(args=vars(args), env=environment("cuda"), rows=[])
    for ctx in args.contexts:
        for q_len in args.queries:
            for batch, programs in ((b, t) for b in args.batches for t in args.target_programs):
                triton_attention.TARGET_PROGRAMS = programs  # plan_grid reads it at each call
                for row in measure(batch, q_len, ctx, args.kv_heads, scale, args.index32):
                    result["rows"].append(row)
                    print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
                torch.cuda.empty_cache()
    print_table("paged attention per layer call, ms (bf16; diffs against a float32 torch reference)",
                result["rows"], ["context", "q_len", "batch", "kv_heads", "target_programs", "index32", "plan",
                                 "torch_ms", "triton_ms", "speedup",
                                 "max_diff_triton_fp32", "max_diff_torch_fp32"])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
