"""The mixture-of-experts layer in Triton: routing and the two expert GEMMs of every (token,
expert) pair, by one of two paths that `moe_launch.launch_for` picks by the step's token count.

A step's T tokens pick k experts each: M = T * k (token, expert) pairs, pair p = t * k + j.
Routing is in rollout.engine.triton_moe_route (`_top_k`: softmax of the router logits in float32,
the k largest by repeated arg-max, ties to the lowest id, renormalised when asked, as `moe.route`
computes it; the routing and align kernels of the sorted path).

gemv path (1-token steps in the table; nothing sorted, three launches a layer with the router's
GEMM, two when the router runs in the norm's launch: `MoeLaunch.router_in_norm`):
1. `_gate_up_gemv_kernel`, a program per (pair, column tile): routes its token, streams its
   expert's gate and up rows against the token's x, silu(gate) * up -> `hidden` [M, I]; the first
   column tile of each pair also writes the pair's weight and expert for step 2.
   (`route_inside=False`: `_route_kernel` routes first, one launch more, no top-k at the start of
   every program.) It multiplies by tl.dot with the token in one row of 16, so that Triton
   pipelines the weight loads that feed the dot (an elementwise product summed over the tile got
   no pipelining: 25.4 us a layer against 19.1 on the H200, BENCHMARKS.md issue 21).
2. `_down_gemv_kernel`, a program per (token, column tile): the token's k experts' down rows read
   as one [k, BLOCK_N, BLOCK_K] tile per iteration, the next tile's load issued before the current
   one is used (Triton does not pipeline these), each expert's output times its weight, summed
   over the k experts -> [T, H]. (A tl.dot down, one (expert, tile) loop with pair j in row j,
   took 16.8 us against 11.0.)

sorted path (bigger steps: each touched expert's weights are read once per block, not per pair):
1. `_route_kernel` (triton_moe_route), a program per tile of BLOCK_T tokens -> weights, ids [T, k],
   and the tile's pairs per expert -> counts [tiles, E].
2. `_align_kernel` (triton_moe_route), a program per tile: the pairs sorted by expert (stable: by
   expert, then pair), each expert's run padded to a multiple of BLOCK_M rows, as vLLM's
   moe_align_block_size does:
   `sorted_pairs` [max_blocks * BLOCK_M] (padding rows hold M) and `block_expert` [max_blocks]
   (-1 for unused blocks). Each program sums the counts (every expert's padded start, a cumsum),
   places its tile's pairs at start + the expert's pairs in earlier tiles + its earlier pairs in
   the tile, and writes its share of the blocks' experts and padding rows; no atomics, so the
   order is the same every run. `max_blocks` bounds the padded blocks of every routing of M
   pairs, so buffers and grids depend on T alone: no host sync, and decode / verify steps can be
   CUDA graphs.
3. `_gate_up_kernel` (a program per (block, column tile)): the block's rows of x, gathered by
   token, times its expert's gate and up rows (tl.dot); silu(gate) * up -> `hidden`.
4. `_down_kernel`: `hidden` times the expert's down_proj, times the pair's routing weight ->
   `pair_out` [M, H]; torch then sums each token's k rows (accumulating in float32).

Programs of unused blocks exit at once. Index products that can pass 2^31 (expert * expert
stride of large models, row * row stride of big steps) are computed in int64. Both paths
accumulate in float32 and round where the torch path rounds (the projections' outputs, silu, the
product, each pair's weighted output), so on bfloat16 they differ from `moe.experts_reference` by
rounding order only. The kernels run on CPU tensors through Triton's interpreter (the tests
compare them with the torch reference there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollout.engine import triton_pdl
from rollout.engine.moe_launch import MoeLaunch, Tiles, launch_for
from rollout.engine.triton_attention import triton
from rollout.engine.triton_gemv import dot_precision
from rollout.engine.triton_moe_route import KERNELS as ROUTE_KERNELS
from rollout.engine.triton_moe_route import align, align_launch, route, route_launch, routing_args, routing_buffers

if triton is not None:
    import triton.language as tl

    from rollout.engine.triton_gemv import padded_row
    from rollout.engine.triton_moe_route import _top_k  # (the gemv gate/up kernel routes inside)
    from rollout.engine.triton_pdl import start as pdl_start

    @triton.jit
    def _swiglu(gate, up, dtype: tl.constexpr):
        """float32 projections -> silu(gate) * up in `dtype`, rounded where torch rounds."""
        gate = gate.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (act * up.to(dtype).to(tl.float32)).to(dtype)

    @triton.jit(do_not_specialize=["num_pairs"])
    def _gate_up_kernel(x_ptr, w_ptr, hidden_ptr, sorted_ptr, block_expert_ptr, num_pairs,
                        stride_xt, stride_we, stride_wn, stride_ht,
                        HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        PDL: tl.constexpr):
        pdl_start(PDL)
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
            tl.store(hidden_ptr + rows.to(tl.int64)[:, None] * stride_ht + cols[None, :],
                     _swiglu(gate, up, hidden_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])
    def _down_kernel(hidden_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, weights_ptr, num_pairs,
                     stride_ht, stride_we, stride_wn, stride_ot,
                     HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
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

    @triton.jit(do_not_specialize=["num_tokens"])
    def _gate_up_gemv_kernel(x_ptr, logits_ptr, w_ptr, hidden_ptr, weights_ptr, ids_ptr, num_tokens,
                             stride_xt, stride_lt, stride_we, stride_wn, stride_ht,
                             HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                             EXPERTS_P2: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr,
                             RENORMALIZE: tl.constexpr, ROUTE: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pair = tl.program_id(0)
        token = pair // TOP_K
        if ROUTE:  # the token's routing, here: no routing launch
            top_w, top_i = _top_k(logits_ptr, token + tl.arange(0, 1), num_tokens, stride_lt, NUM_EXPERTS,
                                  EXPERTS_P2, TOP_K, TOP_K_P2, RENORMALIZE, 1)  # [1, KP2]
            mine = tl.arange(0, TOP_K_P2)[None, :] == pair % TOP_K
            expert = tl.sum(tl.where(mine, top_i, 0))
            if tl.program_id(1) == 0:  # for the down kernel
                tl.store(weights_ptr + pair, tl.sum(tl.where(mine, top_w, 0.0)).to(weights_ptr.dtype.element_ty))
                tl.store(ids_ptr + pair, expert)
        else:  # routed by `_route_kernel`
            expert = tl.load(ids_ptr + pair)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < INTER
        # the token in row 0 of 16 rows; the weight tiles [BK, BN] feed tl.dot, so Triton pipelines their loads
        x_row = x_ptr + token.to(tl.int64) * stride_xt
        w = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn  # [1, BN] gate rows
        gate16 = tl.zeros([16, BLOCK_N], tl.float32)
        up16 = tl.zeros([16, BLOCK_N], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < HIDDEN
            a = padded_row(x_row, ks, k_ok, 0)
            w_ok = k_ok[:, None] & col_ok[None, :]
            gate16 = tl.dot(a, tl.load(w + ks[:, None], mask=w_ok, other=0.0), gate16, input_precision=DOT_PRECISION)
            up16 = tl.dot(a, tl.load(w + INTER * stride_wn + ks[:, None], mask=w_ok, other=0.0), up16,
                          input_precision=DOT_PRECISION)
        gate, up = tl.sum(gate16, 0), tl.sum(up16, 0)  # rows 1-15 are zeros
        tl.store(hidden_ptr + pair.to(tl.int64) * stride_ht + cols, _swiglu(gate, up, hidden_ptr.dtype.element_ty),
                 mask=col_ok)

    @triton.jit
    def _down_gemv_kernel(hidden_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, stride_ht, stride_we, stride_wn,
                          stride_ot, HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
                          TOP_K_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < HIDDEN
        # the k experts' tiles as one [KP2, BN, BK] load, an elementwise product summed; Triton does not
        # pipeline these loads, so the next tile's load is issued before the current one is used
        slots = tl.arange(0, TOP_K_P2)
        used = slots < TOP_K
        pairs = token * TOP_K + slots  # [KP2]
        experts = tl.load(ids_ptr + pairs, mask=used, other=0).to(tl.int64)
        w = w_ptr + experts[:, None, None] * stride_we + cols.to(tl.int64)[None, :, None] * stride_wn
        h = hidden_ptr + pairs[:, None, None] * stride_ht  # [KP2, 1, 1]
        w_ok = used[:, None, None] & col_ok[None, :, None]
        acc = tl.zeros([TOP_K_P2, BLOCK_N], tl.float32)
        ks = tl.arange(0, BLOCK_K)[None, None, :]
        b = tl.load(w + ks, mask=w_ok & (ks < INTER), other=0.0)  # [KP2, BN, BK]: the first tile
        for k0 in range(0, INTER, BLOCK_K):
            ks = (k0 + tl.arange(0, BLOCK_K))[None, None, :]
            b_next = tl.load(w + ks + BLOCK_K, mask=w_ok & (ks + BLOCK_K < INTER), other=0.0)
            a = tl.load(h + ks, mask=used[:, None, None] & (ks < INTER), other=0.0).to(tl.float32)  # [KP2, 1, BK]
            acc += tl.sum(b.to(tl.float32) * a, 2)
            b = b_next
        dtype = out_ptr.dtype.element_ty
        weight = tl.load(weights_ptr + pairs, mask=used, other=0.0).to(tl.float32)  # [KP2]
        per_pair = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype).to(tl.float32)  # as pair_out rounds
        tl.store(out_ptr + token * stride_ot + cols, tl.sum(per_pair, 0).to(dtype), mask=col_ok)

    KERNELS = (*ROUTE_KERNELS, _gate_up_kernel, _down_kernel, _gate_up_gemv_kernel,
               _down_gemv_kernel)  # triton_ops.compiled_variants
else:
    KERNELS = ()

def fused_moe(x: Tensor, router_logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int, renormalize: bool,
              launch: MoeLaunch | None = None) -> Tensor:
    """x: [T, H]; router_logits: [T, E]; gate_up: [E, 2I, H]; down: [E, H, I] -> [T, H], as
    `moe.experts_reference` computes it on `moe.route`'s routing. `launch` defaults to the
    table's entry for T (moe_launch.launch_for)."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return torch.zeros_like(x)
    _check_layout(x, gate_up, down)
    launch = launch or launch_for(num_tokens)
    if launch.path == "gemv":
        hidden, weights, ids = gemv_gate_up(x, router_logits, gate_up, top_k, renormalize, launch.gate_up,
                                            launch.route_inside)
        return gemv_down(hidden, down, weights, ids, top_k, launch.down)
    weights, sorted_pairs, block_expert = sorted_route(router_logits, top_k, renormalize, launch.block_m)
    return _sorted_experts(x, gate_up, down, weights, sorted_pairs, block_expert, top_k, launch)


