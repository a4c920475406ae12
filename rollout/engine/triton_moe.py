"""The mixture-of-experts layer in Triton: routing, the tokens sorted by expert, two grouped GEMMs.

A step's T tokens pick k experts each: M = T * k (token, expert) pairs, pair p = t * k + j.

1. `_route_kernel` (a program per BLOCK_T tokens): softmax of the router logits in float32, the
   k largest by repeated arg-max (ties to the lowest id), renormalised when asked: weights and
   ids [T, k], as `moe.route` computes them. Steps of at most FUSED_ROUTE_TOKENS tokens (decode,
   small verify steps) route inside the align program instead, saving a launch per layer.
2. `_align_kernel` (one program): the pairs sorted by expert (stable), each expert's run padded
   to a multiple of BLOCK_M rows, as vLLM's moe_align_block_size does: `sorted_pairs`
   [max_blocks * BLOCK_M] (padding rows hold M) and `block_expert` [max_blocks] (-1 for unused
   blocks). `max_blocks` bounds the padded blocks of every routing of M pairs, so buffers and
   grids depend on T alone: no host sync, and decode / verify steps can be CUDA graphs.
3. `_gate_up_kernel` (a program per (block, column tile)): the block's rows of x, gathered by
   token, times its expert's gate and up rows; silu(gate) * up -> `hidden` [max_blocks * BLOCK_M, I].
4. `_down_kernel`: `hidden` times the expert's down_proj, times the pair's routing weight ->
   `pair_out` [M, H]; torch then sums each token's k rows (accumulating in float32).

Programs of unused blocks exit at once. Index products that can pass 2^31 (expert * expert
stride of large models, row * row stride of big steps) are computed in int64. The GEMMs
accumulate in float32 and round where the torch path rounds (the projections' outputs, silu,
the product), so on bfloat16 they differ from `moe.experts_reference` by rounding order only.
The kernels run on CPU tensors through Triton's interpreter (the tests compare them with the
torch reference there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollout.engine.triton_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _route_tile(logits_ptr, weights_ptr, ids_ptr, tokens, num_tokens, stride_lt,
                    NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr, TOP_K: tl.constexpr,
                    TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
        experts = tl.arange(0, EXPERTS_P2)
        slots = tl.arange(0, TOP_K_P2)
        ok, real = tokens < num_tokens, experts < NUM_EXPERTS
        logits = tl.load(logits_ptr + tokens.to(tl.int64)[:, None] * stride_lt + experts[None, :],
                         mask=ok[:, None] & real[None, :], other=0.0).to(tl.float32)  # [BT, EP]
        logits = tl.where(real[None, :], logits, float("-inf"))
        exp = tl.exp(logits - tl.max(logits, 1)[:, None])
        probs = exp / tl.sum(exp, 1)[:, None]
        top_w = tl.zeros([BLOCK_T, TOP_K_P2], tl.float32)
        top_i = tl.zeros([BLOCK_T, TOP_K_P2], tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(probs, 1)  # [BT]
            pick = tl.min(tl.where(probs == best[:, None], experts[None, :], EXPERTS_P2), 1)  # lowest id
            top_w = tl.where(slots[None, :] == j, best[:, None], top_w)
            top_i = tl.where(slots[None, :] == j, pick[:, None], top_i)
            probs = tl.where(experts[None, :] == pick[:, None], -1.0, probs)  # probabilities are >= 0
        if RENORMALIZE:
            top_w = top_w / tl.sum(top_w, 1)[:, None]
        out = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]
        keep = ok[:, None] & (slots < TOP_K)[None, :]
        tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=keep)
        tl.store(ids_ptr + out, top_i, mask=keep)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, stride_lt,
                      NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr, TOP_K: tl.constexpr,
                      TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
        _route_tile(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T),
                    num_tokens, stride_lt, NUM_EXPERTS, EXPERTS_P2, TOP_K, TOP_K_P2, RENORMALIZE, BLOCK_T)

    @triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
    def _align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens, num_blocks,
                      stride_lt, NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr, TOP_K: tl.constexpr,
                      TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, ROUTE: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
        if ROUTE:  # a small step: this program routes the tokens first (one launch less)
            for t0 in range(0, num_tokens, BLOCK_T):
                _route_tile(logits_ptr, weights_ptr, ids_ptr, t0 + tl.arange(0, BLOCK_T), num_tokens, stride_lt,
                            NUM_EXPERTS, EXPERTS_P2, TOP_K, TOP_K_P2, RENORMALIZE, BLOCK_T)
            tl.debug_barrier()  # the ids are read back below by other threads of this program
        num_pairs = num_tokens * TOP_K
        experts = tl.arange(0, EXPERTS_P2)
        lanes = tl.arange(0, CHUNK)
        counts = tl.zeros([EXPERTS_P2], tl.int32)
        for start in range(0, num_pairs, CHUNK):
            ids = tl.load(ids_ptr + start + lanes, mask=start + lanes < num_pairs, other=EXPERTS_P2)
            counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)  # expert e owns padded rows [ends - padded, ends)
        starts = ends - padded
        # every block's expert (-1 past the last used row) and the padding rows' sentinel
        for b0 in range(0, num_blocks, CHUNK):
            blocks = b0 + lanes
            first = blocks * BLOCK_M
            expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)  # [C]
            filled = tl.sum(tl.where(expert[:, None] == experts[None, :], (starts + counts)[None, :], 0), 1)
            tl.store(block_expert_ptr + blocks, tl.where(expert < NUM_EXPERTS, expert, -1), mask=blocks < num_blocks)
            rows = first[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [C, BM]
            pad = (rows >= filled[:, None]) & (blocks < num_blocks)[:, None]
            tl.store(sorted_ptr + rows, tl.zeros([CHUNK, BLOCK_M], tl.int32) + num_pairs, mask=pad)
        # each pair's row: its expert's start + the pairs of that expert before it
        placed = tl.zeros([EXPERTS_P2], tl.int32)
        for start in range(0, num_pairs, CHUNK):
            pairs = start + lanes
            ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=EXPERTS_P2)
            onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [C, EP]
            before = tl.cumsum(onehot, 0) - onehot + (starts + placed)[None, :]
            tl.store(sorted_ptr + tl.sum(onehot * before, 1), pairs, mask=pairs < num_pairs)
            placed += tl.sum(onehot, 0)

    @triton.jit(do_not_specialize=["num_pairs"])
    def _gate_up_kernel(x_ptr, w_ptr, hidden_ptr, sorted_ptr, block_expert_ptr, num_pairs,
                        stride_xt, stride_we, stride_wn, stride_ht,
                        HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        if expert >= 0:
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            pairs = tl.load(sorted_ptr + rows)
            valid = pairs < num_pairs
            tokens = (pairs // TOP_K).to(tl.int64)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < INTER
            w = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn  # gate rows; up: + INTER rows
            gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, HIDDEN, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < HIDDEN
                a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :],
                            mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
                w_ok = k_ok[:, None] & col_ok[None, :]
                b_gate = tl.load(w + ks[:, None], mask=w_ok, other=0.0)  # [BK, BN]
                b_up = tl.load(w + INTER * stride_wn + ks[:, None], mask=w_ok, other=0.0)
                gate = tl.dot(a, b_gate, gate, input_precision=DOT_PRECISION)
                up = tl.dot(a, b_up, up, input_precision=DOT_PRECISION)
            dtype = hidden_ptr.dtype.element_ty
            gate = gate.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            tl.store(hidden_ptr + rows.to(tl.int64)[:, None] * stride_ht + cols[None, :],
                     (act * up.to(dtype).to(tl.float32)).to(dtype), mask=valid[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])
    def _down_kernel(hidden_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, weights_ptr, num_pairs,
                     stride_ht, stride_we, stride_wn, stride_ot,
                     HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        if expert >= 0:
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            pairs = tl.load(sorted_ptr + rows)
            valid = pairs < num_pairs
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < HIDDEN
            w = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < INTER
                a = tl.load(hidden_ptr + rows.to(tl.int64)[:, None] * stride_ht + ks[None, :],
                            mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
                b = tl.load(w + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            dtype = out_ptr.dtype.element_ty
            weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)  # [BM]
            out = acc.to(dtype).to(tl.float32) * weight[:, None]
            tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + cols[None, :], out.to(dtype),
                     mask=valid[:, None] & col_ok[None, :])

    KERNELS = (_route_kernel, _align_kernel, _gate_up_kernel, _down_kernel)  # triton_ops.compiled_variants
else:
    KERNELS = ()

ROUTE_BLOCK_T = 16  # tokens per routing program
FUSED_ROUTE_TOKENS = 64  # steps up to this many tokens route inside the align program


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Padded row blocks any routing of `num_pairs` pairs can need: each of at most
    min(E, M) used experts rounds its count up to a multiple of block_m."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def tiles(num_pairs: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): 16-row blocks while experts get few pairs each
    (decode: the step streams weights, so narrow column tiles spread them over more programs),
    64-row blocks once they get many (prefill: it computes). Three pipeline stages of either fit
    the shared memory of an H100 / H200 in float32 too."""
    if num_pairs < 32 * num_experts:
        return 16, 32, 128, 4
    return 64, 64, 64, 4


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """router_logits: [T, E] -> (weights [T, k] in the logits' dtype, ids [T, k] int32), as `moe.route`."""
    num_tokens, num_experts = router_logits.shape
    weights, ids = _routing_buffers(router_logits, top_k)
    if num_tokens:
        _route_kernel[(triton.cdiv(num_tokens, ROUTE_BLOCK_T),)](
            router_logits, weights, ids, num_tokens, router_logits.stride(0), **_routing_args(num_experts, top_k),
            RENORMALIZE=renormalize, BLOCK_T=ROUTE_BLOCK_T)
    return weights, ids


