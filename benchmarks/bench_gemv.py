"""The dense projections of a few-token step through cuBLAS, by BLAS backend (issues 17 and 21).

At batch 1 every projection is a matrix-vector product that should stream its weight at the
copy bandwidth; torch's default cuBLAS heuristic reaches 0.61-0.93 of it on the 8B's shapes and
splits K for some (a reduce kernel more). This times `F.linear` on each projection of a shape
(qkv, o, gate|up, down, the MoE router, the LM head) at a few token counts under each backend
torch can call: cuBLAS, cuBLASLt (`torch.backends.cuda.preferred_blas_library`), `torch.mv` at
one token (ATen's gemv), optionally TunableOp (on CUDA its only candidate is the default
GEMM, so it is a check, not a default arm), and at one token `triton`, rollout's gemv kernel
(triton_gemv.py) under its table's launch and each of `--sweep`'s. Each variant runs as a
CUDA graph over enough copies of the weight that repeats read DRAM, not L2; median of `--reps`.
With `--chain` every projection is timed a second time behind the residual add + RMSNorm kernel
of its input (as in a decode step: the kernel before a projection is a short Triton kernel that
PDL lets the gemv kernel start under).

    python benchmarks/bench_gemv.py --device cuda --out benchmarks/results/bench_gemv.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from common import SHAPES, copy_bandwidth, environment, print_table, time_us, write_json

from rollout.engine import triton_gemv, triton_ops
from rollout.engine.moe_launch import Tiles

BACKENDS = ("cublas", "cublaslt", "mv", "triton", "tunableop")
L2_BYTES = 256 << 20  # copies of a weight until the rotation passes this (H200's L2: 50 MB)


def projections(shape: dict) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of the shape's dense projections."""
    hidden, head_dim = shape["hidden_size"], shape.get("head_dim") or shape["hidden_size"] // shape[
        "num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    out = {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "lm_head": (shape["vocab_size"], hidden)}
    if "num_experts" in shape:
        out["router"] = (shape["num_experts"], hidden)
    else:
        out.update(gate_up=(2 * shape["intermediate_size"], hidden), down=(hidden, shape["intermediate_size"]))
    return out


def set_backend(name: str, results: Path) -> None:
    tunable = torch.cuda.tunable
    tunable.enable(name == "tunableop")
    if name == "tunableop":
        tunable.tuning_enable(True)
        tunable.set_filename(str(results))
        tunable.set_max_tuning_iterations(30)
    else:
        torch.backends.cuda.preferred_blas_library("cublaslt" if name == "cublaslt" else "cublas")


def project(x, w, backend: str | Tiles):
    if isinstance(backend, Tiles):
        return triton_gemv.gemv(x, w, None, backend)
    return torch.mv(w, x[0])[None] if backend == "mv" else F.linear(x, w)


def sweep(spec: list[str]) -> list[Tiles]:
    """`--sweep` entries "block_n,block_k,warps,stages" -> launches."""
    return [Tiles(*(int(v) for v in item.split(","))) for item in spec]


def variants(args, n: int, k: int, tokens: int) -> list[tuple[str, str | Tiles]]:
    """(backend label, what `project` takes) for one weight and token count."""
    out = []
    for backend in args.backends:
        if backend in ("mv", "triton") and tokens != 1:
            continue
        if backend != "triton":
            out.append((backend, backend))
            continue
        table = triton_gemv.launch_for(n, k)
        launches = [launch for launch in dict.fromkeys([table, *sweep(args.sweep)])
                    if launch is not None and k % launch.block_k == 0]
        out += [(f"triton {launch}" + (" (table)" if launch == table else ""), launch) for launch in launches]
    return out


def time_projection(args, name: str, n: int, k: int, bandwidth: float, tmp: Path) -> list[dict]:
    """Rows for one [n, k] weight: each token count under each backend."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    nbytes, rows = n * k * 2, []
    copies = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
              for _ in range(max(2, -(-L2_BYTES // nbytes)))]
    norm = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    for tokens in args.tokens:
        x = torch.randn(tokens, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x.float(), copies[0].float())
        for label, backend in variants(args, n, k, tokens):
            set_backend(label if isinstance(backend, str) else "cublas",
                        tmp / f"tunableop_{name.replace(' ', '_')}_{tokens}.csv")
            err = ((project(x, copies[0], backend).float() - want).norm() / want.norm()).item()
            for chain in (False, True) if args.chain and tokens == 1 else (False,):
                def calls(x=x, b=backend, chain=chain):
                    for w in copies:
                        project(triton_ops.add_rms_norm(x, x, norm, 1e-6)[0] if chain else x, w, b)
                us = time_us(calls, args.device, args.reps) / len(copies)
                rows.append(dict(projection=name, n=n, k=k, tokens=tokens, backend=label, chain=chain, us=us,
                                 of_copy=nbytes / us / 1e-6 / bandwidth, rel_err=err))
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda",))
    p.add_argument("--shapes", nargs="+", default=["qwen3-8b", "qwen3-30b-a3b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS[:3]), choices=BACKENDS)
    p.add_argument("--sweep", nargs="*", default=[], metavar="N,K,WARPS,STAGES",
                   help="more launches of the triton backend")
    p.add_argument("--chain", action="store_true", help="also time each 1-token projection behind a norm kernel")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/bench_gemv.json")
    args = p.parse_args()
    bandwidth = copy_bandwidth(args.device, 4 << 30)
    print(f"device copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)", flush=True)
    rows, tmp = [], Path(tempfile.mkdtemp())
    for shape_name in args.shapes:
        for proj, (n, k) in projections(SHAPES[shape_name]).items():
            rows += time_projection(args, f"{shape_name} {proj}", n, k, bandwidth, tmp)
    set_backend("cublas", tmp / "unused.csv")
    print_table("dense projections at few tokens, us a call (of_copy: weight bytes / time / copy bandwidth)", rows,
                ["projection", "n", "k", "tokens", "backend", "chain", "us", "of_copy", "rel_err"])
    write_json(args.out, dict(args=vars(args), env=environment(args.device), copy_bandwidth_bytes_per_s=bandwidth,
                              rows=rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
