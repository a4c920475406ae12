"""Fused elementwise kernels of a decoder layer, in Triton, each replacing several torch kernels.

At small batches a step is bound by reading the weights, and the torch layer adds dozens of
small kernels per layer (norms, RoPE's roll/mul/addcmul, cache writes, SiLU and product,
residual adds) whose launches cost a large share of that again, even inside a CUDA graph
(BENCHMARKS.md, "Figures once quoted in code comments"). These kernels do the same arithmetic
in three launches per layer pair:

* `qk_norm_rope_store`: from the packed qkv projection, per token: q/k RMSNorm (Qwen3), RoPE
  from the engine's cos / signed-sin table, q out, k and v written into the paged cache;
* `add_rms_norm`: s = x + residual and RMSNorm(s) in one pass (both returned);
* `silu_mul`: silu(gate) * up from the packed gate|up projection.

Each has a torch reference in `model.py` that the tests compare it with (on CPU through
Triton's interpreter, see tests/conftest.py). They compute in float32 and round once at the
end, so they differ from the bfloat16 torch path by bfloat16 rounding only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollout.engine import triton_attention, triton_gemv, triton_moe, triton_pdl
from rollout.engine.triton_attention import triton
from rollout.errors import InvalidArgument

if triton is not None:
    import triton.language as tl

    from rollout.engine.triton_pdl import start as pdl_start

    @triton.jit
    def _qk_norm_rope_store_kernel(
        qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, pos_ptr, table_ptr, q_w_ptr, k_w_ptr,
        eps, stride_qkv, stride_table, stride_kc, stride_vc,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_BLOCK: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)  # token x row width passes 2**31 in large steps
        heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)  # q heads, then k heads, then v heads
        dims = tl.arange(0, HEAD_DIM)
        total = NUM_HEADS + 2 * NUM_KV_HEADS
        ok = heads < total
        half = HEAD_DIM // 2
        is_q = heads < NUM_HEADS
        is_k = (heads >= NUM_HEADS) & (heads < NUM_HEADS + NUM_KV_HEADS)
        # before the PDL wait: the step's metadata and the norm weights, which the previous kernel (the
        # qkv projection) does not write
        pos = tl.load(pos_ptr + t)
        slot = tl.load(slot_ptr + t)
        if QK_NORM:
            w = tl.where(is_q[:, None], tl.load(q_w_ptr + dims)[None, :].to(tl.float32),
                         tl.load(k_w_ptr + dims)[None, :].to(tl.float32))
            w_rolled = tl.where(is_q[:, None], tl.load(q_w_ptr + (dims + half) % HEAD_DIM)[None, :].to(tl.float32),
                                tl.load(k_w_ptr + (dims + half) % HEAD_DIM)[None, :].to(tl.float32))
        pdl_start(PDL)
        cos = tl.load(table_ptr + pos * stride_table + dims).to(tl.float32)  # [D] (the table: after the wait,
        sin = tl.load(table_ptr + pos * stride_table + HEAD_DIM + dims).to(tl.float32)  # torch builds it lazily)
        base = qkv_ptr + t * stride_qkv + heads[:, None] * HEAD_DIM
        x = tl.load(base + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)  # [P, D]
        rolled = tl.load(base + ((dims + half) % HEAD_DIM)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        if QK_NORM:
            inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)  # [P]
            normed = x * inv[:, None] * w
            normed_rolled = rolled * inv[:, None] * w_rolled
        else:
            normed = x
            normed_rolled = rolled
        rotated = normed * cos[None, :] + normed_rolled * sin[None, :]
        out = tl.where((is_q | is_k)[:, None], rotated, x)  # v heads pass through
        tl.store(q_out_ptr + t * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :],
                 out.to(q_out_ptr.dtype.element_ty), mask=is_q[:, None])
        kv_head = tl.where(is_k, heads - NUM_HEADS, heads - NUM_HEADS - NUM_KV_HEADS)
        tl.store(k_cache_ptr + slot * stride_kc + kv_head[:, None] * HEAD_DIM + dims[None, :],
                 out.to(k_cache_ptr.dtype.element_ty), mask=is_k[:, None])
        is_v = ok & ~is_q & ~is_k
        tl.store(v_cache_ptr + slot * stride_vc + kv_head[:, None] * HEAD_DIM + dims[None, :],
                 out.to(v_cache_ptr.dtype.element_ty), mask=is_v[:, None])

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, router_ptr, logits_ptr, eps, stride_x,
                             stride_res, SIZE: tl.constexpr, BLOCK: tl.constexpr, ROUTER_ROWS: tl.constexpr,
                             NUM_EXPERTS: tl.constexpr, PDL: tl.constexpr):
        """A program per (token, router tile). Every program computes its token's sum and norm;
        tile 0 stores them. With ROUTER_ROWS > 0, each also multiplies the normed row by its
        ROUTER_ROWS rows of the router ([E, SIZE]) -> logits [T, E]. Weights are read before the
        PDL wait (no kernel of a step writes them), so that read overlaps the previous kernel."""
        cols = tl.arange(0, BLOCK)
        ok = cols < SIZE
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if ROUTER_ROWS > 0:
            experts = tl.program_id(1) * ROUTER_ROWS + tl.arange(0, ROUTER_ROWS)
            e_ok = experts < NUM_EXPERTS
            r = tl.load(router_ptr + experts[:, None] * SIZE + cols[None, :], mask=e_ok[:, None] & ok[None, :],
                        other=0.0)  # [RR, BLOCK]
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)  # token x row width passes 2**31 in large steps
        s = (tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
             + tl.load(res_ptr + t * stride_res + cols, mask=ok, other=0.0).to(tl.float32))
        s = s.to(sum_ptr.dtype.element_ty)  # the residual stream keeps the model's dtype
        s32 = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(s32 * s32, 0) / SIZE + eps)
        normed = (s32 * inv * w).to(out_ptr.dtype.element_ty)
        if tl.program_id(1) == 0:
            tl.store(sum_ptr + t * SIZE + cols, s, mask=ok)
            tl.store(out_ptr + t * SIZE + cols, normed, mask=ok)
        if ROUTER_ROWS > 0:
            logits = tl.sum(r.to(tl.float32) * normed.to(tl.float32)[None, :], 1)
            tl.store(logits_ptr + t * NUM_EXPERTS + experts, logits.to(logits_ptr.dtype.element_ty), mask=e_ok)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, SIZE: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)  # 262,144 tokens x 2 x 12,288 (8B's gate|up) passes 2**31
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < SIZE
        gate = tl.load(gate_up_ptr + t * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + t * stride_in + SIZE + cols, mask=ok, other=0.0).to(tl.float32)
        # silu in float32, rounded like torch's silu output before the product
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def qk_norm_rope_store(qkv: Tensor, positions: Tensor, table: Tensor, q_weight: Tensor | None,
                       k_weight: Tensor | None, eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
                       k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """qkv: [T, (Hq + 2 Hkv) * D] -> q [T, Hq, D] normed and rotated; k (normed, rotated) and v
    written at `slot_mapping` of the [NB, BS, Hkv, D] caches. table: RotaryEmbedding.table."""
    num_tokens = qkv.shape[0]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("qk_norm_rope_store needs contiguous caches (a slot is block * block_size + offset)")
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    qk_norm = q_weight is not None
    # heads over several programs: a decode step of one token is otherwise one program on one SM
    head_block = min(16, triton.next_power_of_2(num_heads + 2 * num_kv_heads))
    _qk_norm_rope_store_kernel[(num_tokens, triton.cdiv(num_heads + 2 * num_kv_heads, head_block))](
        qkv, q, k_cache, v_cache, slot_mapping, positions, table,
        q_weight if qk_norm else qkv, k_weight if qk_norm else qkv, eps,
        qkv.stride(0), table.stride(0), k_cache.stride(1), v_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEAD_BLOCK=head_block, QK_NORM=qk_norm, **triton_pdl.launch(qkv),
    )
    return q


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, residual: [T, H] -> (rms_norm(x + residual) * weight, x + residual), new tensors."""
    out, total, _ = _add_rms_norm(x, residual, weight, eps, None, 0)
    return out, total