def align(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """ids: [T, k] -> (sorted_pairs [max_blocks * block_m] int32, block_expert [max_blocks] int32)."""
    ids = ids.to(torch.int32).contiguous()
    return _align(None, None, ids, num_experts, block_m, renormalize=False)


def route_and_align(router_logits: Tensor, top_k: int, renormalize: bool, block_m: int
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`route` and `align` in one launch (one program: for small steps). Returns (weights, ids,
    sorted_pairs, block_expert)."""
    weights, ids = _routing_buffers(router_logits, top_k)
    sorted_pairs, block_expert = _align(router_logits, weights, ids, router_logits.shape[1], block_m, renormalize)
    return weights, ids, sorted_pairs, block_expert


def _routing_buffers(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    num_tokens, device = router_logits.shape[0], router_logits.device
    return (torch.empty(num_tokens, top_k, dtype=router_logits.dtype, device=device),
            torch.empty(num_tokens, top_k, dtype=torch.int32, device=device))


def _routing_args(num_experts: int, top_k: int) -> dict:
    return dict(NUM_EXPERTS=num_experts, EXPERTS_P2=triton.next_power_of_2(num_experts), TOP_K=top_k,
                TOP_K_P2=triton.next_power_of_2(top_k))


def _chunk(num_pairs: int, num_blocks: int, experts_p2: int) -> int:
    """Pairs (and blocks) the align program takes per iteration: all of a decode step's at once,
    at most 16K one-hot entries per iteration for big steps."""
    return max(16, min(triton.next_power_of_2(max(num_pairs, num_blocks)), 128, 16384 // experts_p2))


def _align(router_logits: Tensor | None, weights: Tensor | None, ids: Tensor, num_experts: int, block_m: int,
           renormalize: bool) -> tuple[Tensor, Tensor]:
    """The align launch; with `router_logits` it routes into `weights` / `ids` first."""
    (num_tokens, top_k), device = ids.shape, ids.device
    num_blocks = max_blocks(num_tokens * top_k, num_experts, block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if num_tokens:
        route = router_logits is not None
        args = _routing_args(num_experts, top_k)
        _align_kernel[(1,)](
            router_logits if route else ids, weights if route else ids, ids, sorted_pairs, block_expert,
            num_tokens, num_blocks, router_logits.stride(0) if route else 0, **args, RENORMALIZE=renormalize,
            ROUTE=route, BLOCK_T=ROUTE_BLOCK_T, BLOCK_M=block_m, CHUNK=_chunk(num_tokens * top_k, num_blocks,
                                                                               args["EXPERTS_P2"]), num_warps=8)
    return sorted_pairs, block_expert


def fused_experts(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; weights, ids: [T, k] -> [T, H], as
    `moe.experts_reference` computes it."""
    block_m = tiles(ids.numel(), gate_up.shape[0])[0]
    sorted_pairs, block_expert = align(ids, gate_up.shape[0], block_m)
    return _grouped_gemms(x, gate_up, down, weights.contiguous(), sorted_pairs, block_expert, ids.shape[1])


def fused_moe(x: Tensor, router_logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int,
              renormalize: bool) -> Tensor:
    """x: [T, H]; router_logits: [T, E]; gate_up: [E, 2I, H]; down: [E, H, I] -> [T, H]."""
    num_tokens, num_experts = router_logits.shape
    if num_tokens > FUSED_ROUTE_TOKENS:
        weights, ids = route(router_logits, top_k, renormalize)
        return fused_experts(x, gate_up, down, weights, ids)
    block_m = tiles(num_tokens * top_k, num_experts)[0]
    weights, _, sorted_pairs, block_expert = route_and_align(router_logits, top_k, renormalize, block_m)
    return _grouped_gemms(x, gate_up, down, weights, sorted_pairs, block_expert, top_k)


def _grouped_gemms(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, sorted_pairs: Tensor,
                   block_expert: Tensor, top_k: int) -> Tensor:
    """The two grouped GEMMs over aligned pairs and the sum of each token's k rows -> [T, H]."""
    (num_tokens, hidden_size), (num_experts, _, inter) = x.shape, down.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    if x.stride(1) != 1 or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("fused MoE needs x and the expert weights contiguous in their last dimension")
    num_pairs, num_blocks = num_tokens * top_k, block_expert.shape[0]
    block_m, block_n, block_k, warps = tiles(num_pairs, num_experts)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 stays float32
    hidden = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, gate_up, hidden, sorted_pairs, block_expert, num_pairs,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), hidden.stride(0),
        HIDDEN=hidden_size, INTER=inter, TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision, num_warps=warps)
    pair_out = torch.empty(num_pairs, hidden_size, dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
        hidden, down, pair_out, sorted_pairs, block_expert, weights, num_pairs,
        hidden.stride(0), down.stride(0), down.stride(1), pair_out.stride(0),
        HIDDEN=hidden_size, INTER=inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision, num_warps=warps)
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1)
