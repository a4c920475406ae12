"""Routing for the fused MoE kernels (rollout.engine.triton_moe): each token's k experts, and for
the sorted path the (token, expert) pairs sorted by expert and padded to row blocks.

`_top_k` (a Triton function the routing kernel and triton_moe's gemv gate/up kernel both call):
softmax of the router logits in float32, the k largest by repeated arg-max (ties to the lowest
id), renormalised when asked, as `moe.route` computes it.

1. `_route_kernel`, a program per tile of ROUTE_BLOCK_T tokens -> weights, ids [T, k], and the
   tile's pairs per expert -> counts [tiles, E] (`route`; `align` counts given ids).
2. `_align_kernel`, a program per tile: the pairs sorted by expert (stable: by expert, then pair),
   each expert's run padded to a multiple of BLOCK_M rows (`align`): `sorted_pairs`
   [max_blocks * BLOCK_M] (padding rows hold M) and `block_expert` [max_blocks] (-1 for unused
   blocks). No atomics, so the order is the same every run; `max_blocks` bounds the padded blocks
   of every routing of M pairs, so buffers and grids depend on T alone (no host sync: decode and
   verify steps can be CUDA graphs). triton_moe.py's docstring describes both in the whole layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollout.engine import triton_pdl
from rollout.engine.triton_attention import triton

if triton is not None:
    import triton.language as tl

    from rollout.engine.triton_pdl import start as pdl_start

    @triton.jit
    def _top_k(logits_ptr, tokens, num_tokens, stride_lt, NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr,
               TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
        """tokens [BT] -> (weights [BT, KP2] float32, ids [BT, KP2] int32); slots >= TOP_K hold 0."""
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
        return top_w, top_i

    @triton.jit(do_not_specialize=["num_tokens"])
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, num_tokens, stride_lt,
                      NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr, TOP_K: tl.constexpr,
                      TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, ROUTE: tl.constexpr, COUNT: tl.constexpr,
                      BLOCK_T: tl.constexpr, PDL: tl.constexpr):
        """A program per tile of BLOCK_T tokens: with ROUTE their top-k -> weights, ids [T, k] (else
        the ids are read); with COUNT the tile's pairs per expert -> counts[tile] [EXPERTS_P2]."""
        pdl_start(PDL)
        tile = tl.program_id(0)
        tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        slots = tl.arange(0, TOP_K_P2)
        out = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]  # [BT, KP2]: pair ids
        keep = (tokens < num_tokens)[:, None] & (slots < TOP_K)[None, :]
        if ROUTE:
            top_w, top_i = _top_k(logits_ptr, tokens, num_tokens, stride_lt, NUM_EXPERTS, EXPERTS_P2, TOP_K,
                                  TOP_K_P2, RENORMALIZE, BLOCK_T)
            tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=keep)
            tl.store(ids_ptr + out, top_i, mask=keep)
        else:
            top_i = tl.load(ids_ptr + out, mask=keep, other=0)
        if COUNT:
            experts = tl.arange(0, EXPERTS_P2)
            hits = ((top_i[:, :, None] == experts[None, None, :]) & keep[:, :, None]).to(tl.int32)  # [BT, KP2, EP]
            tl.store(counts_ptr + tile * EXPERTS_P2 + experts, tl.sum(tl.sum(hits, 1), 0))

    @triton.jit(do_not_specialize=["num_pairs", "num_tiles", "num_blocks", "blocks_per_program"])
    def _align_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_tiles, num_blocks,
                      blocks_per_program, NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr,
                      TILE_PAIRS: tl.constexpr, PAIRS_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                      TILE_CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr, PDL: tl.constexpr):
        """A program per routing tile: places the tile's pairs, and writes its share of the blocks."""
        pdl_start(PDL)
        tile = tl.program_id(0)
        experts = tl.arange(0, EXPERTS_P2)
        total = tl.zeros([EXPERTS_P2], tl.int32)  # pairs per expert, all tiles
        before = tl.zeros([EXPERTS_P2], tl.int32)  # pairs per expert in the tiles before this one
        for t0 in range(0, num_tiles, TILE_CHUNK):
            tiles = t0 + tl.arange(0, TILE_CHUNK)
            counts = tl.load(counts_ptr + tiles[:, None] * EXPERTS_P2 + experts[None, :],
                             mask=(tiles < num_tiles)[:, None], other=0)  # [TC, EP]
            total += tl.sum(counts, 0)
            before += tl.sum(tl.where((tiles < tile)[:, None], counts, 0), 0)
        padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)  # expert e owns padded rows [ends - padded, ends)
        starts = ends - padded
        # the tile's pairs: row = expert's start + its pairs in earlier tiles + its earlier pairs here
        lanes = tl.arange(0, PAIRS_P2)
        pairs = tile * TILE_PAIRS + lanes
        ok = (lanes < TILE_PAIRS) & (pairs < num_pairs)
        ids = tl.load(ids_ptr + pairs, mask=ok, other=EXPERTS_P2)
        earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])  # [P, P]
        base = tl.sum(tl.where(ids[:, None] == experts[None, :], (starts + before)[None, :], 0), 1)  # [P]
        tl.store(sorted_ptr + base + tl.sum(earlier.to(tl.int32), 1), pairs, mask=ok)
        # this program's blocks: each block's expert (-1 past the last used row), padding rows' sentinel
        first = tile * blocks_per_program
        last = tl.minimum(first + blocks_per_program, num_blocks)
        for b0 in range(first, last, BLOCK_CHUNK):
            blocks = b0 + tl.arange(0, BLOCK_CHUNK)
            mine = blocks < last
            row0 = blocks * BLOCK_M
            expert = tl.sum((ends[None, :] <= row0[:, None]).to(tl.int32), 1)  # [BC]
            filled = tl.sum(tl.where(expert[:, None] == experts[None, :], (starts + total)[None, :], 0), 1)
            tl.store(block_expert_ptr + blocks, tl.where(expert < NUM_EXPERTS, expert, -1), mask=mine)
            rows = row0[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [BC, BM]
            pad = (rows >= filled[:, None]) & mine[:, None]
            tl.store(sorted_ptr + rows, tl.zeros([BLOCK_CHUNK, BLOCK_M], tl.int32) + num_pairs, mask=pad)

    KERNELS = (_route_kernel, _align_kernel)  # triton_ops.compiled_variants
else:
    KERNELS = ()

ROUTE_BLOCK_T = 16  # tokens per routing program: the align launch runs a program per such tile
ALIGN_TILE_CHUNK = 16  # routing tiles' counts the align programs read per iteration
ALIGN_BLOCK_CHUNK = 64  # blocks an align program writes per iteration


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Padded row blocks any routing of `num_pairs` pairs can need: each of at most
    min(E, M) used experts rounds its count up to a multiple of block_m."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """router_logits: [T, E] -> (weights [T, k] in the logits' dtype, ids [T, k] int32), as `moe.route`."""
    weights, ids, _ = route_launch(router_logits, top_k, renormalize, count=False)
    return weights, ids


def align(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """ids: [T, k] -> (sorted_pairs [max_blocks * block_m] int32, block_expert [max_blocks] int32)."""
    ids = ids.to(torch.int32).contiguous()
    (num_tokens, top_k), device = ids.shape, ids.device
    counts = _counts_buffer(num_tokens, num_experts, device)
    if num_tokens:
        _route_kernel[(counts.shape[0],)](
            ids, ids, ids, counts, num_tokens, 0, **routing_args(num_experts, top_k), RENORMALIZE=False,
            ROUTE=False, COUNT=True, BLOCK_T=ROUTE_BLOCK_T, **triton_pdl.launch(ids))
    return align_launch(ids, counts, num_experts, block_m)


def route_launch(router_logits: Tensor, top_k: int, renormalize: bool, count: bool
           ) -> tuple[Tensor, Tensor, Tensor | None]:
    """The routing launch -> (weights, ids [T, k], counts [tiles, E_p2] int32 when `count`)."""
    num_tokens, num_experts = router_logits.shape
    weights, ids = routing_buffers(router_logits, top_k)
    counts = _counts_buffer(num_tokens, num_experts, router_logits.device) if count else None
    if num_tokens:
        _route_kernel[(triton.cdiv(num_tokens, ROUTE_BLOCK_T),)](
            router_logits, weights, ids, ids if counts is None else counts, num_tokens, router_logits.stride(0),
            **routing_args(num_experts, top_k), RENORMALIZE=renormalize, ROUTE=True, COUNT=count,
            BLOCK_T=ROUTE_BLOCK_T, **triton_pdl.launch(router_logits))
    return weights, ids, counts


def routing_buffers(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    num_tokens, device = router_logits.shape[0], router_logits.device
    return (torch.empty(num_tokens, top_k, dtype=router_logits.dtype, device=device),
            torch.empty(num_tokens, top_k, dtype=torch.int32, device=device))


def _counts_buffer(num_tokens: int, num_experts: int, device: torch.device) -> Tensor:
    """[routing tiles, E_p2] int32: each tile's pairs per expert (every entry written by its tile)."""
    return torch.empty(triton.cdiv(num_tokens, ROUTE_BLOCK_T), triton.next_power_of_2(num_experts),
                       dtype=torch.int32, device=device)


def routing_args(num_experts: int, top_k: int) -> dict:
    return dict(NUM_EXPERTS=num_experts, EXPERTS_P2=triton.next_power_of_2(num_experts), TOP_K=top_k,
                TOP_K_P2=triton.next_power_of_2(top_k))


def align_launch(ids: Tensor, counts: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """The align launch, a program per routing tile, on the tiles' `counts`."""
    (num_tokens, top_k), device = ids.shape, ids.device
    num_pairs, num_tiles = num_tokens * top_k, counts.shape[0]
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if num_tokens:
        _align_kernel[(num_tiles,)](
            ids, counts, sorted_pairs, block_expert, num_pairs, num_tiles, num_blocks,
            triton.cdiv(num_blocks, num_tiles), NUM_EXPERTS=num_experts, EXPERTS_P2=counts.shape[1],
            TILE_PAIRS=ROUTE_BLOCK_T * top_k, PAIRS_P2=triton.next_power_of_2(ROUTE_BLOCK_T * top_k),
            BLOCK_M=block_m, TILE_CHUNK=ALIGN_TILE_CHUNK, BLOCK_CHUNK=ALIGN_BLOCK_CHUNK, **triton_pdl.launch(ids))
    return sorted_pairs, block_expert