ROUTER_ROWS = 2  # router rows per program of add_rms_norm_router: 64 programs for 128 experts. H200, 1
# token (bench_moe, two runs): 2 rows 4.4 / 3.4 us, 4 rows 4.3 / 5.8, 8 rows 5.0 / 5.0; the norm + GEMM 7.5


def add_rms_norm_router(x: Tensor, residual: Tensor, weight: Tensor, eps: float, router: Tensor,
                        router_rows: int = ROUTER_ROWS) -> tuple[Tensor, Tensor, Tensor]:
    """`add_rms_norm` and a MoE layer's router logits on its output in one launch: router [E, H]
    -> (out, total, logits [T, E] = out @ router.T in out's dtype). Each token's norm is computed
    again by each of its E / router_rows programs, so this is for small steps (decode); larger
    ones are better served by the router's GEMM."""
    if router.stride(1) != 1 or router.stride(0) != router.shape[1]:
        raise ValueError("add_rms_norm_router needs a contiguous router weight")
    if router_rows < 1 or router_rows & (router_rows - 1):
        raise ValueError(f"add_rms_norm_router router_rows must be a power of two, got {router_rows}")
    return _add_rms_norm(x, residual, weight, eps, router, router_rows)


def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, router: Tensor | None,
                  router_rows: int) -> tuple[Tensor, Tensor, Tensor | None]:
    out, total = torch.empty_like(residual), torch.empty_like(residual)
    num_tokens, size = residual.shape
    experts = 0 if router is None else router.shape[0]
    logits = None if router is None else torch.empty(num_tokens, experts, dtype=residual.dtype,
                                                      device=residual.device)
    if num_tokens:
        tiles = 1 if router is None else triton.cdiv(experts, router_rows)
        _add_rms_norm_kernel[(num_tokens, tiles)](
            x, residual, weight, out, total, out if router is None else router, out if logits is None else logits,
            eps, x.stride(0), residual.stride(0), SIZE=size, BLOCK=triton.next_power_of_2(size),
            ROUTER_ROWS=0 if router is None else router_rows, NUM_EXPERTS=experts, **triton_pdl.launch(residual))
    return out, total, logits


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up: [T, 2I] (gate | up) -> silu(gate) * up: [T, I]."""
    num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = 1024
        _silu_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), SIZE=size, BLOCK=block, **triton_pdl.launch(gate_up))
    return out


def choose_backend(requested: str, head_dim: int, weight: Tensor) -> str:
    """The attention backend for `requested` ("auto", "triton" or "torch"): "auto" is the Triton
    kernel on CUDA when it supports the shape; "triton" where it cannot run is InvalidArgument."""
    fits = triton_attention.supported(head_dim, weight.dtype, weight.device)
    if requested == "auto":
        return "triton" if fits and weight.device.type == "cuda" else "torch"
    if requested == "triton" and not fits:
        raise InvalidArgument("kernel_backend", f"triton does not run head_dim {head_dim} {weight.dtype} on "
                                                f"{weight.device} here (needs CUDA or TRITON_INTERPRET=1)")
    return requested


def compiled_variants() -> int:
    """Specialisations of this package's Triton kernels that this process has compiled (or loaded
    from Triton's disk cache) so far. A launch needing a new one compiles it first, inside its
    step: constexprs and integer arguments equal to 1 or divisible by 16 pick the variant. Read
    from Triton's per-device kernel caches; 0 under the interpreter, which compiles nothing."""
    if triton is None:
        return 0
    kernels = (_qk_norm_rope_store_kernel, _add_rms_norm_kernel, _silu_mul_kernel,
               triton_attention._attn_kernel, triton_attention._merge_kernel, *triton_moe.KERNELS,
               *triton_gemv.KERNELS)
    return sum(len(cache[0]) for k in kernels for cache in getattr(k, "device_caches", {}).values())
