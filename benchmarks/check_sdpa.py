"""The drafter's block attention call (`rollout.spec.draft_model._block_attention`) under each SDPA
backend against a float32 MATH reference, at the embedded drafter's shapes and growing context
lengths: a diagnostic for the GPU acceptance collapse (BENCHMARKS.md, issue 4's fourth-session
notes; the lead is pytorch/pytorch#191937, EFFICIENT_ATTENTION with a boolean mask and broadcast
operands). Prints the largest absolute error per (backend, layout, context) and writes JSON.

Layouts: `engine` is the call as the drafter makes it (boolean mask expanded with stride 0 over
heads and queries, `enable_gqa`); `dense` materialises the mask and repeats K/V per query head.

    python benchmarks/check_sdpa.py --device cuda
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import environment, print_table, write_json
from torch.nn.attention import SDPBackend, sdpa_kernel


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 128, 264, 384, 520, 768, 1032])
    p.add_argument("--out", default="benchmarks/results/check_sdpa.json")
    return p.parse_args()


def inputs(args: argparse.Namespace, context: int, gen: torch.Generator) -> dict:
    """Query block [S, Hq, B, D], keys/values [S, Hkv, C+B, D], the drafter's visibility mask."""
    S, B, Hq, Hkv, D = args.seqs, args.block, 4, 2, 64
    q = torch.randn(S, Hq, B, D, generator=gen)
    k = torch.randn(S, Hkv, context + B, D, generator=gen)
    v = torch.randn(S, Hkv, context + B, D, generator=gen)
    lens = torch.randint(context // 2, context + 1, (S,), generator=gen)
    ctx_ok = torch.arange(context)[None, :] < lens[:, None]
    visible = torch.cat([ctx_ok, ctx_ok.new_ones(S, B)], dim=1)[:, None, :].expand(S, B, context + B)
    return dict(q=q, k=k, v=v, visible=visible)


def attend(t: dict, layout: str, dtype: torch.dtype, device: str) -> torch.Tensor:
    q, k, v = (t[n].to(device, dtype) for n in ("q", "k", "v"))
    visible = t["visible"].to(device)
    if layout == "engine":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    mask = visible[:, None].expand(-1, q.shape[1], -1, -1).contiguous()
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1).contiguous(),
                                          v.repeat_interleave(groups, 1).contiguous(), attn_mask=mask)


def main() -> None:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    backends = {"auto": None, "math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    if args.device == "cpu":
        backends = {"auto": None, "math": SDPBackend.MATH}
    gen = torch.Generator().manual_seed(0)
    result = dict(args=vars(args), env=environment(args.device), rows=[])
    for context in args.contexts:
        t = inputs(args, context, gen)
        with sdpa_kernel(SDPBackend.MATH):
            ref = attend(t, "dense", torch.float32, "cpu")
        for name, backend in backends.items():
            for layout in ("engine", "dense"):
                try:
                    if backend is None:
                        out = attend(t, layout, dtype, args.device)
                    else:
                        with sdpa_kernel(backend):
                            out = attend(t, layout, dtype, args.device)
                    err = (out.float().cpu() - ref).abs()
                    row = dict(context=context, backend=name, layout=layout, max_err=err.max().item(),
                               mean_err=err.mean().item(), nan=bool(out.isnan().any()))
                except RuntimeError as e:  # a backend that does not take these inputs
                    row = dict(context=context, backend=name, layout=layout, max_err=float("nan"),
                               mean_err=float("nan"), nan=False, error=str(e).splitlines()[0][:80])
                result["rows"].append(row)
    print_table(f"drafter SDPA vs float32 reference ({args.device}, {args.dtype})", result["rows"],
                ["context", "backend", "layout", "max_err", "mean_err", "nan"])
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
