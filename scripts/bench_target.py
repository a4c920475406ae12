"""Times the target model's forward through the paged cache on one GPU (eager and, for decode,
CUDA-graph replay) for an 8B-shaped Qwen3 with random weights, and checks bf16 / fp32 parity of
a small random model against transformers on the same device. Prints a table, writes JSON.

Run: `python scripts/bench_target.py --out bench_target.json` (CUDA required).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rollout.engine.attention import AttentionMetadata
from rollout.engine.loader import build_model, load_state_into
from rollout.engine.model import ModelConfig

QWEN3_8B = dict(
    model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=40960, tie_word_embeddings=False,
)  # fmt: skip
BLOCK_SIZE = 16


def random_model(cfg: dict, device, dtype):
    model = build_model(ModelConfig.from_hf(cfg), device, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    return model


def metadata(q_lens: list[int], ctx_lens: list[int], device) -> AttentionMetadata:
    """Sequences laid out in consecutive blocks; queries are the last q_len positions of each."""
    pos, slots, tables, first = [], [], [], 0
    for q, c in zip(q_lens, ctx_lens):
        nb = -(-c // BLOCK_SIZE)
        table = list(range(first, first + nb))
        first += nb
        tables.append(table)
        for p in range(c - q, c):
            pos.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
    width = max(len(t) for t in tables)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return AttentionMetadata(
        positions=as_t(pos), slot_mapping=as_t(slots), cu_seqlens_q=as_t(cu), context_lens=as_t(ctx_lens),
        block_tables=as_t([t + [0] * (width - len(t)) for t in tables]), max_query_len=max(q_lens),
        max_context_len=max(ctx_lens), block_size=BLOCK_SIZE,
    )  # fmt: skip


def kv_caches(model, num_blocks: int, device, dtype):
    c = model.config
    shape = (num_blocks, BLOCK_SIZE, c.num_key_value_heads, c.head_dim)
    return [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(c.num_hidden_layers)]  # fmt: skip


def time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def bench_case(model, caches, q_lens, ctx_lens, graph: bool) -> dict:
    device = caches[0][0].device
    meta = metadata(q_lens, ctx_lens, device)
    ids = torch.randint(0, model.config.vocab_size, (sum(q_lens),), device=device)
    step = lambda: model.compute_logits(model(ids, meta, caches)[0][-len(q_lens) :])  # noqa: E731
    with torch.no_grad():
        row = {"q_lens": q_lens[:2], "ctx": ctx_lens[:2], "seqs": len(q_lens), "eager_ms": time_ms(step)}
        if graph:
            step()  # builds the lazy rope table and attention plan outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            row["graph_ms"] = time_ms(g.replay)
    return row


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def parity(device) -> list[dict]:
    """Our model vs transformers on a small random Qwen3 / Llama (one 300-token prefill) on `device`:
    relative logits error of ours and of transformers' own run in `dtype`, both against fp32 HF."""
    import transformers

    classes = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }
    rows = []
    for model_type, (config_cls, model_cls) in classes.items():
        torch.manual_seed(0)
        hf_cfg = config_cls(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=32, initializer_range=0.05,
                            max_position_embeddings=4096)  # fmt: skip
        hf = model_cls(hf_cfg).to(device).eval()
        ids = torch.randint(0, 1000, (300,), device=device)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
        for dtype in (torch.float32, torch.bfloat16):
            ours = build_model(
                ModelConfig.from_hf({**hf_cfg.to_dict(), "model_type": model_type}), device, dtype
            )
            load_state_into(ours, hf.state_dict())
            caches = kv_caches(ours, 64, device, dtype)
            with torch.no_grad():
                got = ours.compute_logits(ours(ids, metadata([300], [300], device), caches)[0])
                hf_low = hf.to(dtype)(ids[None]).logits[0].float()
                hf.float()
            rows.append(
                {
                    "model": model_type,
                    "dtype": str(dtype),
                    "ours_rel_err": rel_err(got, ref),
                    "hf_rel_err": rel_err(hf_low, ref),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_target.json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    device, dtype = torch.device("cuda"), torch.bfloat16
    results = {"parity": parity(device), "qwen3_8b_shape": []}
    for row in results["parity"]:
        print("parity", json.dumps(row))
    model = random_model(QWEN3_8B, device, dtype)
    caches = kv_caches(model, 4096, device, dtype)
    weight_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    cases = [
        ([1], [512], True), ([1], [4096], True), ([1] * 8, [2048] * 8, True), ([1] * 32, [1024] * 32, True),
        ([8], [1024], True), ([2048], [2048], False), ([512] * 4, [512] * 4, False),
    ]  # fmt: skip
    for q_lens, ctx, graph in cases:
        row = bench_case(model, caches, q_lens, ctx, graph)
        results["qwen3_8b_shape"].append(row)
        print(json.dumps(row))
    results["weight_gb"] = weight_gb
    print(f"weights {weight_gb:.1f} GB; at 4.3 TB/s a weight pass takes {weight_gb / 4.3:.2f} ms")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
