"""Linear layers of small models' few-token steps (decode at small batch, a short verify), in Triton.

A decode step of a small model (the embedded one, a drafter's head) is a chain of tiny kernels
whose launches cost more than their arithmetic: a layer's residual add + RMSNorm, its qkv
projection, the down projection's silu(gate) * up are each a launch. `skinny_linear` folds those
into the projection: a program owns BLOCK_N output columns for all the step's tokens and walks the
whole K dimension in BLOCK_K chunks (one token reduces with float32 multiply-adds; two to 16 pad
to 16 and use tl.dot), applying to its input as it loads it silu(gate) * up of a packed gate|up
row (`silu_input`) or the residual add and RMSNorm (`add_norm`: every program norms the rows
itself from L2, program 0 writes the sum), with the roundings of triton_ops.silu_mul and
add_rms_norm.

It is not a faster matrix-vector product for large weights: on an H200 it reached 0.48-0.77 of
the copy bandwidth on the 8B's and 30B-A3B's projections where cuBLAS reached 0.61-0.93, its
fused norm cost ~5 us a call more than the separate kernel, and the 8B decoded at 0.82x with it
at batch 1 (BENCHMARKS.md, issue 17). So `Launch.rule` takes it only for weights of at most
MAX_WEIGHT_ELEMENTS, where launches, not bytes, set the time.

`linear` is what the layers call (the Triton kernel backend): the kernel where `Launch.rule` says,
F.linear otherwise. The kernel sums in another order than cuBLAS, so results differ from F.linear
by float rounding; tests compare the two through Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rollout.engine import triton_attention
from rollout.engine.triton_attention import triton

MAX_TOKENS = 16  # the kernel's tl.dot path pads the tokens to this
MAX_WEIGHT_ELEMENTS = 1 << 20  # 2 MB of bfloat16; from 17 MB up cuBLAS was measured faster
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Launch:
    """One kernel configuration: output columns and K elements per program, warps, stages."""

    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3

    @staticmethod
    def rule(num_tokens: int, n: int, k: int) -> Launch | None:
        """The launch for a [num_tokens, k] x [n, k]^T product, or None for F.linear (more tokens,
        a larger weight, K not a multiple of 64). Columns per program shrink until the grid has
        about two programs per SM of a 132-SM part."""
        if not 1 <= num_tokens <= MAX_TOKENS or k % 64 or n * k > MAX_WEIGHT_ELEMENTS:
            return None
        block_n = 32 if num_tokens == 1 else 64
        while block_n > (8 if num_tokens == 1 else 16) and -(-n // block_n) < 256:
            block_n //= 2
        block_k = 512 if num_tokens == 1 else 128
        while k % block_k:
            block_k //= 2
        return Launch(block_n=block_n, block_k=block_k)


PLAIN, SILU_MUL, ADD_NORM = 0, 1, 2  # what the kernel applies to its input as it loads it


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _residual_sum(x_ptr, res_ptr, tok, cols, tok_ok, stride_x, stride_res):
        """(x + residual)[tok, cols] rounded to the residual's dtype, as float32 ([TOKENS, BLOCK_K])."""
        s = (tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=tok_ok[:, None], other=0.0).to(tl.float32)
             + tl.load(res_ptr + tok[:, None] * stride_res + cols[None, :], mask=tok_ok[:, None],
                       other=0.0).to(tl.float32))
        return s.to(res_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _load_input(x_ptr, res_ptr, norm_ptr, inv, tok, cols, tok_ok, stride_x, stride_res, K,
                    INPUT: tl.constexpr):
        """The kernel's input at [tok, cols] as float32 ([TOKENS, BLOCK_K]), rounded to x's dtype
        as the unfused ops round it: x itself; SILU_MUL: silu(gate) * up of a packed gate|up row
        (gate at cols, up at K + cols; triton_ops.silu_mul); ADD_NORM: rms_norm(x + residual) *
        norm weight, `inv` the rows' 1 / rms (triton_ops.add_rms_norm)."""
        ptrs = x_ptr + tok[:, None] * stride_x + cols[None, :]
        if INPUT == 1:
            gate = tl.load(ptrs, mask=tok_ok[:, None], other=0.0).to(tl.float32)
            up = tl.load(ptrs + K, mask=tok_ok[:, None], other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
            return (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        if INPUT == 2:
            s = _residual_sum(x_ptr, res_ptr, tok, cols, tok_ok, stride_x, stride_res)
            w = tl.load(norm_ptr + cols).to(tl.float32)
            return (s * inv[:, None] * w[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
        return tl.load(ptrs, mask=tok_ok[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, norm_ptr, sum_ptr, eps, num_tokens, N, K,
                       stride_x, stride_w, stride_out, stride_res,
                       HAS_BIAS: tl.constexpr, INPUT: tl.constexpr, TOKENS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # x: [num_tokens, K] (SILU_MUL: [num_tokens, 2K], gate | up), w: [N, K], out: [num_tokens, N];
        # ADD_NORM: residual [num_tokens, K], norm weight [K], and the sum written to sum_ptr [num_tokens, K]
        cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols_n < N
        tok = tl.arange(0, TOKENS)
        tok_ok = tok < num_tokens
        inv = tl.zeros([TOKENS], dtype=tl.float32)
        if INPUT == 2:  # every program norms the rows itself (they are in L2); program 0 writes the sum
            squares = tl.zeros([TOKENS], dtype=tl.float32)
            writes = tok < tl.where(tl.program_id(0) == 0, num_tokens, 0)  # [TOKENS]
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                s = _residual_sum(x_ptr, res_ptr, tok, cols, tok_ok, stride_x, stride_res)
                squares += tl.sum(s * s, 1)
                tl.store(sum_ptr + tok[:, None] * K + cols[None, :], s.to(sum_ptr.dtype.element_ty),
                         mask=writes[:, None])
            inv = 1.0 / tl.sqrt(squares / K + eps)
        w_rows = w_ptr + cols_n.to(tl.int64)[:, None] * stride_w  # N x K passes 2**31 in an LM head
        if TOKENS == 1:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, TOKENS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K (Launch.rule, skinny_linear)
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
            x = _load_input(x_ptr, res_ptr, norm_ptr, inv, tok, cols, tok_ok, stride_x, stride_res, K, INPUT)
            if TOKENS == 1:
                acc += tl.sum(w.to(tl.float32) * x, 1)
            else:
                acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc, input_precision="ieee")  # float32: no tf32
        if TOKENS == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + cols_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + tok[None, :] * stride_out + cols_n[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=n_ok[:, None] & tok_ok[None, :])


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None, launch: Launch, silu_input: bool = False,
                  add_norm: tuple[Tensor, Tensor, float] | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """x: [T, K] -> x @ weight.T + bias: [T, N], T <= MAX_TOKENS; weight: [N, K], row-major, K a
    multiple of launch.block_k. silu_input: x is [T, 2K] (gate | up) and the product is taken of
    silu(gate) * up. add_norm = (residual [T, K], norm weight [K], eps): the product is taken of
    rms_norm(x + residual) * norm weight, and (out, x + residual) is returned."""
    num_tokens, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if x.shape[1] != (2 * k if silu_input else k) or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    if not 1 <= num_tokens <= MAX_TOKENS or k % launch.block_k:
        raise ValueError(f"skinny_linear takes 1..{MAX_TOKENS} tokens and K a multiple of "
                         f"{launch.block_k}, got {num_tokens} x {k}")
    out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    residual, norm, eps = add_norm if add_norm is not None else (x, weight, 0.0)
    total = torch.empty_like(residual) if add_norm is not None else out
    if residual.shape != x.shape or residual.stride(1) != 1:
        raise ValueError(f"skinny_linear: residual {tuple(residual.shape)} against x {tuple(x.shape)}")
    _skinny_kernel[(triton.cdiv(n, launch.block_n),)](
        x, weight, bias if bias is not None else weight, out, residual, norm, total, eps, num_tokens, n, k,
        x.stride(0), weight.stride(0), out.stride(0), residual.stride(0), HAS_BIAS=bias is not None,
        INPUT=ADD_NORM if add_norm is not None else SILU_MUL if silu_input else PLAIN,
        TOKENS=1 if num_tokens == 1 else MAX_TOKENS, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        num_warps=launch.warps, num_stages=launch.stages)
    return (out, total) if add_norm is not None else out


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x: [T, K] -> [T, N]: the skinny kernel for few tokens where Triton runs, else F.linear."""
    launch = _launch_for(x, weight)
    return skinny_linear(x, weight, bias, launch) if launch is not None else F.linear(x, weight, bias)


def silu_mul_linear(gate_up: Tensor, weight: Tensor) -> Tensor | None:
    """gate_up: [T, 2I] -> (silu(gate) * up) @ weight.T: [T, N] in one kernel, or None where the
    skinny kernel does not apply (the caller runs triton_ops.silu_mul and a plain linear)."""
    launch = _launch_for(gate_up, weight)
    return skinny_linear(gate_up, weight, None, launch, silu_input=True) if launch is not None else None


def add_norm_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                    bias: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """x, residual: [T, K] -> (rms_norm(x + residual) * norm_weight @ weight.T + bias: [T, N],
    x + residual: [T, K]) in one kernel (triton_ops.add_rms_norm, then `linear`), or None where
    the skinny kernel does not apply."""
    launch = _launch_for(x, weight)
    if launch is None or residual.dtype != x.dtype:
        return None
    return skinny_linear(x, weight, bias, launch, add_norm=(residual, norm_weight, eps))


def _launch_for(x: Tensor, weight: Tensor) -> Launch | None:
    if not triton_attention.runs_on(weight.device) or x.dtype != weight.dtype or weight.dtype not in DTYPES:
        return None
    return Launch.rule(x.shape[0], weight.shape[0], weight.shape[1])
