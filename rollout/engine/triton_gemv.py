"""Dense projections of 1-token steps (decode at batch 1) as a Triton matrix-vector product.

At batch 1 a projection streams its weight once and does two FLOPs per element: its time is the
weight's bytes over the memory bandwidth plus what the launch costs around them. cuBLAS reaches
the bandwidth on large weights in steady state, but a decode step is a chain of ~10 kernels a
layer, and each cuBLAS GEMV starts its first weight load only after the kernel before it has
finished (its launch, its ramp, and on K-split shapes a reduce kernel more).

`_gemv_kernel` joins the chain of programmatic dependent launches (triton_pdl): it is launched
while the kernel before it (a residual add + RMSNorm, attention's merge, silu * up) still runs
and starts streaming the moment that kernel's output is visible. A program owns BLOCK_N output
rows of the weight [N, K] and walks K in BLOCK_K steps with tl.dot, the token in row 0 of 16 (the
other rows zero) so that Triton pipelines the weight loads that feed the dot (cp.async): an
elementwise product summed per tile got no pipelining (triton_moe.py, BENCHMARKS.md issue 21).
Asking L2 for the first weight rows before the PDL wait was measured too, and lost (BENCHMARKS.md,
ninth session).

`linear` is what the layers (and the LM head) call in the Triton backend: the kernel for 1-token
steps on CUDA when `launch_for` has an entry for the weight (where it was measured faster than
cuBLAS), F.linear otherwise. The kernel sums in another order than cuBLAS, so results differ from
F.linear by float rounding (greedy tokens of random-weight models can differ); tests compare the
two through Triton's interpreter. On an H200 it took the 8B at batch 1 from 214 to 232 tokens/s
(BENCHMARKS.md, ninth session).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rollout.engine import triton_pdl
from rollout.engine.moe_launch import Tiles
from rollout.engine.triton_attention import triton

ENABLED = True  # read at each call, like triton_pdl.ENABLED (bench_engine --compare cublas-gemv)
DTYPES = (torch.bfloat16, torch.float16)
MIN_WEIGHT_ELEMENTS = 1 << 24  # H200, bench_gemv: the 8B's 4096 x 4096 and up gained; the 30B-A3B's
# qkv (5120 x 2048) and o (2048 x 4096) tied cuBLAS behind a norm; the embedded model lost 3.5% (call 2)


# Launch parameters (Tiles, as the MoE kernels'). H200, bench_gemv behind a norm kernel (ninth session, call 4),
# us against cuBLAS: 8B qkv 16.7 / 18.1, gate|up 52.7 / 56.9, LM head 283 / 302 with 4 stages; o 12.1 / 14.1 and
# down 29.7 / 33.1 with 5 (4 stages: 12.6 and 31.4; 5 lost on the wider weights)
WIDE = Tiles(block_n=32, block_k=256, warps=2, stages=4)
NARROW = Tiles(block_n=32, block_k=256, warps=2, stages=5)  # weights of MIN_ROWS rows
MIN_ROWS = 4096  # >= 128 programs of WIDE's 32 rows: one per SM of a 132-SM part


def launch_for(n: int, k: int) -> Tiles | None:
    """The launch for a 1-token product with a [n, k] weight, or None (F.linear): weights of at
    least MIN_WEIGHT_ELEMENTS with MIN_ROWS rows or more whose K is a multiple of block_k (no
    masked loads in the loop)."""
    if k % WIDE.block_k or n < MIN_ROWS or n * k < MIN_WEIGHT_ELEMENTS:
        return None
    return NARROW if n == MIN_ROWS else WIDE


def dot_precision(x: Tensor) -> str:
    """tl.dot's input precision for x's dtype: float32 stays float32 (the interpreter's tests)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


if triton is not None:
    import triton.language as tl

    from rollout.engine.triton_pdl import start as pdl_start

    @triton.jit
    def padded_row(row_ptr, ks, k_ok, ROW):
        """The row's elements `ks` as row ROW of a [16, BK] tile of zeros (tl.dot needs 16 rows: the
        one-token products here and triton_moe's gemv path put their token in one of them)."""
        rows = tl.arange(0, 16)
        return tl.load(row_ptr + rows[:, None] * 0 + ks[None, :], mask=(rows == ROW)[:, None] & k_ok[None, :],
                       other=0.0)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, stride_w, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     PDL: tl.constexpr):
        # x: [K] (one token), w: [N, K] row-major, out: [N]; K a multiple of BLOCK_K
        pdl_start(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w = w_ptr + rows.to(tl.int64)[None, :] * stride_w  # [1, BN]: the tiles are [BK, BN]
        acc = tl.zeros([16, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = padded_row(x_ptr, ks, ks < K, 0)
            acc = tl.dot(a, tl.load(w + ks[:, None], mask=row_ok[None, :], other=0.0), acc,
                         input_precision=DOT_PRECISION)
        y = tl.sum(acc, 0)  # rows 1-15 are zeros
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)

    KERNELS = (_gemv_kernel,)  # triton_ops.compiled_variants
else:
    KERNELS = ()


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None, launch: Tiles) -> Tensor:
    """x: [1, K] -> x @ weight.T + bias: [1, N]; weight [N, K] contiguous in K, K a multiple of
    launch.block_k."""
    (n, k), dtype = weight.shape, x.dtype
    if launch.block_n < 16 or launch.block_k < 16:
        raise ValueError(f"gemv launch block_n and block_k must be >= 16 (tl.dot), got {launch}")
    if x.shape != (1, k) or weight.stride(1) != 1 or x.stride(1) != 1 or k % launch.block_k:
        raise ValueError(f"gemv needs x [1, {k}] and a weight contiguous in K, a multiple of {launch.block_k}; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)} strides {weight.stride()}")
    out = torch.empty(1, n, dtype=dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        x, weight, bias if bias is not None else weight, out, n, weight.stride(0), K=k, HAS_BIAS=bias is not None,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, DOT_PRECISION=dot_precision(x),
        num_warps=launch.warps, num_stages=launch.stages, **triton_pdl.launch(x))
    return out


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through the gemv kernel where it is taken: a 1-token step on CUDA with a weight of
    DTYPES that `launch_for` has an entry for."""
    if ENABLED and x.shape[0] == 1 and x.is_cuda and x.dtype in DTYPES and weight.dtype == x.dtype:
        launch = launch_for(*weight.shape)
        if launch is not None and weight.stride(1) == 1 and x.stride(1) == 1:
            return gemv(x, weight, bias, launch)
    return F.linear(x, weight, bias)