def fused_experts(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor,
                  launch: MoeLaunch | None = None) -> Tensor:
    """The sorted path on a given routing: weights, ids [T, k] -> [T, H] (default launch: the
    table's sorted entry for T)."""
    num_tokens, top_k = ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    _check_layout(x, gate_up, down)
    launch = launch or launch_for(num_tokens, "sorted")
    if launch.path != "sorted":
        raise ValueError(f"fused_experts runs the sorted path, got launch {launch}")
    sorted_pairs, block_expert = align(ids, gate_up.shape[0], launch.block_m)
    return _sorted_experts(x, gate_up, down, weights.contiguous().flatten(), sorted_pairs, block_expert, top_k,
                           launch)


def _check_layout(x: Tensor, gate_up: Tensor, down: Tensor) -> None:
    if x.stride(1) != 1 or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("fused MoE needs x and the expert weights contiguous in their last dimension")


def _sorted_experts(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, sorted_pairs: Tensor,
                    block_expert: Tensor, top_k: int, launch: MoeLaunch) -> Tensor:
    hidden = sorted_gate_up(x, gate_up, sorted_pairs, block_expert, top_k, launch.block_m, launch.gate_up)
    pair_out = sorted_down(hidden, down, weights, sorted_pairs, block_expert, x.shape[0] * top_k, launch.block_m,
                           launch.down)
    return pair_out.view(x.shape[0], top_k, x.shape[1]).sum(dim=1)


