"""Shared-prefix attention as Triton kernels (the plan: prefix_plan.py, prefix_items.py; the
launch parameters: prefix_launch.py; the passes and their torch reference: prefix_attention.py;
the online-softmax tile and row store they share: triton_prefix_tiles.py).

`_item_kernel` runs the plan's work items, each once per KV head: its query rows are (token,
query head) pairs of that KV head for the tokens of one unit (for a shared unit, all the
sequences of a group: a shared key tile is loaded once for all of them and used by one tl.dot of
[block_m rows, D] x [D, block_n]). It walks the item's virtual keys in tiles of block_n with an
online softmax in float32 (base 2, the scale folded into log2 e): first the unit's own range
through one block-table row (loop 1, masking keys after each query's position; only lone units'
ranges reach a query's own position), then the fused suffix segments of its row tile (loop 2:
each key's segment, block-table row and position come from the tile's few segments held in
registers, and a key is seen only by its own sequence's rows). A row whose token has one partial
result (part_count 1) is written to the output, the others' normalised output and log-sum-exp to
the token's partial row `slot`. The programs (a fixed number per SM) take (item, KV head) pairs
from a work queue, an atomic counter, shared units' items first, until the queue is empty: the
item count is read on the device, so a CUDA graph replays any plan that fits its buffers, and no
program waits on a long item while others idle. A shared unit's own keys all precede its rows'
queries, so its full key tiles skip the causal mask. `_merge_kernel` combines each token's
partial rows (all its heads in one program) by their log-sum-exp, and resets the counter for the
next layer.

The lone pass (`LaunchConfig.lone_pass`, and whenever lone units' row tile differs from shared
units'): one launch runs the shared units' items through the queue, a second the lone units'
items (suffixes read alone, sequences in no group), compiled with their own tile and warps (one
kernel holding both bodies ran at the larger one's registers: measured slower, 116 us against 54 +
44 at 32x8x1024 decode): their body needs far fewer registers than the shared one, so more
programs fit on an SM, and these short items are bound by their chain of dependent loads (item,
block ids, keys), which more programs in flight hide. Each of its programs takes every P-th item
(no queue). In a decode step (`lone_all_heads`) the lone pass runs every query head of a lone
item's token in one program and merges each token's partial results itself: triton_prefix_lone.py.

Each kernel joins the chain of programmatic dependent launches (triton_pdl): it waits for the
kernel before it first thing (the merge reads its token's plan rows before), so its launch and
start-up may overlap that kernel's last programs.

Index arithmetic: virtual keys and positions are int32 (a 64-bit key index per element cost
registers that spilled); block ids are loaded from int64 tables, so block id x block stride and
token x row stride are int64 products. The index tensors are views into the step's packed upload,
so their addresses are not specialised on alignment (that would compile a variant per offset
parity), nor is the block table's width.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from rollout.engine import triton_pdl
from rollout.engine.prefix_attention import SharedPrefixPlan
from rollout.engine.prefix_items import ITEM_FIELDS
from rollout.engine.prefix_launch import lone_launch, max_segments
from rollout.engine.triton_prefix_lone import all_heads
from rollout.engine.triton_prefix_tiles import LOG2E, index32_fits

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with xgrammar, a dependency
    triton = None

PROGRAMS_PER_SM = 8  # item-kernel programs launched per SM (more than fit at once: the queue balances)
LONE_PROGRAMS_PER_SM = 32  # programs of a lone pass per SM (each takes every P-th item)
HEADS_PROGRAMS_PER_SM = 4  # programs of decode's all-heads lone pass per SM: two fit (82 KB of shared memory
# each); more only cycle through the SMs empty where a CUDA graph's plan is sized for its capacity
ALL_ITEMS, SHARED_PASS, LONE_PASS = 0, 1, 2  # what one launch of the item kernel runs

if triton is not None:
    from rollout.engine.triton_pdl import start as pdl_start
    from rollout.engine.triton_prefix_lone import _lone_heads_kernel
    from rollout.engine.triton_prefix_tiles import (
        _key_tile,
        _rows_start,
        _store_merged,
        _store_rows,
    )

    _SHARED, _LONE = tl.constexpr(SHARED_PASS), tl.constexpr(LONE_PASS)  # the kernel's view of the passes

    @triton.jit
    def _attend_item(
        item_ptr, kv_head, q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, segs_ptr,
        unit_tokens_ptr, part_start_ptr, part_count_ptr, positions_ptr, block_tables_ptr, qk_scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SEGS: tl.constexpr, FUSED: tl.constexpr,
        DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr, INDEX32: tl.constexpr,
    ):
        """One (item, KV head) pair. CAUSAL False: a shared unit's item, whose own keys all lie
        before its rows' queries (a unit shares keys before its members' first query), so its full
        key tiles need no mask."""
        key_lo = tl.load(item_ptr + 5).to(tl.int32)  # the fields of prefix_items.ITEM_FIELDS, int64
        range_len = tl.load(item_ptr + 6).to(tl.int32)
        v_lo = tl.load(item_ptr + 7).to(tl.int32)
        v_hi = tl.load(item_ptr + 8).to(tl.int32)
        token, head, row_ok = _item_rows(item_ptr, kv_head, unit_tokens_ptr, GROUPS, BLOCK_M)
        q_pos = tl.load(positions_ptr + token, mask=row_ok, other=0).to(tl.int32)
        q, m_i, l_i, acc = _rows_start(q_ptr, token, head, row_ok, stride_qt, stride_qh, HEAD_DIM, BLOCK_M)
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
        table = block_tables_ptr + tl.load(item_ptr + 4) * stride_bt
        own_hi = tl.minimum(v_hi, range_len)
        masked_lo = v_lo  # loop 1: the unit's own keys, full tiles of a shared unit first (no mask)
        if not CAUSAL:
            masked_lo = v_lo + (own_hi - v_lo) // BLOCK_N * BLOCK_N
            for v0 in range(v_lo, masked_lo, BLOCK_N):
                pos = key_lo + v0 + tl.arange(0, BLOCK_N)
                block = tl.load(table + pos // BLOCK_SIZE)  # [N] int64
                m_i, l_i, acc = _key_tile(q, k_base, v_base, block, pos, pos >= 0, row_ok[:, None], m_i, l_i, acc,
                                          qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, HEAD_DIM, BLOCK_SIZE,
                                          DOT_PRECISION, False, INDEX32)
        for v0 in range(masked_lo, own_hi, BLOCK_N):
            vk = v0 + tl.arange(0, BLOCK_N)  # [N] virtual keys
            key_ok = vk < own_hi
            pos = key_lo + vk
            block = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0)  # [N] int64
            seen = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            m_i, l_i, acc = _key_tile(q, k_base, v_base, block, pos, key_ok, seen, m_i, l_i, acc, qk_scale,
                                      stride_kb, stride_ks, stride_vb, stride_vs, HEAD_DIM, BLOCK_SIZE, DOT_PRECISION,
                                      True, INDEX32)
        if FUSED:  # loop 2: the row tile's fused suffix segments (none: an empty range)
            m_i, l_i, acc = _segment_keys(
                item_ptr, segs_ptr, block_tables_ptr, q, q_pos, token, tl.maximum(v_lo, range_len), v_hi,
                k_base, v_base, m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, stride_bt,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, MAX_SEGS, DOT_PRECISION, INDEX32)
        # The rows' tokens and heads again, past a barrier the compiler does not move loads across: else
        # it keeps their copies in the stores' layout live through the key loops (sm_90, Triton 3.6:
        # 253 registers against 204; no faster at two programs an SM, session 19, call 1).
        tl.debug_barrier()
        token, head, row_ok = _item_rows(item_ptr, kv_head, unit_tokens_ptr, GROUPS, BLOCK_M)
        _store_rows(item_ptr, token, head, row_ok, m_i, l_i, acc, out_ptr, part_o_ptr, part_lse_ptr, part_start_ptr,
                    part_count_ptr, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM)

    @triton.jit
    def _item_rows(item_ptr, kv_head, unit_tokens_ptr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr):
        """The item's rows ([M]: row = token * GROUPS + group head): each one's token (int64: listed in
        unit_tokens when the item is indirect, else consecutive from its first), query head, and
        whether it is one of the item's."""
        rows = tl.load(item_ptr + 2) + tl.arange(0, BLOCK_M)
        local = rows // GROUPS
        row_ok = local < tl.load(item_ptr + 1)
        tok_start = tl.load(item_ptr)
        indirect = (tl.load(item_ptr + 3) + tl.zeros([BLOCK_M], tl.int64)) != 0  # the interpreter masks by vectors
        token = tl.load(unit_tokens_ptr + tok_start + local, mask=row_ok & indirect, other=0)
        return tl.where(indirect, token, tok_start + local), kv_head * GROUPS + rows % GROUPS, row_ok

    @triton.jit
    def _segment_keys(item_ptr, segs_ptr, block_tables_ptr, q, q_pos, token, lo, hi, k_base, v_base, m_i, l_i, acc,
                      qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, stride_bt,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      MAX_SEGS: tl.constexpr, DOT_PRECISION: tl.constexpr, INDEX32: tl.constexpr):
        """Virtual keys lo .. hi of the item's fused segments: each key's segment (the last whose
        v_start it reaches), block-table row and position come from the tile's segments held in
        registers [S]; a key is seen by the rows of its segment's tokens, up to their positions."""
        sidx = tl.arange(0, MAX_SEGS)
        seg_ptr = segs_ptr + (tl.load(item_ptr + 9) + sidx) * 5  # prefix_items.SEG_FIELDS
        s_ok = sidx < tl.load(item_ptr + 10)
        s_start = tl.load(seg_ptr, mask=s_ok, other=2**30).to(tl.int32)  # [S]
        s_row = tl.load(seg_ptr + 1, mask=s_ok, other=0)
        s_off = tl.load(seg_ptr + 2, mask=s_ok, other=0).to(tl.int32)
        mine = (token[:, None] >= tl.load(seg_ptr + 3, mask=s_ok, other=0)[None, :]) & (
            token[:, None] < tl.load(seg_ptr + 4, mask=s_ok, other=0)[None, :])  # [M, S]
        row_seg = tl.max(tl.where(mine, sidx[None, :], -1), 1)  # [M] the row's segment, -1: none
        for v0 in range(lo, hi, BLOCK_N):
            vk = v0 + tl.arange(0, BLOCK_N)
            key_ok = vk < hi
            seg = tl.sum((s_start[None, :] <= vk[:, None]).to(tl.int32), 1) - 1  # [N]
            hit = seg[:, None] == sidx[None, :]  # [N, S]
            pos = vk + tl.sum(tl.where(hit, s_off[None, :], 0), 1)
            row = tl.sum(tl.where(hit, s_row[None, :], 0), 1)  # [N] int64
            block = tl.load(block_tables_ptr + row * stride_bt + pos // BLOCK_SIZE, mask=key_ok, other=0)
            seen = key_ok[None, :] & (seg[None, :] == row_seg[:, None]) & (pos[None, :] <= q_pos[:, None])
            m_i, l_i, acc = _key_tile(q, k_base, v_base, block, pos, key_ok, seen, m_i, l_i, acc, qk_scale,
                                      stride_kb, stride_ks, stride_vb, stride_vs, HEAD_DIM, BLOCK_SIZE, DOT_PRECISION,
                                      True, INDEX32)
        return m_i, l_i, acc

    @triton.jit(do_not_specialize=["stride_bt"],
                do_not_specialize_on_alignment=["items_ptr", "item_counts_ptr", "segs_ptr", "unit_tokens_ptr",
                                                "part_start_ptr", "part_count_ptr", "positions_ptr",
                                                "block_tables_ptr"])
    def _item_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
        items_ptr, item_counts_ptr, segs_ptr, unit_tokens_ptr, part_start_ptr, part_count_ptr, positions_ptr,
        block_tables_ptr, qk_scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_KV_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, SHARED_BLOCK_M: tl.constexpr, SUFFIX_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MAX_SEGS: tl.constexpr, FUSED: tl.constexpr, NUM_FIELDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        PASS: tl.constexpr, PDL: tl.constexpr, INDEX32: tl.constexpr,
    ):
        pdl_start(PDL)
        num_shared = tl.load(item_counts_ptr)
        if PASS == _LONE:  # lone units' items, program p taking every P-th (no queue)
            total = tl.load(item_counts_ptr + 1) * NUM_KV_HEADS
            work = num_shared * NUM_KV_HEADS + tl.program_id(0)
        else:  # a work queue of (item, KV head) pairs, shared units' first
            total = (num_shared if PASS == _SHARED else tl.load(item_counts_ptr + 1)) * NUM_KV_HEADS
            work = tl.atomic_add(counter_ptr, 1)
        while work < total:
            item = work // NUM_KV_HEADS
            item_ptr = items_ptr + item * NUM_FIELDS
            if PASS == _LONE:
                _attend_item(
                    item_ptr, work % NUM_KV_HEADS, q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, segs_ptr,
                    unit_tokens_ptr, part_start_ptr, part_count_ptr, positions_ptr, block_tables_ptr, qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    NUM_HEADS, GROUPS, HEAD_DIM, BLOCK_SIZE, SUFFIX_BLOCK_M, BLOCK_N, 1, False, DOT_PRECISION, True,
                    INDEX32)
            else:  # shared units' items (all items in one launch: the same row tile, lone ones unfused)
                _attend_item(
                    item_ptr, work % NUM_KV_HEADS, q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, segs_ptr,
                    unit_tokens_ptr, part_start_ptr, part_count_ptr, positions_ptr, block_tables_ptr, qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    NUM_HEADS, GROUPS, HEAD_DIM, BLOCK_SIZE, SHARED_BLOCK_M, BLOCK_N, MAX_SEGS, FUSED, DOT_PRECISION,
                    PASS != _SHARED, INDEX32)
            if PASS == _LONE:
                work += tl.num_programs(0)
            else:
                work = tl.atomic_add(counter_ptr, 1)

    @triton.jit(do_not_specialize_on_alignment=["part_start_ptr", "part_count_ptr"])
    def _merge_kernel(
        out_ptr, part_o_ptr, part_lse_ptr, part_start_ptr, part_count_ptr, counter_ptr, stride_ot, stride_oh,
        NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        count = tl.load(part_count_ptr + token)  # the plan's, not the passes': read before the wait
        start = tl.load(part_start_ptr + token)
        pdl_start(PDL)
        if token == 0:  # the item kernel has finished with its work queue: ready for the next layer
            tl.store(counter_ptr, 0)
        if count != 1:  # 1: written by its item; 0 (a graph's padded row): 0
            head = tl.arange(0, HEADS_P2)  # [H]
            head_ok = head < NUM_HEADS
            _store_merged(part_o_ptr, part_lse_ptr, start, count, token, head, head_ok, out_ptr, stride_ot, stride_oh,
                          NUM_HEADS, HEADS_P2, HEAD_DIM, "")


def shared_prefix_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                   positions: Tensor, plan: SharedPrefixPlan, scale: float,
                                   out: Tensor | None = None) -> Tensor:
    """q: [T, Hq, D]; caches: [NB, BS, Hkv, D] (this step's keys already written); block_tables:
    [S, W]; positions: [T]; out: [T, Hq, D] like q, or None for a new one. Returns out
    (prefix_attention's two passes), compiled with the plan's launch parameters."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("shared_prefix_attention_triton needs the head dimension contiguous")
    out = torch.empty_like(q) if out is None else out
    pdl = triton_pdl.launch(q)  # the same for every launch of the step
    part_o, part_lse, counter, tickets = plan.buffers(q)
    config, groups = plan.config, num_heads // num_kv_heads
    pairs = plan.max_items * num_kv_heads  # at least the step's (item, KV head) pairs
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))
    args = (q, k_cache, v_cache, out, part_o, part_lse, counter, plan.items, plan.item_counts, plan.segments,
            plan.unit_tokens, plan.part_start, plan.part_count, positions, block_tables, scale * LOG2E, *strides)
    constants = dict(
        NUM_KV_HEADS=num_kv_heads, NUM_HEADS=num_heads, GROUPS=groups, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        SHARED_BLOCK_M=config.block_m, SUFFIX_BLOCK_M=plan.suffix_block_m,
        MAX_SEGS=max_segments(config.block_m, groups) if config.fuse_suffix else 1, FUSED=config.fuse_suffix,
        NUM_FIELDS=len(ITEM_FIELDS), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INDEX32=config.index32 and index32_fits(k_cache, v_cache), **pdl)
    queue = max(1, min(pairs, _resident_programs(q.device, PROGRAMS_PER_SM)))
    if lone_launch(config, plan.suffix_block_m):  # shared units' items through the queue, then the lone ones
        _item_kernel[(queue,)](*args, **constants, BLOCK_N=config.block_n, PASS=SHARED_PASS,
                               num_warps=config.num_warps, num_stages=config.num_stages)
        if all_heads(config, plan.max_query_len, num_kv_heads, head_dim):
            lone = max(1, min(plan.max_items, _resident_programs(q.device, HEADS_PROGRAMS_PER_SM)))
            merge = config.lone_merge and not config.fuse_suffix  # every token has a lone unit
            _lone_heads_kernel[(lone,)](
                q, k_cache, v_cache, out, part_o, part_lse, counter, tickets, plan.items, plan.item_counts,
                plan.part_start, plan.part_count, positions, block_tables, scale * LOG2E, num_tokens, *strides,
                NUM_KV_HEADS=num_kv_heads, NUM_HEADS=num_heads, HEADS_P2=max(16, triton.next_power_of_2(num_heads)),
                GROUPS=groups, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=config.lone_block_n,
                NUM_FIELDS=len(ITEM_FIELDS), DOT_PRECISION=constants["DOT_PRECISION"], MERGE=merge,
                LAZY=config.lone_lazy_rescale, INDEX32=constants["INDEX32"], **pdl,
                num_warps=config.lone_num_warps, num_stages=config.lone_num_stages)
            if merge:
                return out
        else:
            lone = max(1, min(pairs, _resident_programs(q.device, LONE_PROGRAMS_PER_SM)))
            _item_kernel[(lone,)](*args, **constants, BLOCK_N=config.lone_block_n, PASS=LONE_PASS,
                                  num_warps=config.lone_num_warps, num_stages=config.lone_num_stages)
    else:  # one row tile for both kinds of item: one launch
        _item_kernel[(queue,)](*args, **constants, BLOCK_N=config.block_n, PASS=ALL_ITEMS,
                               num_warps=config.num_warps, num_stages=config.num_stages)
    heads_p2 = triton.next_power_of_2(num_heads)
    _merge_kernel[(num_tokens,)](
        out, part_o, part_lse, plan.part_start, plan.part_count, counter, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEADS_P2=heads_p2, HEAD_DIM=head_dim, num_warps=4 if heads_p2 * head_dim <= 8192 else 8,
        **pdl)
    return out


@functools.cache
def _resident_programs(device: torch.device, per_sm: int) -> int:
    """Programs of one item-kernel launch: `per_sm` on every SM (the queue's take work until it is
    empty; a lone pass's take every P-th item). The interpreter runs programs one after another:
    two suffice."""
    if device.type != "cuda":
        return 2
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def compiled_variants() -> int:
    """Variants of this module's kernels compiled so far (see triton_ops.compiled_variants)."""
    if triton is None:
        return 0
    kernels = (_item_kernel, _lone_heads_kernel, _merge_kernel)
    return sum(len(cache[0]) for k in kernels for cache in getattr(k, "device_caches", {}).values())


__all__ = ["compiled_variants", "shared_prefix_attention_triton"]