# -- the phases (benchmarks/bench_moe.py times them one by one) -----------------------------------


def gemv_gate_up(x: Tensor, router_logits: Tensor, gate_up: Tensor, top_k: int, renormalize: bool,
                 tiles: Tiles, route_inside: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """gemv path, step 1 -> (hidden [T * k, I], weights [T * k] in the logits' dtype, ids [T * k]
    int32). Its programs route their own token, or with `route_inside=False` `route` does first."""
    (num_tokens, hidden_size), (num_experts, inter2, _) = x.shape, gate_up.shape
    num_pairs = num_tokens * top_k
    hidden = torch.empty(num_pairs, inter2 // 2, dtype=x.dtype, device=x.device)
    if route_inside:
        weights, ids = (t.view(-1) for t in routing_buffers(router_logits, top_k))
    else:
        weights, ids = (t.view(-1) for t in route(router_logits, top_k, renormalize))
    _gate_up_gemv_kernel[(num_pairs, triton.cdiv(inter2 // 2, tiles.block_n))](
        x, router_logits, gate_up, hidden, weights, ids, num_tokens,
        x.stride(0), router_logits.stride(0), gate_up.stride(0), gate_up.stride(1), hidden.stride(0),
        HIDDEN=hidden_size, INTER=inter2 // 2, **routing_args(num_experts, top_k), RENORMALIZE=renormalize,
        ROUTE=route_inside, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_PRECISION=dot_precision(x),
        num_warps=tiles.warps, num_stages=tiles.stages, **triton_pdl.launch(x))
    return hidden, weights, ids


def gemv_down(hidden: Tensor, down: Tensor, weights: Tensor, ids: Tensor, top_k: int, tiles: Tiles) -> Tensor:
    """gemv path, step 2: hidden [T * k, I] -> [T, H], each token's k experts summed by weight."""
    (_, hidden_size, inter), num_tokens = down.shape, ids.numel() // top_k
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _down_gemv_kernel[(num_tokens, triton.cdiv(hidden_size, tiles.block_n))](
        hidden, down, out, weights, ids, hidden.stride(0), down.stride(0), down.stride(1), out.stride(0),
        HIDDEN=hidden_size, INTER=inter, TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k),
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.warps, num_stages=tiles.stages,
        **triton_pdl.launch(hidden))
    return out


def sorted_route(router_logits: Tensor, top_k: int, renormalize: bool, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """sorted path, steps 1-2 (two launches) -> (weights [T * k], sorted_pairs, block_expert)."""
    weights, ids, counts = route_launch(router_logits, top_k, renormalize, count=True)
    sorted_pairs, block_expert = align_launch(ids, counts, router_logits.shape[1], block_m)
    return weights.flatten(), sorted_pairs, block_expert


def sorted_gate_up(x: Tensor, gate_up: Tensor, sorted_pairs: Tensor, block_expert: Tensor, top_k: int, block_m: int,
                   tiles: Tiles) -> Tensor:
    """sorted path, step 3 -> hidden [max_blocks * block_m, I] (rows of padding unwritten)."""
    (num_tokens, hidden_size), inter = x.shape, gate_up.shape[1] // 2
    num_blocks = block_expert.shape[0]
    hidden = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles.block_n))](
        x, gate_up, hidden, sorted_pairs, block_expert, num_tokens * top_k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), hidden.stride(0),
        HIDDEN=hidden_size, INTER=inter, TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION=dot_precision(x), num_warps=tiles.warps, num_stages=tiles.stages, **triton_pdl.launch(x))
    return hidden


def sorted_down(hidden: Tensor, down: Tensor, weights: Tensor, sorted_pairs: Tensor, block_expert: Tensor,
                num_pairs: int, block_m: int, tiles: Tiles) -> Tensor:
    """sorted path, step 4: -> pair_out [M, H], each pair's expert output times its weight."""
    (_, hidden_size, inter), num_blocks = down.shape, block_expert.shape[0]
    pair_out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, tiles.block_n))](
        hidden, down, pair_out, sorted_pairs, block_expert, weights, num_pairs,
        hidden.stride(0), down.stride(0), down.stride(1), pair_out.stride(0),
        HIDDEN=hidden_size, INTER=inter, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION=dot_precision(hidden), num_warps=tiles.warps, num_stages=tiles.stages,
        **triton_pdl.launch(hidden))
    return pair_out
